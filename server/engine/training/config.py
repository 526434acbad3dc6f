"""TrainConfig: the one frozen, validated description of a LoRA training job, from the API to the kernel."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lorad.kernels.capabilities import BACKENDS as CAPABILITY_BACKENDS
from lorad.kernels.capabilities import PRECISIONS
from lorad.server.engine.models.config import LORA_TARGETS, hf_targets
from lorad.server.engine.training.knobs import KNOB, Knob, knob

DEFAULT_TARGETS = LORA_TARGETS  # every projection, by its Hugging Face name
SCHEDULES = ("cosine", "linear", "constant")
CLIP_MODES = ("global", "per_layer")
BACKENDS = ("auto", *CAPABILITY_BACKENDS)


class ConfigError(ValueError):
    """A TrainConfig with one or more invalid fields; `errors` lists every problem found."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("invalid training config:\n  - " + "\n  - ".join(errors))
        self.errors = errors


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one LoRA job, from the API to the kernel. Validated on construction; all problems are
    reported at once.

    Each field declares its help, bounds, API name and a daemon job's default once (``knobs()``); the API's request
    validation, the CLI and the SDK read or are tested against these declarations.
    """

    rank: int = field(default=8, metadata=knob("LoRA rank r.", lo=1, hi=128, api="lora.rank"))
    alpha: float = field(
        default=16.0,
        metadata=knob("LoRA alpha; the adapter output is scaled by alpha / rank.", lo=0, hi=4096, lo_open=True,
                      api="lora.alpha", job_default=lambda d: 2.0 * d["rank"], job_default_doc="2 * rank"),
    )  # fmt: skip
    dropout: float = field(default=0.0, metadata=knob("Dropout on the LoRA input path.", lo=0, hi=0.5,
                                                        api="lora.dropout"))  # fmt: skip
    targets: tuple[str, ...] = field(
        default=DEFAULT_TARGETS,
        metadata=knob("Projections that get adapters (Hugging Face names).", choices=LORA_TARGETS,
                      api="lora.target_modules", job_default_doc="all"),
    )  # fmt: skip
    lr: float = field(
        default=2e-4,
        metadata=knob("Peak learning rate; typical LoRA values are 1e-4..1e-3.", lo=0, hi=1, lo_open=True,
                      hi_open=True, api="learning_rate"),
    )  # fmt: skip
    steps: int = field(default=100, metadata=knob("Optimizer steps.", lo=1, hi=100_000, api="max_steps"))
    batch_size: int = field(default=1, metadata=knob("Sequences per micro-batch.", lo=1, hi=64, api="batch_size"))
    seq_len: int = field(default=256, metadata=knob("Tokens per packed sequence.", lo=16, hi=4096, api="seq_len"))
    grad_accum: int = field(
        default=1, metadata=knob("Micro-batches per optimizer step.", lo=1, hi=64, api="grad_accum_steps")
    )
    warmup_steps: int = field(default=0, metadata=knob("Linear warm-up steps (below steps).", lo=0, api="warmup_steps"))
    schedule: str = field(
        default="cosine", metadata=knob("LR decay after warm-up.", choices=SCHEDULES, api="lr_schedule")
    )
    min_lr_ratio: float = field(
        default=0.0,
        metadata=knob("Final LR as a fraction of lr.", lo=0, hi=1,
                      job_default=lambda d: 0.1 if d["schedule"] == "cosine" else 0.0),  # the API's cosine: 10 %
    )  # fmt: skip
    weight_decay: float = field(
        default=0.0, metadata=knob("Decoupled (AdamW) weight decay.", lo=0, hi=1, api="weight_decay")
    )
    beta1: float = field(default=0.9, metadata=knob("AdamW beta1.", lo=0, hi=1, hi_open=True))
    beta2: float = field(default=0.999, metadata=knob("AdamW beta2.", lo=0, hi=1, hi_open=True))
    eps: float = field(default=1e-8, metadata=knob("AdamW epsilon.", lo=0, lo_open=True))
    max_grad_norm: float = field(
        default=1.0,
        metadata=knob("Gradient clipping threshold; 0 turns clipping off (the API's 0 means 1.0).", lo=0, hi=1e6,
                      api="max_grad_norm"),
    )  # fmt: skip
    clip_mode: str = field(
        default="global",
        metadata=knob(
            "'global': one norm over all adapters (exact, but optimizer steps wait for the full backward); "
            "'per_layer': each layer's adapters are clipped by their own norm, so steps overlap the backward.",
            choices=CLIP_MODES,
        ),
    )
    overlap_optimizer: bool = field(
        default=True, metadata=knob("Step each layer's adapters in a CPU thread as soon as its grads are final.")
    )
    eval_every: int = field(
        default=0, metadata=knob("Eval loss every N steps; 0 = only at the end.", lo=0, api="eval_every_steps",
                                 job_default=25)
    )  # fmt: skip
    eval_batches: int = field(default=8, metadata=knob("Max held-out micro-batches per eval.", lo=1))
    eval_fraction: float = field(
        default=0.05, metadata=knob("Share of samples held out for eval.", lo=0, hi=0.5, api="eval_fraction",
                                    job_default=0.1)
    )  # fmt: skip
    checkpoint_every: int = field(
        default=0, metadata=knob("Checkpoint every N steps; 0 = only on pause/end.", lo=0,
                                 api="checkpoint_every_steps", job_default=50)
    )  # fmt: skip
    keep_checkpoints: int = field(default=2, metadata=knob("Checkpoints kept on disk.", lo=1))
    seed: int = field(
        default=0, metadata=knob("Seed for data order, adapter init and dropout.", lo=0, hi=2**63 - 1, api="seed")
    )
    backend: str = field(default="auto", metadata=knob("Frozen-linear backend.", choices=BACKENDS, api="backend"))
    precision: str = field(
        default="auto",
        metadata=knob("Frozen-linear precision, e.g. 'fp32'; 'auto' plans it per layer by gradient sensitivity.",
                      choices=("auto", *PRECISIONS), api="precision"),
    )  # fmt: skip
    freeze_lora_a: bool = field(
        default=False,
        metadata=knob("Keep every LoRA A fixed and train only B (FFA-LoRA; exact federated averaging).",
                      api="freeze_lora_a"),
    )  # fmt: skip
    precision_budget: float = field(
        default=0.1,
        metadata=knob("precision='auto': allowed relative drift of the LoRA gradients vs the reference.", lo=0, hi=1,
                      lo_open=True),
    )  # fmt: skip

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


def knobs() -> dict[str, Knob]:
    """Every TrainConfig field's declaration, by field name, in field order."""
    return {f.name: f.metadata[KNOB] for f in dataclasses.fields(TrainConfig)}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def field_error(name: str, value: Any) -> str | None:
    """Why ``value`` is not valid for field ``name`` on its own (type, range, choices), or None."""
    f = next(f for f in dataclasses.fields(TrainConfig) if f.name == name)
    k: Knob = f.metadata[KNOB]
    if isinstance(f.default, bool):
        return None if isinstance(value, bool) else f"{name}={value!r}: must be a bool"
    if isinstance(f.default, int):
        if not _is_int(value) or not k.admits(value):
            return f"{name}={value!r}: must be an integer, {k.span()}"
        return None
    if isinstance(f.default, float):
        if not _is_num(value) or not k.admits(value):
            return f"{name}={value!r}: must be a number, {k.span()}"
        return None
    if isinstance(f.default, tuple):
        if not isinstance(value, tuple) or not value or not all(isinstance(t, str) and t for t in value):
            return f"{name}={value!r}: must be a non-empty tuple of names, e.g. {f.default}"
        if len(set(value)) != len(value):
            return f"{name}={value!r}: contains duplicates"
        bad = [t for t in value if t not in k.choices]
        return f"{name}={value!r}: unknown {bad}; choose among {k.choices}" if bad else None
    if k.choices and value not in k.choices:
        return f"{name}={value!r}: must be one of {k.choices}"
    return None


def _validate(c: TrainConfig) -> list[str]:
    e = [m for f in dataclasses.fields(c) if (m := field_error(f.name, getattr(c, f.name))) is not None]
    if _is_int(c.warmup_steps) and _is_int(c.steps) and c.warmup_steps >= c.steps:
        e.append(f"warmup_steps={c.warmup_steps}: must be < steps={c.steps}")
    return e


def api_knobs() -> dict[str, Knob]:
    """The fields a daemon job's request sets (the API's ``TrainingConfig``), by field name."""
    return {n: k for n, k in knobs().items() if k.api}


def api_key(k: Knob) -> str:
    """The API's name of a field (the last part of its path: ``lora.rank`` → ``rank``)."""
    return k.api.rsplit(".", 1)[-1]


def job_config(given: Mapping[str, Any]) -> TrainConfig:
    """A daemon job's config: the values ``given`` (field name → value), every other field at its job default.

    Raises:
        ConfigError: a given value is invalid (the job defaults themselves always are valid).
    """
    decided: dict[str, Any] = {}
    for f in dataclasses.fields(TrainConfig):
        decided[f.name] = given[f.name] if f.name in given else f.metadata[KNOB].api_default(f.default, decided)
    return TrainConfig(**decided)
