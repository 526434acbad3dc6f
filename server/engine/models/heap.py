"""Give freed heap memory back to the OS after the big transient allocations of loading and planning."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        fn: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (e.g. Android's bionic, musl): nothing to call
        return None
    return fn


def release_free_heap() -> bool:
    """Returns freed heap pages to the OS (glibc ``malloc_trim``); True when it ran.

    Building a model converts every weight through a full-precision copy that is freed again, but glibc keeps the
    freed chunks (its mmap threshold grows past the freed sizes, so later buffers reuse the heap): measured RSS after
    loading a Qwen2-0.5B-shaped model 2795 MB before and 917 MB after a trim; SmolLM2-135M 546 -> 522 MB.
    """
    fn = _trim()
    if fn is None:
        return False
    fn(0)
    return True
