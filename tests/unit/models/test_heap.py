"""release_free_heap gives freed heap pages back: RSS drops after a fragmented free on glibc."""

from __future__ import annotations

import platform

import psutil
import pytest
import torch

from lorad.server.engine.models.heap import release_free_heap


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_returns_freed_heap_to_the_os() -> None:
    # Many 1 MiB buffers (below glibc's mmap threshold once it has grown) come from the heap; free all but a few
    # scattered ones so the top of the heap cannot shrink by itself.
    big = [torch.empty(2**18) for _ in range(64)]  # 64 MiB so the threshold grows past 1 MiB
    del big
    keep, bufs = [], [torch.ones(2**18) for _ in range(400)]
    keep = bufs[::50]
    del bufs
    before = psutil.Process().memory_info().rss
    assert release_free_heap()
    after = psutil.Process().memory_info().rss
    assert len(keep) == 8
    assert after < before - 100 * 2**20, (before >> 20, after >> 20)


_CHURN = """
import ctypes, sys, psutil, torch
from lorad.server.engine.models.heap import _M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD, keep_freed_heap
libc = ctypes.CDLL(None)
# glibc's starting thresholds, pinned (its adaptive ones depend on what the imports happened to free)
assert libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024) and libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
if sys.argv[1] == "keep":
    assert keep_freed_heap()
rss = lambda: psutil.Process().memory_info().rss >> 20
base = rss()
for _ in range(3):  # a step's worth of 1.5 MB activations, allocated and freed again
    bufs = [torch.ones(393216) for _ in range(30)]
    del bufs
print(rss() - base)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's parameters are glibc's")
def test_kept_heap_holds_freed_step_buffers_for_reuse() -> None:
    """With glibc's starting thresholds, 45 MB of freed 1.5 MB buffers go back to the kernel (so the next step faults
    them in again); after keep_freed_heap() they stay for reuse. Fresh processes: the setting is process-wide."""
    import subprocess
    import sys

    def kept(mode: str) -> int:
        cmd = [sys.executable, "-c", _CHURN, mode]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
        return int(out.stdout.strip())

    assert kept("default") < 10, "glibc's starting thresholds return the freed buffers"
    assert kept("keep") > 35, "the freed buffers stay in the heap"
