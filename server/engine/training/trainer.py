"""The training loop: micro-batches, token-weighted gradient accumulation, layer-wise AdamW, eval, pause, resume."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog
import torch
from torch import nn

from lorad.server.engine.models.heap import keep_freed_heap, release_free_heap
from lorad.server.engine.training import checkpoint as ckpt
from lorad.server.engine.training.config import TrainConfig
from lorad.server.engine.training.data import PreparedData
from lorad.server.engine.training.heartbeat import Heartbeat
from lorad.server.engine.training.optim import LayerwiseAdamW, StepStats
from lorad.server.engine.training.packing import BatchStream, eval_batches, target_count, trim_tail
from lorad.server.engine.training.schedule import lr_at

log = structlog.get_logger(__name__)

# Config fields that define the numbers a run produces; a checkpoint resumes only into a job where they match.
NUMERIC_FIELDS = (
    "rank",
    "alpha",
    "dropout",
    "targets",
    "lr",
    "steps",
    "batch_size",
    "seq_len",
    "grad_accum",
    "warmup_steps",
    "schedule",
    "min_lr_ratio",
    "weight_decay",
    "beta1",
    "beta2",
    "eps",
    "max_grad_norm",
    "clip_mode",
    "seed",
    "eval_fraction",
)


class LoraModel(Protocol):
    """What the trainer needs from a model with LoRA adapters."""

    training: bool

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor: ...

    def lora_groups(self) -> list[tuple[str, list[nn.Parameter]]]: ...

    def lora_state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_lora_state_dict(self, state: dict[str, torch.Tensor]) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...


PhaseCallback = Callable[[str, float | None], None]
"""``on_phase(phase, fraction)``: the run entered ``phase`` ("loading", "planning", "training", "evaluating",
"exporting"); ``fraction`` is the progress within it (0..1) or None for phases without a measure. The recipe reports
loading/planning/exporting, the trainer "training" when its loop starts and "evaluating" before each held-out pass;
each ``on_progress`` call means a training step finished (phase "training" again). Called on the training thread, except
that "planning" is also repeated about once a second from a heartbeat thread (never concurrently with another call)."""


CheckpointCallback = Callable[["ckpt.CheckpointInfo", float], None]
"""``on_checkpoint(info, train_loss)``: a checkpoint was written (reported after that step's progress; ``train_loss``
is the last step's loss). Pruned older checkpoints are not reported again; the listener forgets them itself. The
checkpoint a run resumes from is reported again when it is restored (a kill may have come before its first report)."""


@dataclass(frozen=True)
class Progress:
    """One progress report, sent after every optimizer step."""

    step: int
    total_steps: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float  # the samples' tokens (padding excluded) per second, over recent steps
    eta_s: float
    eval_loss: float | None
    tokens_seen: int  # the samples' tokens trained on so far (padding excluded), over the whole job


@dataclass
class TrainResult:
    """How a run ended: "completed" or "paused", at which step, with the per-step history."""

    status: str
    step: int
    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    checkpoint: Path | None = None
    step_times: list[float] = field(default_factory=list)
    optim_times: list[float] = field(default_factory=list)  # s of AdamW work per step (overlapped or not)
    optim_waits: list[float] = field(default_factory=list)  # s the step waited for the optimizer thread after backward
    tokens: list[int] = field(default_factory=list)  # the samples' tokens each step trained on (padding excluded)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Runs the block with `n` torch intra-op threads (n <= 0: unchanged), restoring the previous count after."""
    before = torch.get_num_threads()
    if n > 0 and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


class Trainer:
    """Runs optimizer steps on a LoRA model; checkpoints make a paused or crashed run continue exactly."""

    def __init__(
        self,
        model: LoraModel,
        cfg: TrainConfig,
        data: PreparedData,
        *,
        pad_id: int,
        checkpoint_dir: Path | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        should_pause: Callable[[], bool] | None = None,
        on_phase: PhaseCallback | None = None,
        on_checkpoint: CheckpointCallback | None = None,
    ) -> None:
        """Wires the model, data stream and optimizer; nothing runs until `run()`."""
        self.model, self.cfg, self.data = model, cfg, data
        self.ckpt_dir = checkpoint_dir
        self.on_progress = on_progress
        self.on_phase = on_phase
        self.on_checkpoint = on_checkpoint
        self._unreported: list[Path] = []
        self._reported: set[Path] = set()  # the final save can rewrite the step a periodic one just wrote
        self.should_pause = should_pause or (lambda: False)
        self.stream = BatchStream(
            data.train, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed, pad_id=pad_id
        )
        self.eval_set = [
            trim_tail(x, y)
            for x, y in eval_batches(
                data.eval, seq_len=cfg.seq_len, batch_size=cfg.batch_size, pad_id=pad_id, max_batches=cfg.eval_batches
            )
        ]
        self.optim = LayerwiseAdamW(
            model.lora_groups(),
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            max_grad_norm=cfg.max_grad_norm,
            clip_mode=cfg.clip_mode,
            overlap=cfg.overlap_optimizer,
        )
        self.step = 0
        self.last_stats = StepStats(0.0, 0, 0.0, 0.0)
        self.last_tokens = 0  # the samples' tokens of the last step's micro-batches (padding excluded)
        keep_freed_heap()  # every step frees and reallocates the same activations: reuse them warm (heap.py)
        self.history = TrainResult(status="running", step=0)

    # -- checkpoints -------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Everything needed to continue exactly from the current step boundary."""
        return {
            "step": self.step,
            "config": self.cfg.to_dict(),
            "data_fingerprint": self.data.fingerprint,
            "cursor": self.stream.cursor,
            "adapter": {k: v.detach().clone() for k, v in self.model.lora_state_dict().items()},
            "optimizer": self.optim.state_dict(),
            "rng": ckpt.capture_rng(),
            "history": {
                "losses": list(self.history.losses),
                "eval": [list(e) for e in self.history.eval_losses],
                "tokens": list(self.history.tokens),
            },
        }

    def save_checkpoint(self) -> Path:
        """Writes a checkpoint of the current step boundary.

        Raises:
            ValueError: the trainer has no checkpoint directory.
        """
        if self.ckpt_dir is None:
            raise ValueError("Trainer was created without checkpoint_dir")
        path = ckpt.save(self.ckpt_dir, self.state(), keep=self.cfg.keep_checkpoints)
        self.history.checkpoint = path
        self._unreported.append(path)
        return path

    def _report_checkpoints(self) -> None:
        """Tells ``on_checkpoint`` about checkpoints written since the last report (after the step's progress)."""
        paths, self._unreported = self._unreported, []
        if self.on_checkpoint is None:
            return
        loss = self.history.losses[-1] if self.history.losses else 0.0
        for p in paths:
            if p.exists() and p not in self._reported:  # not pruned by a newer one, not told already
                self._reported.add(p)
                self.on_checkpoint(ckpt.CheckpointInfo(self.step, p, p.stat().st_size), loss)

    def restore(self, path: Path) -> None:
        """Continues from a checkpoint: adapter, optimizer, step, data cursor, RNG and history.

        Raises:
            CheckpointError: the checkpoint is invalid or belongs to another job or data set.
        """
        expect = {
            "config": {k: self.cfg.to_dict()[k] for k in NUMERIC_FIELDS},
            "data_fingerprint": self.data.fingerprint,
            "adapter_shapes": {k: tuple(v.shape) for k, v in self.model.lora_state_dict().items()},
        }
        state = ckpt.load(path, expect=expect)
        self.model.load_lora_state_dict(state["adapter"])
        self.optim.load_state_dict(state["optimizer"])
        self.stream.seek(state["cursor"])
        ckpt.restore_rng(state["rng"])
        self.step = int(state["step"])
        self.history.losses = [float(x) for x in state["history"]["losses"]]
        self.history.eval_losses = [(int(s), float(v)) for s, v in state["history"]["eval"]]
        tokens = state["history"].get("tokens")
        # A checkpoint from before tokens were counted: its steps count as full sequences, padding included.
        ok = isinstance(tokens, list) and len(tokens) == self.step
        self.history.tokens = [int(n) for n in tokens] if ok else [self.cfg.tokens_per_step] * self.step
        log.info("checkpoint_restored", step=self.step)
        # Told like a new one: a kill between writing a checkpoint and its report leaves one nobody was told about,
        # and it is the one this run stands on (the listener ignores one it already has).
        self._unreported.append(path)
        self._report_checkpoints()

    # -- steps -------------------------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float, float]:
        """One optimizer step over `grad_accum` micro-batches; returns (loss, lr, grad_norm).

        Each micro-batch's mean loss is weighted by its share of the window's target tokens, so accumulating k
        micro-batches of size b equals one batch of size k·b.
        """
        lr = lr_at(
            self.step,
            lr=self.cfg.lr,
            steps=self.cfg.steps,
            warmup_steps=self.cfg.warmup_steps,
            schedule=self.cfg.schedule,
            min_lr_ratio=self.cfg.min_lr_ratio,
        )
        self.optim.set_lr(lr)
        with torch_threads(int(getattr(self.model, "torch_threads", 0))):
            return self._train_step(lr)

    def _train_step(self, lr: float) -> tuple[float, float, float]:
        """The micro-batch loop of `train_step` (torch threads already set for the model's backend)."""
        batches = [self.stream.next_batch() for _ in range(self.cfg.grad_accum)]
        self.last_tokens = sum(b.tokens for b in batches)
        micro = [trim_tail(b.input_ids, b.labels) for b in batches]
        counts = [target_count(y) for _, y in micro]
        total = sum(counts)
        loss_sum = 0.0
        for i, ((x, y), n) in enumerate(zip(micro, counts, strict=False)):
            if n == 0:
                continue  # nothing to learn from this micro-batch (all labels ignored)
            self.optim.arm(last_micro_step=i == len(micro) - 1)
            loss = self.model(x, y)
            (loss * (n / total)).backward()
            loss_sum += float(loss.detach()) * n / total
        stats = self.optim.finish()
        self.last_stats = stats
        self.step += 1
        return (loss_sum if total else float("nan")), lr, stats.grad_norm

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Token-weighted mean loss over the held-out batches (dropout off); None without held-out data."""
        if not self.eval_set:
            return None
        was_training = self.model.training
        self.model.train(False)
        num = den = 0.0
        with torch_threads(int(getattr(self.model, "torch_threads", 0))):
            for x, y in self.eval_set:
                n = target_count(y)
                if n:
                    num += float(self.model(x, y)) * n
                    den += n
        self.model.train(was_training)
        return num / den if den else None

    def run(self) -> TrainResult:
        """Trains until `cfg.steps` or until `should_pause()` is true at a step boundary.

        Returns:
            status "completed" (final checkpoint written if there is a directory) or "paused" (checkpoint written).
        """
        cfg, res = self.cfg, self.history
        self.model.train(True)
        ema: float | None = None
        ema_tokens = 0.0
        if self.on_phase is not None:
            self.on_phase("training", self.step / cfg.steps if cfg.steps else 0.0)
        first = True
        seen = sum(res.tokens)  # tokens trained on so far (a resumed job's history included), then a running total
        while self.step < cfg.steps:
            if self.should_pause():
                res.status, res.step = "paused", self.step
                if self.ckpt_dir is not None:
                    self.save_checkpoint()
                    self._report_checkpoints()
                log.info("training_paused", step=self.step)
                return res
            t0 = time.perf_counter()
            loss, lr, gnorm = self._first_step() if first else self.train_step()
            first = False
            dt = time.perf_counter() - t0
            res.losses.append(loss)
            res.step_times.append(dt)
            res.optim_times.append(self.last_stats.optim_s)
            res.optim_waits.append(self.last_stats.wait_s)
            res.tokens.append(self.last_tokens)
            seen += self.last_tokens
            ema_tokens = self.last_tokens if ema is None else 0.8 * ema_tokens + 0.2 * self.last_tokens
            ema = dt if ema is None else 0.8 * ema + 0.2 * dt
            ev = None
            if (cfg.eval_every and self.step % cfg.eval_every == 0) or self.step == cfg.steps:
                if self.on_phase is not None and self.eval_set:
                    self.on_phase("evaluating", None)
                ev = self.evaluate()
                if ev is not None:
                    res.eval_losses.append((self.step, ev))
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.ckpt_dir is not None:
                self.save_checkpoint()
            log.info(
                "train_step", step=self.step, loss=round(loss, 5), lr=lr, grad_norm=round(gnorm, 4), step_s=round(dt, 4)
            )
            if self.on_progress is not None:
                self.on_progress(
                    Progress(
                        self.step,
                        cfg.steps,
                        loss,
                        lr,
                        gnorm,
                        ema_tokens / ema if ema > 0 else 0.0,
                        ema * (cfg.steps - self.step),
                        ev,
                        seen,
                    )
                )
            self._report_checkpoints()
        res.status, res.step = "completed", self.step
        if self.ckpt_dir is not None:
            self.save_checkpoint()
            self._report_checkpoints()
        return res

    def _first_step(self) -> tuple[float, float, float]:
        """A run's first step, with the "training" phase repeated about once a second meanwhile: it builds the
        kernels and step buffers (2.4 s on a fresh daemon for SmolLM2 on 2 cores, twice a warm step)."""
        if self.on_phase is None:
            return self.train_step()
        on_phase, at = self.on_phase, self.step / self.cfg.steps if self.cfg.steps else 0.0
        with Heartbeat(lambda f: on_phase("training", f), fraction=at):
            return self.train_step()

    def close(self) -> None:
        """Releases the optimizer thread and hooks, and gives the step buffers' freed memory back to the OS."""
        self.optim.close()
        release_free_heap()
