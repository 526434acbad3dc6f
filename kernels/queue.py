"""NpuQueue: the single worker thread that every frozen-linear (NPU/backend) call goes through."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class NpuQueue:
    """Serializes backend calls on one worker thread (QNN runs serialize anyway; ``run()`` releases the GIL).

    The caller thread keeps computing (the LoRA terms) while the worker runs the frozen product. A call submitted
    from the worker thread itself runs inline, so nested submits cannot deadlock.

    ``inline=True`` runs each call on the submitting thread under one lock (still serialized). That is the right
    mode for CPU backends: a CPU-EP call already uses every core, so there is nothing to overlap, while a thread
    hand-off costs 11–22 µs on an idle 2-core host and up to milliseconds when the cores are oversubscribed.
    """

    def __init__(self, name: str = "lorad-npu", *, inline: bool = False) -> None:
        self.inline = inline
        self._lock = threading.Lock()
        self._worker_ident: int | None = None
        self._pool: ThreadPoolExecutor | None = None
        if not inline:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
            self._pool.submit(self._remember_worker).result()

    def _remember_worker(self) -> None:
        self._worker_ident = threading.get_ident()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on the worker thread; returns its Future."""
        if self._pool is None or threading.get_ident() == self._worker_ident:
            fut: Future[T] = Future()
            try:
                if self._pool is None:
                    with self._lock:
                        fut.set_result(fn(*args))
                else:
                    fut.set_result(fn(*args))
            except BaseException as exc:  # propagate through the future like the pool does
                fut.set_exception(exc)
            return fut
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        """Stop the worker after the queued calls finish."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


_default: NpuQueue | None = None
_inline: NpuQueue | None = None
_default_lock = threading.Lock()


def default_queue() -> NpuQueue:
    """The process-wide worker queue for NPU backends (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = NpuQueue()
        return _default


def queue_for(frozen: object) -> NpuQueue:
    """The queue a frozen linear's calls go through: inline for CPU backends (``runs_on_cpu``), else the worker."""
    global _inline
    if getattr(frozen, "runs_on_cpu", False):
        with _default_lock:
            if _inline is None:
                _inline = NpuQueue("lorad-cpu", inline=True)
            return _inline
    return default_queue()
