"""What an idle daemon holds: `lorad serve` starts without torch, and reading a model's facts does not keep the
conversion's memory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorad.server.allocator import find_tcmalloc


def test_the_daemon_starts_without_importing_torch(tmp_path: Path) -> None:
    """Before any model is needed the daemon has not loaded torch (~200 MB and seconds of start on a phone)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAD_")}
    env["LORAD_TRAINING_ALLOCATOR"] = "system"  # no re-exec for tcmalloc: the pid below stays the daemon's
    sock = tmp_path / "d.sock"
    cmd = [sys.executable, "-m", "lorad.server", "--data-dir", str(tmp_path / "data"), "--socket", str(sock)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None, f"the daemon exited: {proc.stderr.read() if proc.stderr else ''}"
            assert time.monotonic() < deadline, "no socket within 60 s"
            time.sleep(0.05)
        time.sleep(1.0)  # the job runner's start (recovery, checkpoint listing) runs just after the bind
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert proc.poll() is None
        assert "libtorch" not in maps, "lorad serve imported torch before any model was needed"
    finally:
        proc.terminate()
        proc.wait(30)


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
