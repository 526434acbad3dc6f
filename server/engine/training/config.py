"""TrainConfig: the frozen, validated description of one LoRA training job."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lorad.server.engine.models.config import LORA_TARGETS, hf_targets

DEFAULT_TARGETS = LORA_TARGETS  # every projection, by its Hugging Face name
SCHEDULES = ("cosine", "linear", "constant")
CLIP_MODES = ("global", "per_layer")
BACKENDS = ("auto", "torch", "ort-cpu", "qnn-htp")


class ConfigError(ValueError):
    """A TrainConfig with one or more invalid fields; `errors` lists every problem found."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("invalid training config:\n  - " + "\n  - ".join(errors))
        self.errors = errors


def _meta(help_text: str) -> dict[str, str]:
    return {"help": help_text}


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one LoRA job. Validated on construction; all problems are reported at once."""

    rank: int = field(default=8, metadata=_meta("LoRA rank r (>= 1)."))
    alpha: float = field(default=16.0, metadata=_meta("LoRA alpha; the adapter output is scaled by alpha / rank."))
    dropout: float = field(default=0.0, metadata=_meta("Dropout on the LoRA input path, in [0, 1)."))
    targets: tuple[str, ...] = field(default=DEFAULT_TARGETS, metadata=_meta("Linear names that get adapters."))
    lr: float = field(default=2e-4, metadata=_meta("Peak learning rate (> 0)."))
    steps: int = field(default=100, metadata=_meta("Optimizer steps (>= 1)."))
    batch_size: int = field(default=1, metadata=_meta("Sequences per micro-batch (>= 1)."))
    seq_len: int = field(default=256, metadata=_meta("Tokens per packed sequence (>= 8)."))
    grad_accum: int = field(default=1, metadata=_meta("Micro-batches per optimizer step (>= 1)."))
    warmup_steps: int = field(default=0, metadata=_meta("Linear warm-up steps (0 <= warmup_steps < steps)."))
    schedule: str = field(default="cosine", metadata=_meta(f"LR decay after warm-up: one of {SCHEDULES}."))
    min_lr_ratio: float = field(default=0.0, metadata=_meta("Final LR as a fraction of lr, in [0, 1]."))
    weight_decay: float = field(default=0.0, metadata=_meta("Decoupled (AdamW) weight decay (>= 0)."))
    beta1: float = field(default=0.9, metadata=_meta("AdamW beta1 in [0, 1)."))
    beta2: float = field(default=0.999, metadata=_meta("AdamW beta2 in [0, 1)."))
    eps: float = field(default=1e-8, metadata=_meta("AdamW epsilon (> 0)."))
    max_grad_norm: float = field(default=1.0, metadata=_meta("Gradient clipping threshold; 0 turns clipping off."))
    clip_mode: str = field(
        default="global",
        metadata=_meta(
            "'global': one norm over all adapters (exact, but optimizer steps wait for the full backward); "
            "'per_layer': each layer's adapters are clipped by their own norm, so steps overlap the backward."
        ),
    )
    overlap_optimizer: bool = field(
        default=True, metadata=_meta("Step each layer's adapters in a CPU thread as soon as its grads are final.")
    )
    eval_every: int = field(default=0, metadata=_meta("Eval loss every N steps; 0 = only at the end."))
    eval_batches: int = field(default=8, metadata=_meta("Max held-out micro-batches per eval (>= 1)."))
    eval_fraction: float = field(default=0.05, metadata=_meta("Share of samples held out for eval, in [0, 0.5]."))
    checkpoint_every: int = field(default=0, metadata=_meta("Checkpoint every N steps; 0 = only on pause/end."))
    keep_checkpoints: int = field(default=2, metadata=_meta("Checkpoints kept on disk (>= 1)."))
    seed: int = field(default=0, metadata=_meta("Seed for data order, adapter init and dropout (>= 0)."))
    backend: str = field(default="auto", metadata=_meta(f"Frozen-linear backend: one of {BACKENDS}."))
    precision: str = field(
        default="auto",
        metadata=_meta("Frozen-linear precision, e.g. 'fp32'; 'auto' plans it per layer by gradient sensitivity."),
    )
    freeze_lora_a: bool = field(
        default=False, metadata=_meta("Keep every LoRA A fixed and train only B (FFA-LoRA; exact federated averaging).")
    )
    precision_budget: float = field(
        default=0.1,
        metadata=_meta("precision='auto': allowed relative drift of the LoRA gradients vs the reference, in (0, 1]."),
    )

    def __post_init__(self) -> None:
        errors = _validate(self)
        if errors:
            raise ConfigError(errors)

    @property
    def scaling(self) -> float:
        """The LoRA output scale alpha / rank."""
        return self.alpha / self.rank

    @property
    def tokens_per_step(self) -> int:
        """Input tokens consumed by one optimizer step."""
        return self.batch_size * self.seq_len * self.grad_accum

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (targets as a list)."""
        d = dataclasses.asdict(self)
        d["targets"] = list(self.targets)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Builds a config from a dict (e.g. TOML); unknown keys are reported together with invalid values.

        Raises:
            ConfigError: unknown keys or invalid values.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        kwargs = {k: v for k, v in d.items() if k in names}
        if "targets" in kwargs and isinstance(kwargs["targets"], list):
            kwargs["targets"] = hf_targets(kwargs["targets"])  # a dict written before HF names may say q, k, …
        errors = [f"unknown key {k!r}; known keys: {', '.join(sorted(names))}" for k in unknown]
        try:
            cfg = cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(errors + e.errors) from None
        if errors:
            raise ConfigError(errors)
        return cfg


def _check(errors: list[str], ok: bool, message: str) -> None:
    if not ok:
        errors.append(message)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _validate(c: TrainConfig) -> list[str]:
    e: list[str] = []
    ints = {
        "rank": 1,
        "steps": 1,
        "batch_size": 1,
        "seq_len": 8,
        "grad_accum": 1,
        "eval_batches": 1,
        "keep_checkpoints": 1,
        "warmup_steps": 0,
        "eval_every": 0,
        "checkpoint_every": 0,
        "seed": 0,
    }
    for name, lo in ints.items():
        v = getattr(c, name)
        _check(e, _is_int(v) and v >= lo, f"{name}={v!r}: must be an integer >= {lo}")
    nums = [
        "alpha",
        "dropout",
        "lr",
        "min_lr_ratio",
        "weight_decay",
        "beta1",
        "beta2",
        "eps",
        "max_grad_norm",
        "eval_fraction",
        "precision_budget",
    ]
    bad_num = {n for n in nums if not _is_num(getattr(c, n))}
    for n in sorted(bad_num):
        e.append(f"{n}={getattr(c, n)!r}: must be a number")
    ranges = {
        "alpha": (lambda v: v > 0, "> 0"),
        "dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
        "lr": (lambda v: 0 < v < 1, "in (0, 1); typical LoRA values are 1e-4..1e-3"),
        "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
        "weight_decay": (lambda v: v >= 0, ">= 0"),
        "beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
        "beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
        "eps": (lambda v: v > 0, "> 0"),
        "max_grad_norm": (lambda v: v >= 0, ">= 0 (0 turns clipping off)"),
        "eval_fraction": (lambda v: 0 <= v <= 0.5, "in [0, 0.5]"),
        "precision_budget": (lambda v: 0 < v <= 1, "in (0, 1]"),
    }
    for n, (ok, desc) in ranges.items():
        if n not in bad_num:
            _check(e, ok(getattr(c, n)), f"{n}={getattr(c, n)!r}: must be {desc}")
    if _is_int(c.warmup_steps) and _is_int(c.steps):
        _check(e, c.warmup_steps < c.steps, f"warmup_steps={c.warmup_steps}: must be < steps={c.steps}")
    _check(e, c.schedule in SCHEDULES, f"schedule={c.schedule!r}: must be one of {SCHEDULES}")
    _check(e, c.clip_mode in CLIP_MODES, f"clip_mode={c.clip_mode!r}: must be one of {CLIP_MODES}")
    _check(e, c.backend in BACKENDS, f"backend={c.backend!r}: must be one of {BACKENDS}")
    _check(e, isinstance(c.precision, str) and bool(c.precision), f"precision={c.precision!r}: must be a plan name")
    _check(e, isinstance(c.overlap_optimizer, bool), f"overlap_optimizer={c.overlap_optimizer!r}: must be a bool")
    targets_ok = (
        isinstance(c.targets, tuple) and len(c.targets) > 0 and all(isinstance(t, str) and t for t in c.targets)
    )
    _check(e, targets_ok, f"targets={c.targets!r}: must be a non-empty tuple of linear names, e.g. {DEFAULT_TARGETS}")
    if targets_ok:
        _check(e, len(set(c.targets)) == len(c.targets), f"targets={c.targets!r}: contains duplicates")
        bad = [t for t in c.targets if t not in DEFAULT_TARGETS]
        _check(e, not bad, f"targets={c.targets!r}: unknown {bad}; choose among {DEFAULT_TARGETS}")
    return e
