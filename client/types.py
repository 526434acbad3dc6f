"""Typed, immutable results and inputs of the lorad SDK (no protobuf objects in the public API)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Role(enum.StrEnum):
    """Author of a chat turn."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


class JobState(enum.StrEnum):
    """Lifecycle state of a training job."""

    UNSPECIFIED = "unspecified"
    QUEUED = "queued"
    WAITING = "waiting"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        """Whether the job can no longer change state."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class BlockedReason(enum.StrEnum):
    """Why a job is not running (NONE when it is not blocked)."""

    NONE = "none"
    OUTSIDE_WINDOW = "outside_window"
    NPU_BUSY = "npu_busy"
    NOT_CHARGING = "not_charging"
    BATTERY_LOW = "battery_low"
    TOO_HOT = "too_hot"
    DEVICE_BUSY = "device_busy"
    CONDITIONS_UNKNOWN = "conditions_unknown"
    PAUSED_BY_USER = "paused_by_user"
    DISK_FULL = "disk_full"


class JobEventKind(enum.StrEnum):
    """What a job event reports."""

    UNSPECIFIED = "unspecified"
    STATE_CHANGED = "state_changed"
    PROGRESS = "progress"
    EVAL = "eval"
    CHECKPOINT = "checkpoint"
    NOTICE = "notice"
    PHASE = "phase"
    WARNING = "warning"


class JobPhase(enum.StrEnum):
    """What a running job is doing (UNSPECIFIED when it is not running)."""

    UNSPECIFIED = "unspecified"
    LOADING = "loading"
    PLANNING = "planning"
    TRAINING = "training"
    EVALUATING = "evaluating"
    EXPORTING = "exporting"


class Backend(enum.StrEnum):
    """Compute backend of the frozen matmuls (AUTO lets the daemon choose)."""

    AUTO = "auto"
    TORCH = "torch"
    ORT_CPU = "ort-cpu"
    QNN_HTP = "qnn-htp"


class DeviceProfile(enum.StrEnum):
    """Which conditions gate training: phone (charger, battery, temperature), laptop (charger, battery), server
    (mains power: none)."""

    UNSPECIFIED = "unspecified"
    PHONE = "phone"
    LAPTOP = "laptop"
    SERVER = "server"


class Precision(enum.StrEnum):
    """Precision of the frozen matmuls (AUTO lets the planner choose per layer)."""

    AUTO = "auto"
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    W8A16 = "w8a16"
    W8A8 = "w8a8"


class LrSchedule(enum.StrEnum):
    """Learning-rate decay after warmup (DEFAULT is the server's, cosine)."""

    DEFAULT = "default"
    COSINE = "cosine"
    LINEAR = "linear"
    CONSTANT = "constant"


class AdapterFormat(enum.StrEnum):
    """File format of a downloaded adapter."""

    PEFT = "peft"
    GGUF = "gguf"
    MERGED = "merged"


class FinishReason(enum.StrEnum):
    """Why generation stopped."""

    STOP = "stop"
    LENGTH = "length"
    CONTEXT = "context"


# --- samples -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation."""

    role: Role
    content: str


@dataclass(frozen=True)
class TextSample:
    """Plain text trained on as a whole."""

    text: str


@dataclass(frozen=True)
class ChatSample:
    """A conversation; the loss covers assistant turns only."""

    messages: tuple[ChatMessage, ...]


Sample = TextSample | ChatSample


@dataclass(frozen=True)
class StoredSample:
    """A sample as the daemon stores it."""

    sample_id: str
    created_at_ms: int
    size_bytes: int
    sample: Sample


# --- apps and data -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AppQuota:
    """Per-app limits; 0 means the daemon's default."""

    max_samples: int = 0
    max_sample_bytes: int = 0
    max_adapters: int = 0
    max_active_jobs: int = 0


@dataclass(frozen=True)
class App:
    """A registered app."""

    app_id: str
    display_name: str
    created_at_ms: int
    quota: AppQuota
    sample_count: int
    sample_bytes: int
    revoked: bool = False


@dataclass(frozen=True)
class RegisteredApp:
    """A newly registered app and its token (shown once)."""

    app: App
    token: str


@dataclass(frozen=True)
class Dataset:
    """A named collection of one app's samples."""

    dataset_id: str
    sample_count: int
    size_bytes: int
    created_at_ms: int
    updated_at_ms: int


@dataclass(frozen=True)
class AppendResult:
    """Outcome of appending samples."""

    accepted_count: int
    duplicate_count: int
    sample_ids: tuple[str, ...]
    dataset: Dataset | None


@dataclass(frozen=True)
class DatasetDeleted:
    """What deleting a dataset deleted."""

    deleted_samples: int
    deleted_adapters: int  # with delete_adapters: the adapters that learned from it


@dataclass(frozen=True)
class ForgetResult:
    """What forgetting an app deleted."""

    deleted_samples: int
    deleted_adapters: int
    deleted_jobs: int
    freed_bytes: int


# --- training configuration ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraConfig:
    """LoRA hyperparameters; zero values take the server defaults (rank 8, alpha 2·rank, all projections)."""

    rank: int = 0
    alpha: float = 0.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrainingConfig:
    """How a job trains; zero values take the server defaults (see the TrainingConfig proto)."""

    base_model: str = ""
    lora: LoraConfig = field(default_factory=LoraConfig)
    max_steps: int = 0
    learning_rate: float = 0.0
    batch_size: int = 0
    seq_len: int = 0
    grad_accum_steps: int = 0
    warmup_steps: int = 0
    lr_schedule: LrSchedule = LrSchedule.DEFAULT
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0
    eval_every_steps: int = 0
    checkpoint_every_steps: int = 0
    seed: int = 0
    backend: Backend = Backend.AUTO
    precision: Precision = Precision.AUTO
    eval_fraction: float = 0.0
    init_adapter_id: str = ""  # start from this stored adapter (e.g. an imported federated global one)
    freeze_lora_a: bool = False  # train only B (FFA-LoRA)


@dataclass(frozen=True)
class DeviceRequirements:
    """Conditions a job needs before it trains; None takes the daemon's default."""

    require_charging: bool | None = None
    min_battery_percent: int | None = None
    max_temperature_celsius: float | None = None
    require_idle: bool | None = None


@dataclass(frozen=True)
class TrainingWindow:
    """A recurring window (five-field cron in `timezone`) in which work may start."""

    cron: str
    jitter_seconds: int = 0
    timezone: str = ""


# --- jobs ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RejectedSamples:
    """Samples a job could not use, counted by reason."""

    empty: int = 0
    too_long: int = 0
    no_assistant_turn: int = 0
    no_target_tokens: int = 0
    bad_role: int = 0
    render_error: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        """All rejected samples."""
        return sum(vars(self).values())


@dataclass(frozen=True)
class JobData:
    """How a job's samples were used: split sizes (held-out by content hash) and rejected counts."""

    total_samples: int = 0
    train_samples: int = 0
    eval_samples: int = 0
    train_tokens: int = 0
    rejected: RejectedSamples = field(default_factory=RejectedSamples)


@dataclass(frozen=True)
class JobProgress:
    """Training progress at a step boundary (losses in nats per token)."""

    step: int = 0
    total_steps: int = 0
    train_loss: float = 0.0
    eval_loss: float | None = None
    eval_loss_before: float | None = None
    tokens_per_second: float = 0.0
    eta_seconds: int | None = None
    learning_rate: float = 0.0
    tokens_seen: int = 0
    data: JobData | None = None  # known once the data is prepared


@dataclass(frozen=True)
class JobError:
    """Why a job failed: a stable code and a message naming the fix."""

    code: str
    message: str


@dataclass(frozen=True)
class Checkpoint:
    """A saved training state a job can resume from exactly."""

    checkpoint_id: str
    job_id: str
    step: int
    created_at_ms: int
    size_bytes: int
    train_loss: float


@dataclass(frozen=True)
class Job:
    """A training job."""

    job_id: str
    request_id: str
    dataset_ids: tuple[str, ...]
    config: TrainingConfig
    requirements: DeviceRequirements
    window: TrainingWindow | None
    state: JobState
    blocked_reason: BlockedReason
    blocked_detail: str
    progress: JobProgress
    error: JobError | None
    adapter_id: str
    backend: str
    schedule_id: str
    created_at_ms: int
    started_at_ms: int
    finished_at_ms: int
    data_until_ms: int
    phase: JobPhase = JobPhase.UNSPECIFIED  # while RUNNING or PAUSING
    phase_fraction: float | None = None  # 0..1 within `phase`; None for phases without a measure

    @property
    def is_final(self) -> bool:
        """Whether the job reached SUCCEEDED, FAILED or CANCELLED."""
        return self.state.is_final


@dataclass(frozen=True)
class JobEvent:
    """One entry of a job's history; `event_id` increases strictly within a job."""

    event_id: int
    job_id: str
    time_ms: int
    kind: JobEventKind
    state: JobState
    blocked_reason: BlockedReason
    progress: JobProgress
    checkpoint: Checkpoint | None
    message: str
    error: JobError | None
    phase: JobPhase = JobPhase.UNSPECIFIED
    phase_fraction: float | None = None


@dataclass(frozen=True)
class JobUpdate:
    """One item of `watch()`: the event and the job as of that event."""

    event: JobEvent
    job: Job


@dataclass(frozen=True)
class Schedule:
    """A recurring window that creates a job on each firing."""

    schedule_id: str
    dataset_ids: tuple[str, ...]
    config: TrainingConfig
    requirements: DeviceRequirements
    window: TrainingWindow | None
    next_run_at_ms: int
    created_at_ms: int


# --- adapters and inference ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerPrecision:
    """Precision chosen for one frozen linear, per direction."""

    layer: str
    forward: Precision
    backward: Precision


@dataclass(frozen=True)
class Adapter:
    """A trained LoRA adapter."""

    adapter_id: str
    job_id: str
    base_model: str
    base_model_sha256: str
    tokenizer_sha256: str
    lora: LoraConfig
    steps: int
    eval_loss_before: float
    eval_loss_after: float
    train_loss: float
    precision_plan: tuple[LayerPrecision, ...]
    data_until_ms: int
    sample_count: int
    created_at_ms: int
    size_bytes: int


@dataclass(frozen=True)
class DownloadResult:
    """A completed, verified adapter download."""

    path: str
    size_bytes: int
    sha256: str
    format: AdapterFormat
    resumed_from: int


@dataclass(frozen=True)
class GenerateChunk:
    """New text since the previous chunk; `finish_reason` is set on the last one only."""

    text: str
    token_count: int
    finish_reason: FinishReason | None
    prompt_token_count: int


# --- device --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BackendAvailability:
    """Whether one backend can load in the daemon."""

    backend: Backend
    usable: bool
    detail: str


@dataclass(frozen=True)
class CpuKernels:
    """lorad's compiled CPU kernels (norms, SwiGLU with gate/up's LoRA terms, RoPE, the loss's softmax; attention on
    AMX tiles where the CPU has them): whether training runs them (else the same math runs as torch ops, ~10 %
    slower), and for the owner the library in use or why not."""

    active: bool
    detail: str = ""


@dataclass(frozen=True)
class BackendStatus:
    """The compute backend in use and why."""

    backend: Backend
    reason: str
    soc_model: str
    htp_arch: str
    available: tuple[BackendAvailability, ...]
    cpu_kernels: CpuKernels = CpuKernels(active=False)


@dataclass(frozen=True)
class DeviceReadings:
    """Latest device readings; None means the reading could not be taken."""

    battery_percent: int | None
    charging: bool | None
    temperature_celsius: float | None
    idle: bool | None
    source: str
    read_at_ms: int


@dataclass(frozen=True)
class ModelInfo:
    """A model the daemon can train and serve."""

    name: str
    family: str
    parameters: int
    sha256: str
    is_default: bool
    detail: str = ""
    """Why family/parameters/sha256 are empty: still being read for the first time, or unreadable (the error)."""


@dataclass(frozen=True)
class AppDiskUsage:
    """Bytes one app's state takes on disk; exports are rebuilt on demand (`collect_garbage` removes them)."""

    app_id: str
    data_bytes: int
    checkpoint_bytes: int
    adapter_bytes: int
    export_bytes: int

    @property
    def total_bytes(self) -> int:
        """All of the app's bytes."""
        return self.data_bytes + self.checkpoint_bytes + self.adapter_bytes + self.export_bytes


@dataclass(frozen=True)
class DiskUsage:
    """Disk use: the calling app's (the owner: every app's, the shared caches and the database)."""

    apps: tuple[AppDiskUsage, ...]
    cache_bytes: int
    database_bytes: int
    export_cache_limit_bytes: int  # 0 = no cap


@dataclass(frozen=True)
class GarbageCollected:
    """What `collect_garbage` deleted; `caches_kept_reason` says why the owner's shared caches stayed."""

    freed_bytes: int
    removed_files: int
    caches_kept_reason: str


@dataclass(frozen=True)
class DeviceStatus:
    """Backend, device conditions and what the calling app's current job waits for."""

    backend: BackendStatus
    readings: DeviceReadings
    can_train: bool
    blocked_reasons: tuple[BlockedReason, ...]
    blocked_detail: str
    current_job_id: str
    current_job_state: JobState
    models: tuple[ModelInfo, ...]
    version: str
    profile: DeviceProfile = DeviceProfile.UNSPECIFIED
    profile_reason: str = ""
    unblock_hint: str = ""
