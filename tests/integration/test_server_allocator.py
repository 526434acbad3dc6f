"""`lorad serve` as a real process runs under the malloc training.allocator names (server/allocator.py)."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lorad.server.allocator import find_tcmalloc
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.integration


def _config(tmp_path: Path, allocator: str) -> Path:
    cfg = tmp_path / "lorad.toml"
    cfg.write_text(f'[storage]\ndata_dir = "{tmp_path / "data"}"\n[training]\nallocator = "{allocator}"\n'
                   '[logging]\nformat = "json"\n')  # fmt: skip
    return cfg


def _serve(cfg: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lorad.server", "--config", str(cfg)], env=env,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip


@pytest.mark.skipif(find_tcmalloc() is None or platform.libc_ver()[0] != "glibc",
                    reason="needs tcmalloc (Debian package libtcmalloc-minimal4; .ci/run installs it)")  # fmt: skip
@pytest.mark.parametrize("setting", ["auto", "system"])
def test_daemon_runs_under_the_configured_malloc(tmp_path: Path, setting: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    log = tmp_path / "daemon.log"
    proc = _serve(_config(tmp_path, setting), log, env)
    try:
        sock = tmp_path / "data" / "run" / "lorad.sock"
        wait_for(lambda: proc.poll() is not None or (sock.exists() and b"daemon_started" in log.read_bytes()), 60,
                 "daemon start")  # fmt: skip
        assert proc.poll() is None, log.read_text()[-2000:]
        # The re-execution keeps the process (and its pid): what the parent started is what serves.
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        want = "tcmalloc" if setting == "auto" else "system"
        assert ("libtcmalloc" in maps) == (want == "tcmalloc")
        assert f'"malloc": "{want}"' in log.read_text()
        assert cmdline[1:3] == [b"-m", b"lorad.server"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-2000:]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="LD_PRELOAD of glibc's loader")
def test_required_tcmalloc_that_does_not_load_stops_the_start(tmp_path: Path) -> None:
    """training.allocator = "tcmalloc" with an LD_PRELOAD the loader cannot load: exit 2 with the reason, no daemon."""
    bogus = str(tmp_path / "libtcmalloc_minimal.so.4")
    env = {**os.environ, "LD_PRELOAD": bogus}
    log = tmp_path / "daemon.log"
    proc = _serve(_config(tmp_path, "tcmalloc"), log, env)
    assert proc.wait(60) == 2
    out = log.read_text()
    assert f"training.allocator='tcmalloc' but LD_PRELOAD='{bogus}' did not load it" in out, out[-2000:]
    assert not (tmp_path / "data" / "run" / "lorad.sock").exists()
