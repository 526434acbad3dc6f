"""Wakes asyncio watchers when any job event is written (from any thread)."""

from __future__ import annotations

import asyncio
import contextlib


class EventHub:
    """A version counter bumped on every event; watchers wait for it to change (no per-watcher queues to grow)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._version = 0
        self._changed: asyncio.Event | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Attaches the server's event loop (call from inside it)."""
        self._loop = loop
        self._changed = asyncio.Event()

    @property
    def version(self) -> int:
        """Read this before reading events; pass it to ``wait_change``."""
        return self._version

    def notify(self) -> None:
        """Thread-safe: schedules a wake-up of every watcher."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # loop closing during shutdown
            loop.call_soon_threadsafe(self._bump)

    def _bump(self) -> None:
        self._version += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def wait_change(self, seen: int, timeout_s: float) -> None:
        """Returns when the version differs from ``seen`` or after ``timeout_s`` seconds."""
        if self._version != seen or self._changed is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)
