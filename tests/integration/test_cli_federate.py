"""`lorad federate join|status|leave` start and stop a real flower-supernode for one opted-in app."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def lorad(tmp: Path, h: Any, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAD_")}
    env.update(HOME=str(tmp), LORAD_CLIENT_CONFIG=str(tmp / "client.toml"), LORAD_STORAGE_DATA_DIR=str(h.data_dir),
               LORAD_FEDERATION_DIR=str(tmp / "fed"))  # fmt: skip
    return subprocess.run([sys.executable, "-m", "lorad.client.cli", *argv], check=False, capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip


def test_join_needs_opt_in_then_runs_a_supernode_until_leave(make_daemon: Any, tmp_path: Path) -> None:
    h = make_daemon()
    assert lorad(tmp_path, h, "app", "register", "notes", "--save").returncode == 0
    with socket.socket() as s:  # a SuperLink address nobody serves: the SuperNode keeps retrying, harmlessly
        s.bind(("127.0.0.1", 0))
        link = f"127.0.0.1:{s.getsockname()[1]}"
    base = ["federate", "join", "--app", "notes", "--superlink", link, "--datasets", "diary", "--insecure"]
    r = lorad(tmp_path, h, *base)
    assert r.returncode == 4 and "--opt-in" in r.stderr
    assert not (tmp_path / "fed" / "notes.json").exists()
    r = lorad(tmp_path, h, *base, "--opt-in", "--json")
    assert r.returncode == 0, r.stderr
    pid = json.loads(r.stdout)["pid"]
    try:
        token_file = tmp_path / "fed" / "notes.token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        time.sleep(1.0)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        assert "flower-supernode" in cmdline and "opt-in=true" in cmdline
        assert token_file.read_text() not in cmdline  # the token is passed as a file, never in argv
        r = lorad(tmp_path, h, "federate", "status", "--json")
        assert json.loads(r.stdout)[0] | {"running": True} == json.loads(r.stdout)[0]
        r = lorad(tmp_path, h, "status")
        assert f"federation notes → {link} (running" in r.stdout, r.stdout
        r = lorad(tmp_path, h, *base, "--opt-in")
        assert r.returncode != 0 and "already joined" in r.stderr
    finally:
        r = lorad(tmp_path, h, "federate", "leave", "--app", "notes")
    assert r.returncode == 0, r.stderr
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert not (tmp_path / "fed" / "notes.token").exists()
    assert "no federation joined" in lorad(tmp_path, h, "federate", "status").stdout
