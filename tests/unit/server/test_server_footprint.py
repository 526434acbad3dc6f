"""What an idle daemon holds: reading a model's facts does not keep the conversion's memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorad.server.allocator import find_tcmalloc

CONVERT = """
import sys, tempfile
from pathlib import Path
import torch  # the daemon's engine is imported before it converts; what the conversion leaves is what counts
from lorad.server.engine.api import resolve
def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) // 1024
before = rss_mb()
with tempfile.TemporaryDirectory() as d:
    resolve(None, Path(d))
    print(before, rss_mb())
"""


@pytest.mark.parametrize("malloc", ["system", "tcmalloc"])
def test_a_first_conversion_gives_its_memory_back(malloc: str, tmp_path: Path) -> None:
    """A status call converts the bundled GGUF once (full-size float copies of every weight): the daemon must not
    keep that heap afterwards (it kept ~700 MB under tcmalloc, ~200 MB under glibc)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if malloc == "tcmalloc":
        lib = find_tcmalloc()
        if lib is None:
            pytest.skip("no tcmalloc installed here")
        env["LD_PRELOAD"] = str(lib)
    out = subprocess.run(
        [sys.executable, "-c", CONVERT], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=True
    )
    before, after = map(int, out.stdout.splitlines()[-1].split())  # the log goes to stdout too
    assert after - before < 120, f"{after - before} MB kept after converting a 270 MB model ({before} -> {after})"
