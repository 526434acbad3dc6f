"""The daemon's one backend decision, made at start with its reason; status, CreateJob, jobs and inference ask it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import structlog

from lorad.kernels.capabilities import capability
from lorad.kernels.cpu_threads import prefer_sleeping_workers
from lorad.kernels.detect import BackendInfo, detect_backend

log = structlog.get_logger(__name__)

QNN_BUNDLE = "qnn-htp"  # a configured QNN context bundle runs on the HTP whatever training.backend says


@dataclass(frozen=True)
class BackendDecision:
    """The backend this daemon trains and generates on, and why.

    Attributes:
        info: the probe's answer for ``requested`` (name, reason, SoC, what else is available).
        requested: what the configuration asked for: "auto", a backend name, or "qnn-htp" when a bundle is set.
    """

    info: BackendInfo
    requested: str

    @property
    def name(self) -> str:
        """The backend's name (one of ``lorad.kernels.BACKENDS``)."""
        return self.info.name

    @property
    def reason(self) -> str:
        """Why it was chosen, including any fallback from ``requested``."""
        return self.info.reason

    def for_job(self, backend: str) -> BackendInfo:
        """The backend a job that asks for ``backend`` ("auto" or a name) trains on, with its reason.

        "auto" gets the daemon's decision. A named backend is checked against the capability table and taken when
        this device can load it (the probe's ``available``); otherwise the job runs on the daemon's decision and the
        reason says why.

        Raises:
            ValueError: ``backend`` is not "auto" or a backend of the capability table.
        """
        if backend in ("", "auto", self.requested):
            return self.info
        capability(backend)  # unknown names raise
        status = self.info.available.get(backend, "unavailable: not probed")
        if status.startswith("unavailable"):
            why = f"the job's backend {backend!r} is unusable ({status}); {self.info.reason}"
            return dataclasses.replace(self.info, reason=why)
        return dataclasses.replace(self.info, name=backend, reason=f"the job asked for it ({status})")


def decide_backend(configured: str, *, qnn_bundle: bool = False) -> BackendDecision:
    """Probes the hardware (once per process) and decides the daemon's backend.

    Called before torch loads (``lorad serve`` starts without it), so that torch's OpenMP workers can be told to
    sleep when idle where the backend keeps a CPU pool of its own (``kernels.cpu_threads``).

    Args:
        configured: ``training.backend`` from the config ("auto" or a backend name).
        qnn_bundle: a QNN context bundle is configured (its sessions need the HTP).
    """
    requested = QNN_BUNDLE if qnn_bundle else configured
    decision = BackendDecision(detect_backend(requested), requested)
    sleeping = prefer_sleeping_workers(decision.name)
    log.info(
        "backend_decided",
        backend=decision.name,
        requested=requested,
        reason=decision.reason,
        torch_idle_workers="sleep" if sleeping else "spin",
    )
    return decision
