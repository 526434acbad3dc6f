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
    """

    def __init__(self, name: str = "lorad-npu") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._worker_ident: int | None = None
        self._pool.submit(self._remember_worker).result()

    def _remember_worker(self) -> None:
        self._worker_ident = threading.get_ident()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on the worker thread; returns its Future."""
        if threading.get_ident() == self._worker_ident:
            fut: Future[T] = Future()
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # propagate through the future like the pool does
                fut.set_exception(exc)
            return fut
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        """Stop the worker after the queued calls finish."""
        self._pool.shutdown(wait=True)


_default: NpuQueue | None = None
_default_lock = threading.Lock()


def default_queue() -> NpuQueue:
    """The process-wide queue (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = NpuQueue()
        return _default
