"""A timer that repeats a phase's progress about once a second while one long call runs (planning, an eval pass)."""

from __future__ import annotations

import threading
from collections.abc import Callable

PERIOD_S = 1.0
"""How often a Heartbeat repeats its fraction. The daemon writes each repeat as an event unless another event of the
phase came in the half period before (``jobs.runner.PHASE_EVENT_EVERY_S``)."""


class Heartbeat:
    """Reports a fraction when it moves and again every ``period_s`` from a timer thread, so a listener hears from a
    phase whose single steps take long (one planning pass is 1-2 s on a quiet phone-class CPU and several times that
    on a busy one). Reports never run concurrently; the last one is sent before ``__exit__`` returns.
    """

    def __init__(self, report: Callable[[float | None], None], period_s: float = PERIOD_S,
                 fraction: float | None = None) -> None:  # fmt: skip
        """``fraction``: what the timer repeats until ``set`` is called (the caller has reported it already)."""
        self._report, self._period = report, period_s
        self._fraction: float | None = fraction
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lorad-heartbeat", daemon=True)

    def set(self, fraction: float | None) -> None:
        """Reports ``fraction`` now and repeats it from then on."""
        with self._lock:
            self._fraction = fraction
            self._report(fraction)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            with self._lock:
                self._report(self._fraction)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
