"""The seam between the job runner and the training engine: one TrainingSession per RUNNING period of a job."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from lorad.server.records import DataSummary, JobSpec, Phase, Progress, SampleBody


class JobFailure(Exception):  # noqa: N818  (reads as the job's outcome)
    """A training failure with a stable code (e.g. "no_usable_samples", "backend_failed") and a safe message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class SessionRequest:
    """Everything one run of a job needs; ``work_dir`` persists across pauses and daemon restarts."""

    job_id: str
    app_id: str
    spec: JobSpec
    samples: tuple[SampleBody, ...]
    work_dir: Path
    keep_checkpoints: int = 2
    eval_loss_before: float | None = None  # measured on the job's first run; None = not yet (measure it)
    init_adapter: Path | None = None  # PEFT folder the job starts from (JobSpec.init_adapter_id)


@dataclass(frozen=True)
class AdapterArtifact:
    """A finished adapter: its PEFT folder and what the registry records about it."""

    path: Path
    base_model: str
    base_model_sha256: str
    tokenizer_sha256: str
    steps: int
    train_loss: float
    eval_loss_before: float
    eval_loss_after: float
    sample_count: int
    precision_plan: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class SessionOutcome:
    """How a run ended: ``completed`` with an adapter, or paused at a checkpoint."""

    completed: bool
    adapter: AdapterArtifact | None = None
    notices: tuple[str, ...] = field(default=())


class SessionSink(Protocol):
    """Where a session reports what happens (called from the training thread)."""

    def backend(self, name: str, reason: str) -> None:
        """The compute backend chosen for this run, and why."""
        ...

    def eval_before(self, loss: float, total_steps: int) -> None:
        """The base model's held-out loss, measured once before the job's first step."""
        ...

    def progress(self, progress: Progress, *, evaluated: bool) -> None:
        """A step finished; ``evaluated`` when ``progress.eval_loss`` is fresh."""
        ...

    def checkpoint(self, step: int, path: Path, size_bytes: int, train_loss: float) -> None:
        """A checkpoint was written atomically."""
        ...

    def notice(self, message: str) -> None:
        """Something noteworthy (never sample text)."""
        ...

    def warning(self, message: str) -> None:
        """Something the caller should act on, e.g. no held-out samples (never sample text)."""
        ...

    def phase(self, phase: Phase, fraction: float | None) -> None:
        """The run entered ``phase`` (or its fraction, 0..1, moved on)."""
        ...

    def data(self, summary: DataSummary) -> None:
        """The job's samples were prepared: split sizes and rejected counts."""
        ...


class TrainingSession(Protocol):
    """One run of a job: resumes from the newest checkpoint in the work dir, trains until done or told to stop."""

    def run(self, should_stop: Callable[[], bool], sink: SessionSink) -> SessionOutcome:
        """Trains; polls ``should_stop`` at step boundaries and then checkpoints and returns a paused outcome.

        Raises:
            JobFailure: a failure with a code (anything else is recorded as "internal").
        """
        ...


SessionFactory = Callable[[SessionRequest], TrainingSession]
