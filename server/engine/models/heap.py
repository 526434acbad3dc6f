"""Heap policy: keep freed memory for reuse while training; give it back to the OS after loading, planning, jobs."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest accepted mmap threshold on 64-bit
_TCMALLOC_RELEASE = "MallocExtension_ReleaseFreeMemory"  # gperftools' C API: only tcmalloc defines it


@functools.cache
def _libc(symbol: str, *, glibc_only: bool = False) -> Callable[..., int] | None:
    """``symbol`` from the C library loaded in this process, if it has one (``glibc_only``: and it is glibc)."""
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded into this process, libc's among them
    except OSError:
        return None
    if glibc_only and not hasattr(libc, "gnu_get_libc_version"):
        return None
    fn: Callable[..., int] | None = getattr(libc, symbol, None)
    return fn


@functools.cache
def malloc_in_use() -> str:
    """``"tcmalloc"`` when gperftools' malloc serves this process (``lorad serve`` preloads it where the system has it:
    server/allocator.py), else ``"system"`` (the C library's)."""
    return "tcmalloc" if _libc(_TCMALLOC_RELEASE) else "system"


def keep_freed_heap() -> bool:
    """Makes glibc keep freed memory for reuse instead of returning it to the OS at once; True when it applied.

    A training step allocates and frees the same few hundred MB of activations every step. By default glibc unmaps
    buffers above its (adaptive) mmap threshold on free and trims the top of the heap past twice that, so the next
    step takes fresh zeroed pages from the kernel, cold in cache, for the same tensors: a SmolLM2 step ran 7-15 %
    faster with the heap kept (three interleaved pairs of 10-step runs, 2 threads, Zen 5; 5-7 instead of 6-11
    thousand page faults per step). Buffers up to 32 MB now come from the heap and the heap is never trimmed by
    itself; ``release_free_heap`` (called after a job) still gives the freed memory back. Process-wide and lasting.
    Under tcmalloc (whose mallopt does nothing) it does not apply: tcmalloc keeps freed spans for reuse by itself.
    """
    fn = _libc("mallopt", glibc_only=True)  # bionic's and musl's mallopt parameter numbers differ
    if fn is None or malloc_in_use() == "tcmalloc":
        return False
    return bool(fn(_M_TRIM_THRESHOLD, 1 << 30)) and bool(fn(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX))


def release_free_heap() -> bool:
    """Returns freed heap pages to the OS (glibc ``malloc_trim``, or tcmalloc's ``ReleaseFreeMemory``); True when it
    ran.

    Building a model converts weights through float temporaries that are freed again, but glibc keeps the freed
    chunks (its mmap threshold grows past the freed sizes, so later buffers reuse the heap). The build trims after
    every block and the loader once more at the end: Qwen2-0.5B's load peaked at 1.24 GB at bf16 and 1.38 GB at
    w8a8 (4.31 GB before the build stopped making full-size fp32 copies and trimming as it goes).
    """
    release = _libc(_TCMALLOC_RELEASE)
    if release is not None:  # tcmalloc serves this process (malloc_in_use)
        release()
        return True
    fn = _libc("malloc_trim")
    if fn is None:
        return False
    fn(0)
    return True
