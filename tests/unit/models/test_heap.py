"""The heap policy: release_free_heap gives freed heap pages back (glibc and tcmalloc), keep_freed_heap keeps them."""

from __future__ import annotations

import os
import platform

import psutil
import pytest
import torch

from lorad.server.allocator import find_tcmalloc
from lorad.server.engine.models.heap import malloc_in_use, release_free_heap


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


_TCMALLOC_CHURN = """
import psutil, torch
from lorad.server.engine.models.heap import keep_freed_heap, malloc_in_use, release_free_heap
assert malloc_in_use() == "tcmalloc"
assert not keep_freed_heap()  # glibc's mallopt knobs do not apply; tcmalloc keeps freed spans by itself
rss = lambda: psutil.Process().memory_info().rss >> 20
base = rss()
bufs = [torch.ones(147456) for _ in range(400)]  # 576 KB each: the sizes of a SmolLM2 step's activations
del bufs
kept = rss() - base
assert release_free_heap()
print(kept, rss() - base)
"""


@pytest.mark.skipif(find_tcmalloc() is None or platform.libc_ver()[0] != "glibc", reason="needs libtcmalloc-minimal4")
def test_release_gives_tcmallocs_free_spans_back() -> None:
    """Under tcmalloc (as `lorad serve` runs where it is installed) the freed buffers stay for reuse until
    release_free_heap (after a load, a plan, a job) hands them back to the OS."""
    import subprocess
    import sys

    env = {**os.environ, "LD_PRELOAD": str(find_tcmalloc())}
    out = subprocess.run([sys.executable, "-c", _TCMALLOC_CHURN], capture_output=True, text=True, timeout=120,
                         env=env, check=True)  # fmt: skip
    kept, released = map(int, out.stdout.split())
    assert kept > 150, "tcmalloc keeps the 225 MB it freed"
    assert released < 30, (kept, released)


def test_system_malloc_in_a_plain_process() -> None:
    assert malloc_in_use() == ("tcmalloc" if "tcmalloc" in os.environ.get("LD_PRELOAD", "") else "system")
