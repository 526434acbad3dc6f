"""Polls the probe off the event loop and hands each reading to the runner (which starts or pauses jobs)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from lorad.server.device.probes import Probe, Readings

log = structlog.get_logger(__name__)


class ConditionMonitor:
    """Keeps the latest readings; every ``poll_s`` seconds re-reads and calls ``on_change`` listeners."""

    def __init__(self, probe: Probe, poll_s: float) -> None:
        self.probe, self.poll_s = probe, poll_s
        self._latest = Readings(source="not read yet")
        self._task: asyncio.Task[None] | None = None
        self.listeners: list[Callable[[], None]] = []

    def latest(self) -> Readings:
        """The most recent readings (unknown until the first read)."""
        return self._latest

    def read_now(self) -> Readings:
        """Reads synchronously (probes bound their own time) and stores the result."""
        self._latest = self.probe.read()
        return self._latest

    async def poll_once(self) -> None:
        """One read in a worker thread, then the listeners (also in a thread: they touch SQLite)."""
        prev = self._latest
        r = await asyncio.to_thread(self.read_now)
        if (r.battery_percent, r.charging, r.temperature_celsius, r.idle) != (
            prev.battery_percent,
            prev.charging,
            prev.temperature_celsius,
            prev.idle,
        ):
            log.info(
                "device_readings",
                battery=r.battery_percent,
                charging=r.charging,
                temperature_c=r.temperature_celsius,
                idle=r.idle,
                source=r.source,
            )
        for cb in self.listeners:
            await asyncio.to_thread(cb)

    async def _loop(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # a broken probe must not stop the monitor
                log.exception("monitor_error")
            await asyncio.sleep(self.poll_s)

    def start(self) -> None:
        """Starts polling on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="lorad-monitor")

    async def stop(self) -> None:
        """Stops polling."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
