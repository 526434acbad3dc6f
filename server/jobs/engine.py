"""The real TrainingSession: runs the engine's training recipe on the job's samples and saves a PEFT adapter."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from lorad.server.backend import BackendDecision
from lorad.server.jobs.session import AdapterArtifact, JobFailure, SessionOutcome, SessionRequest, SessionSink
from lorad.server.modelhost import ModelHost, import_engine
from lorad.server.records import DataSummary, Phase, Progress, SampleBody

if TYPE_CHECKING:
    from lorad.server.engine.api import DataReport, LoadedModel, PreparedData, Sample, TrainConfig
    from lorad.server.engine.api import Progress as StepProgress  # the trainer's; records.Progress is what jobs report

log = structlog.get_logger(__name__)


def _training_samples(bodies: tuple[SampleBody, ...]) -> list[Sample]:
    from lorad.server.engine.api import ChatSample, Message, TextSample

    out: list[Sample] = []
    for b in bodies:
        if b.text is not None:
            out.append(TextSample(b.text))
        else:
            out.append(ChatSample(tuple(Message(m.role, m.content) for m in b.messages or ())))
    return out


def measure_base_eval_loss(loaded: LoadedModel, cfg: TrainConfig, data: PreparedData) -> float | None:
    """The held-out loss of ``loaded.model`` on ``data`` (``prepare``'s output) as the trainer measures it.

    Uses the trainer's own ``Trainer.evaluate`` on a throw-away Trainer over the same model; the global RNG state is
    restored afterwards, so measuring does not change the training run that follows.

    Returns:
        The token-weighted mean loss, or None when the job has no held-out samples.
    """
    from lorad.server.engine.api import Trainer, capture_rng, restore_rng

    tok = loaded.tokenizer
    rng = capture_rng()
    trainer = Trainer(loaded.model, cfg, data, pad_id=tok.eos_id if tok.eos_id is not None else 0)
    try:
        t0 = time.perf_counter()
        loss = trainer.evaluate()
        log.info("eval_before_measured", loss=loss, seconds=round(time.perf_counter() - t0, 3))
        return loss
    finally:
        trainer.close()
        restore_rng(rng)


def data_summary(report: DataReport) -> DataSummary:
    """The engine's DataReport as the typed summary jobs report (rejected counts by reason)."""
    return DataSummary(
        total_samples=int(report.total), train_samples=int(report.train_samples),
        eval_samples=int(report.eval_samples), train_tokens=int(report.train_tokens),
        rejected=tuple(sorted((str(k), int(v)) for k, v in dict(report.rejected).items() if v)),
    )  # fmt: skip


def start_from_adapter(loaded: LoadedModel, path: Path) -> None:
    """Copies a stored adapter's A and B into the freshly built model (a resume then restores its checkpoint).

    Raises:
        JobFailure: the adapter is for another base, or its shape differs from the job's model.
    """
    from lorad.server.engine.api import AdapterBaseMismatchError, apply_adapter, load_adapter

    try:
        apply_adapter(loaded.model, load_adapter(path), model_hash=loaded.model_hash,
                      tokenizer_hash=loaded.tokenizer_hash)  # fmt: skip
    except AdapterBaseMismatchError as exc:
        raise JobFailure("init_adapter_mismatch", str(exc)) from None
    except (KeyError, ValueError, FileNotFoundError) as exc:
        raise JobFailure("init_adapter_mismatch", f"the init adapter does not fit: {str(exc)[:200]}") from None


class EngineSession:
    """One RUNNING period of a job on the real trainer (resumes from the newest checkpoint in the work dir)."""

    def __init__(self, req: SessionRequest, models: ModelHost, cache_root: Path, backend: BackendDecision,
                 loader: Callable[..., Any] | None = None) -> None:  # fmt: skip
        """``backend`` is the daemon's decision; ``loader`` has ``lorad.server.engine.api.load_model``'s signature
        (None: the engine's own loader)."""
        self.req, self.models, self.cache_root = req, models, cache_root
        self.backend = backend.for_job(req.spec.params.backend)  # what this job trains on, and why
        self.loader = loader

    def _train_config(self) -> TrainConfig:
        """The job's stored config on the backend it was given, keeping as many checkpoints as the daemon keeps."""
        return dataclasses.replace(self.req.spec.params, backend=self.backend.name,
                                   keep_checkpoints=self.req.keep_checkpoints)  # fmt: skip

    def run(self, should_stop: Callable[[], bool], sink: SessionSink) -> SessionOutcome:
        """Runs the recipe; reports progress, evals and checkpoints to ``sink``."""
        import_engine()
        from lorad.server.engine.api import (
            CheckpointError,
            CheckpointInfo,
            DataError,
            Heartbeat,
            checkpoint_dir,
            latest_checkpoint,
            prepare,
            run_recipe,
        )

        cfg = self._train_config()
        entry = self.models.entry(self.req.spec.base_model)
        info = self.backend
        sink.backend(info.name, info.reason)
        ckpt_dir = checkpoint_dir(self.req.work_dir)
        state: dict[str, Any] = {"eval": None, "meta": None}

        def on_checkpoint(c: CheckpointInfo, loss: float) -> None:
            sink.checkpoint(c.step, c.path, c.size_bytes, loss)

        def on_progress(pr: StepProgress) -> None:
            if pr.eval_loss is not None:
                state["eval"] = pr.eval_loss
            eta = pr.eta_s if pr.eta_s is not None and math.isfinite(pr.eta_s) else None
            sink.progress(
                Progress(step=pr.step, total_steps=pr.total_steps, train_loss=float(pr.loss), eval_loss=state["eval"],
                         tokens_per_second=float(pr.tokens_per_s), eta_seconds=int(eta) if eta is not None else None,
                         learning_rate=float(pr.lr), tokens_seen=pr.tokens_seen),
                evaluated=pr.eval_loss is not None,
            )  # fmt: skip

        def save(model: Any, out: Path, meta: dict[str, Any]) -> Path:
            from lorad.server.engine.api import Adapter, AdapterMetadata, portable_base_name, save_adapter

            # The hub id PEFT can load (or the folder's name), never this device's path; the content hash in
            # lorad_metadata.json says exactly which weights.
            base_name = portable_base_name(entry.source)

            state["meta"] = meta
            losses = meta.get("eval_losses") or []
            plan = meta.get("precision_plan") or meta.get("precision", "fp32")  # "auto": sha256, summary, layers
            md = AdapterMetadata(
                base_model_hash=meta["base_model_hash"], tokenizer_hash=meta["tokenizer_hash"], rank=cfg.rank,
                alpha=cfg.alpha, targets=tuple(cfg.targets), precision_plan=plan,
                backend=meta.get("backend", info.name), steps=int(meta.get("steps", 0)),
                data_window={"samples": len(self.req.samples), **(meta.get("data_report") or {})},
                metrics={k: float(v) for k, v in (("train_loss", meta.get("final_loss")),
                                                  ("eval_loss", losses[-1][1] if losses else None)) if v is not None},
                base_model_source=base_name,
            )  # fmt: skip
            return save_adapter(out, Adapter.from_model(model, md), base_name_or_path=base_name)

        samples = _training_samples(self.req.samples)
        before = self.req.eval_loss_before
        last = latest_checkpoint(ckpt_dir) if ckpt_dir.is_dir() else None
        resumed = {"told": False}

        def on_phase(name: str, fraction: float | None) -> None:
            phase = Phase(name)
            if phase is Phase.TRAINING and last is not None and not resumed["told"]:
                resumed["told"] = True  # the trainer starts its loop only after the checkpoint was restored
                sink.notice(f"resumed from checkpoint step {last.step}")
            sink.phase(phase, fraction)

        def on_loaded(loaded: LoadedModel) -> None:
            # run_recipe calls this before restoring any checkpoint: the fresh adapter's B is zero, so this model
            # computes exactly the base model's loss. The data is prepared here too (the recipe prepares it again,
            # deterministically: tokenizing is ~1 ms per sample) so its notice arrives before training starts.
            nonlocal before
            if self.req.init_adapter is not None:
                start_from_adapter(loaded, self.req.init_adapter)  # before measuring: "before" is this adapter's loss
            try:
                data = prepare(samples, loaded.tokenizer, seq_len=cfg.seq_len, eval_fraction=cfg.eval_fraction)
            except DataError as exc:
                sink.data(data_summary(exc.report))
                raise
            sink.data(data_summary(data.report))
            if not data.eval:
                sink.warning(
                    f"no held-out samples ({data.report.train_samples} usable): no eval loss will be reported; "
                    "add samples or raise eval_fraction"
                )
            elif before is None:
                with Heartbeat(lambda f: sink.phase(Phase.EVALUATING, f)) as beat:  # heard every ~1 s meanwhile
                    beat.set(None)
                    before = measure_base_eval_loss(loaded, cfg, data)
                if before is not None:
                    sink.eval_before(before, cfg.steps)

        try:
            res = run_recipe(
                cfg, samples, work_dir=self.req.work_dir, cache_root=self.cache_root, model_source=entry.source,
                on_progress=on_progress, should_pause=should_stop, load=self.loader, save_adapter=save,
                on_phase=on_phase, on_loaded=on_loaded, on_checkpoint=on_checkpoint, backend=info,
                defer_planning=True, on_notice=sink.notice,
            )  # fmt: skip
        except DataError as exc:
            raise JobFailure("no_usable_samples", str(exc)) from None
        except CheckpointError as exc:
            raise JobFailure("checkpoint_invalid", str(exc)) from None
        except FileNotFoundError as exc:
            raise JobFailure("model_unavailable", str(exc)) from None
        except MemoryError:
            raise JobFailure("out_of_memory", "training ran out of memory; lower seq_len or batch_size") from None
        # A full disk is no failure: it propagates, and the runner has the job wait for space (Blocked.DISK_FULL).
        rep = res.data_report
        if res.status != "completed" or res.adapter_dir is None:
            return SessionOutcome(completed=False)
        meta = state["meta"] or {}
        evals = res.eval_losses
        art = AdapterArtifact(
            path=res.adapter_dir, base_model=entry.name, base_model_sha256=meta.get("base_model_hash", ""),
            tokenizer_sha256=meta.get("tokenizer_hash", ""), steps=res.step,
            train_loss=float(res.losses[-1]) if res.losses else float("nan"),
            eval_loss_before=float("nan") if before is None else before,
            eval_loss_after=float(evals[-1][1]) if evals else float("nan"),
            sample_count=int(getattr(rep, "train_samples", len(self.req.samples))),
            precision_plan=res.precision_plan or (("*", res.precision, res.precision),),
        )  # fmt: skip
        return SessionOutcome(completed=True, adapter=art)


def engine_factory(models: ModelHost, cache_root: Path, backend: BackendDecision, torch_threads: int = 0,
                   loader: Callable[..., Any] | None = None) -> Callable[[SessionRequest], EngineSession]:  # fmt: skip
    """The SessionFactory the daemon uses; ``torch_threads`` > 0 caps torch's intra-op threads (process-wide).

    ``loader`` replaces ``load_model`` (the QNN bundle loader when ``training.qnn_bundle`` is set).
    """
    if torch_threads > 0:
        import torch

        torch.set_num_threads(torch_threads)
    return lambda req: EngineSession(req, models, cache_root, backend, loader)
