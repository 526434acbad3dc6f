"""Open streams per app, so revoking or rotating an app's token ends them at once (not at their next poll)."""

from __future__ import annotations

import asyncio
import threading


class OpenStreams:
    """Tasks of the streaming RPCs in flight, keyed by the calling app."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_app: dict[str, set[asyncio.Task]] = {}
        self._ended: set[asyncio.Task] = set()

    def add(self, app_id: str, task: asyncio.Task) -> None:
        """Registers the current stream of ``app_id``."""
        with self._lock:
            self._by_app.setdefault(app_id, set()).add(task)

    def remove(self, app_id: str, task: asyncio.Task) -> None:
        """Unregisters a finished stream."""
        with self._lock:
            tasks = self._by_app.get(app_id)
            if tasks is not None:
                tasks.discard(task)
                if not tasks:
                    del self._by_app[app_id]
            self._ended.discard(task)

    def end_app(self, app_id: str) -> int:
        """Cancels every open stream of the app (thread-safe); returns how many."""
        with self._lock:
            tasks = list(self._by_app.get(app_id, ()))
            self._ended.update(tasks)
        for t in tasks:
            t.get_loop().call_soon_threadsafe(t.cancel)
        return len(tasks)

    def was_ended(self, task: asyncio.Task | None) -> bool:
        """True if ``task`` was cancelled by ``end_app`` (not by the client going away)."""
        with self._lock:
            return task is not None and task in self._ended
