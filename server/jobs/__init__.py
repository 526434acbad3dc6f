"""Jobs: the state machine (manager), the NPU-owning runner, the training-session seam and event wake-ups."""

from lorad.server.jobs.files import Layout
from lorad.server.jobs.hub import EventHub
from lorad.server.jobs.manager import JobManager
from lorad.server.jobs.runner import Runner
from lorad.server.jobs.session import (
    AdapterArtifact,
    JobFailure,
    SessionFactory,
    SessionOutcome,
    SessionRequest,
    SessionSink,
    TrainingSession,
)

__all__ = [
    "AdapterArtifact",
    "EventHub",
    "JobFailure",
    "JobManager",
    "Layout",
    "Runner",
    "SessionFactory",
    "SessionOutcome",
    "SessionRequest",
    "SessionSink",
    "TrainingSession",
]
