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
