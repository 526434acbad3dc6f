"""The systemd user unit: installs into a temp prefix, passes `systemd-analyze --user verify`, and is hardened."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[3] / "deploy/linux/lorad.service"


def _parse(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> values (systemd allows repeated keys, so configparser's strict mode is off)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, {})
            continue
        key, _, value = line.partition("=")
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


def test_unit_is_hardened_and_keeps_the_data_dir_writable() -> None:
    svc = _parse(UNIT.read_text())["Service"]
    expect = {
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes", "PrivateDevices": "yes",
        "ProtectHome": "read-only", "RestrictNamespaces": "yes", "LockPersonality": "yes", "UMask": "0077",
        "KillSignal": "SIGTERM", "Restart": "on-failure",
    }  # fmt: skip
    for key, value in expect.items():
        assert svc.get(key) == [value], f"{key}={svc.get(key)}"
    assert svc["ReadWritePaths"] == ["%h/.local/share/lorad"]
    assert "AF_UNIX" in svc["RestrictAddressFamilies"][0]
    assert " serve --config " in svc["ExecStart"][0]
    # The stop timeout must cover the daemon's checkpoint bound (60 s in deploy/lorad.example.toml).
    assert int(svc["TimeoutStopSec"][0]) >= 60
    assert "MemoryDenyWriteExecute" not in svc  # torch / onnxruntime need W+X pages
    assert _parse(UNIT.read_text())["Install"]["WantedBy"] == ["default.target"]
    configparser.ConfigParser(strict=False, interpolation=None).read_string(UNIT.read_text())


def test_unit_installs_and_verifies(tmp_path: Path) -> None:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze not installed; the parse test above still checks the unit")
    home = tmp_path / "home"
    unit_dir = home / ".config/systemd/user"
    unit_dir.mkdir(parents=True)
    shutil.copy(UNIT, unit_dir / "lorad.service")
    venv_bin = home / ".local/share/lorad/venv/bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "lorad").write_text("#!/bin/sh\nexit 0\n")
    (venv_bin / "lorad").chmod(0o755)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime),
           "XDG_CONFIG_HOME": str(home / ".config")}  # fmt: skip
    cmd = [exe, "--user", "verify", str(unit_dir / "lorad.service")]
    r = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    if r.returncode != 0 and ("Failed to initialize manager" in out or "Failed to connect" in out):
        pytest.skip(f"systemd-analyze cannot run a user manager here: {out.strip()[:200]}")
    assert r.returncode == 0, out
    # Unknown or misspelt keys are only warnings for systemd: treat them as failures.
    assert "Unknown key" not in out and "ignoring" not in out.lower(), out


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze not installed")
    home = tmp_path / "home"
    home.mkdir()
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    broken = tmp_path / "lorad.service"
    broken.write_text(UNIT.read_text().replace("ExecStart=", "ExecStrat="))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime)}
    r = subprocess.run(
        [exe, "--user", "verify", str(broken)], check=False, env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0 or "Unknown key" in r.stdout + r.stderr
