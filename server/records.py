"""The daemon's records: apps, samples, jobs and their states, adapters, schedules (protos only in rpc/convert.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from lorad.server.engine.api import TrainConfig


class JobState(enum.StrEnum):
    """Lifecycle of a job (see jobs.proto for the diagram)."""

    QUEUED = "queued"
    WAITING = "waiting"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        """True for SUCCEEDED, FAILED and CANCELLED."""
        return self in FINAL_STATES


FINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE_STATES = frozenset(set(JobState) - FINAL_STATES)


class Blocked(enum.StrEnum):
    """Why a job is not running; NONE when it is not blocked."""

    NONE = ""
    OUTSIDE_WINDOW = "outside_window"
    NPU_BUSY = "npu_busy"
    NOT_CHARGING = "not_charging"
    BATTERY_LOW = "battery_low"
    TOO_HOT = "too_hot"
    DEVICE_BUSY = "device_busy"
    CONDITIONS_UNKNOWN = "conditions_unknown"
    PAUSED_BY_USER = "paused_by_user"
    DISK_FULL = "disk_full"


class EventKind(enum.StrEnum):
    """What a job event records."""

    STATE_CHANGED = "state_changed"
    PROGRESS = "progress"
    EVAL = "eval"
    CHECKPOINT = "checkpoint"
    NOTICE = "notice"
    PHASE = "phase"
    WARNING = "warning"


@dataclass(frozen=True)
class Message:
    """One chat turn; role is "system", "user" or "assistant"."""

    role: str
    content: str


@dataclass(frozen=True)
class SampleBody:
    """Exactly one of ``text`` or ``messages`` is set."""

    text: str | None = None
    messages: tuple[Message, ...] | None = None

    @property
    def size_bytes(self) -> int:
        """UTF-8 bytes of the sample's text content."""
        if self.text is not None:
            return len(self.text.encode())
        return sum(len(m.content.encode()) for m in self.messages or ())


@dataclass(frozen=True)
class Quota:
    """Per-app limits."""

    max_samples: int
    max_sample_bytes: int
    max_adapters: int
    max_active_jobs: int


@dataclass(frozen=True)
class App:
    """A registered app and its usage now."""

    app_id: str
    display_name: str
    created_at_ms: int
    quota: Quota
    revoked: bool = False
    sample_count: int = 0
    sample_bytes: int = 0


@dataclass(frozen=True)
class Dataset:
    """A named collection of one app's samples."""

    dataset_id: str
    sample_count: int
    size_bytes: int
    created_at_ms: int
    updated_at_ms: int


@dataclass(frozen=True)
class StoredSample:
    """A committed sample."""

    sample_id: str
    created_at_ms: int
    size_bytes: int
    body: SampleBody


@dataclass(frozen=True)
class AppendResult:
    """Outcome of one atomic append."""

    accepted: int
    duplicates: int
    sample_ids: tuple[str, ...]
    dataset: Dataset


@dataclass(frozen=True)
class Requirements:
    """Device conditions a job needs, defaults filled in."""

    require_charging: bool
    min_battery_percent: int
    max_temperature_celsius: float
    require_idle: bool


@dataclass(frozen=True)
class Window:
    """A recurring cron window."""

    cron: str
    jitter_seconds: int = 0
    timezone: str = ""


@dataclass(frozen=True)
class JobSpec:
    """What a job trains on and how; its hash decides request_id idempotency."""

    dataset_ids: tuple[str, ...]
    params: TrainConfig  # the job's training settings, every default filled in (the engine's own type)
    requirements: Requirements
    window: Window | None = None
    base_model: str = ""  # model name; "" = the daemon's default model
    init_adapter_id: str = ""  # start from this adapter of the app (its rank, alpha and targets)


class Phase(enum.StrEnum):
    """What a running job is doing (the engine reports these names through its ``on_phase`` callback)."""

    NONE = ""
    LOADING = "loading"
    PLANNING = "planning"
    TRAINING = "training"
    EVALUATING = "evaluating"
    EXPORTING = "exporting"


# Rejection reasons the API names as typed counts (jobs.proto RejectedSamples); any other lands in "other".
REJECT_REASONS = ("empty", "too_long", "no_assistant_turn", "no_target_tokens", "bad_role", "render_error")


@dataclass(frozen=True)
class DataSummary:
    """How a job's samples were used: split sizes and rejected counts by reason (counts only, never text)."""

    total_samples: int = 0
    train_samples: int = 0
    eval_samples: int = 0
    train_tokens: int = 0
    rejected: tuple[tuple[str, int], ...] = ()  # (reason, count), reasons sorted, counts > 0


@dataclass(frozen=True)
class Progress:
    """A job's latest snapshot: training progress at a step boundary, the current phase and the data summary.

    ``phase`` means something only while the job is RUNNING or PAUSING (the API reports no phase otherwise).
    """

    step: int = 0
    total_steps: int = 0
    train_loss: float = 0.0
    eval_loss: float | None = None
    eval_loss_before: float | None = None
    tokens_per_second: float = 0.0
    eta_seconds: int | None = None
    learning_rate: float = 0.0
    tokens_seen: int = 0
    phase: Phase = Phase.NONE
    phase_fraction: float | None = None  # 0..1 within ``phase``; None for phases without a measure
    data: DataSummary | None = None


@dataclass(frozen=True)
class Job:
    """A training job as stored."""

    job_id: str
    app_id: str
    request_id: str
    spec: JobSpec
    state: JobState
    blocked: Blocked = Blocked.NONE
    blocked_detail: str = ""
    progress: Progress = field(default_factory=Progress)
    error_code: str = ""
    error_message: str = ""
    adapter_id: str = ""
    backend: str = ""
    schedule_id: str = ""
    created_at_ms: int = 0
    started_at_ms: int = 0
    finished_at_ms: int = 0
    data_until_ms: int = 0


@dataclass(frozen=True)
class CheckpointRec:
    """A checkpoint written by a job."""

    checkpoint_id: str
    job_id: str
    step: int
    created_at_ms: int
    size_bytes: int
    train_loss: float
    path: str


@dataclass(frozen=True)
class JobEvent:
    """One entry of a job's history."""

    job_id: str
    event_id: int
    time_ms: int
    kind: EventKind
    state: JobState
    blocked: Blocked = Blocked.NONE
    progress: Progress = field(default_factory=Progress)
    checkpoint: CheckpointRec | None = None
    message: str = ""
    error_code: str = ""
    error_message: str = ""


@dataclass(frozen=True)
class AdapterRec:
    """A trained adapter in an app's registry; ``path`` is its PEFT folder."""

    adapter_id: str
    app_id: str
    job_id: str
    base_model: str
    base_model_sha256: str
    tokenizer_sha256: str
    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]
    steps: int
    eval_loss_before: float
    eval_loss_after: float
    train_loss: float
    precision_plan: tuple[tuple[str, str, str], ...]  # (layer, forward precision, backward precision)
    data_until_ms: int
    sample_count: int
    created_at_ms: int
    size_bytes: int
    path: str


@dataclass(frozen=True)
class Schedule:
    """A recurring window that creates a job on each firing."""

    schedule_id: str
    app_id: str
    spec: JobSpec
    created_at_ms: int
    next_run_at_ms: int = 0
