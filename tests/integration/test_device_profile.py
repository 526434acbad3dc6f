"""Device profile end to end: the default config trains on a sensorless host; a declared phone waits, says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lorad.server.device.profile import resolve_profile

pytestmark = pytest.mark.integration

SAMPLES = [{"messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": f"A{i}."}]}
           for i in range(10)] + [{"text": f"A note about day {i}."} for i in range(6)]  # fmt: skip
TINY_TRAIN = ("--steps", "4", "--seq-len", "64", "--batch-size", "2", "--rank", "4", "--eval-every", "2",
              "--eval-fraction", "0.3")  # fmt: skip


def _cli(tmp: Path, data_dir: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAD_")}
    env.update(HOME=str(tmp), LORAD_CLIENT_CONFIG=str(tmp / "client.toml"), LORAD_STORAGE_DATA_DIR=str(data_dir))
    return subprocess.run([sys.executable, "-m", "lorad.client.cli", *argv], check=False, capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip


@pytest.mark.slow
def test_default_config_on_a_host_without_sensors_trains_to_completion(lorad_serve: Any, tmp_path: Path) -> None:
    if resolve_profile("auto", "auto").name != "server":
        pytest.skip("this host has a battery or termux-battery-status: auto picks a battery-powered profile")
    d = lorad_serve()
    assert not any(k.startswith("LORAD_CONDITIONS") for k in d.env), "no probe file or condition override"
    assert d.cli("app", "register", "notes", "--save").returncode == 0
    data = tmp_path / "notes.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in SAMPLES) + "\n")
    r = d.cli("data", "add", "diary", str(data))
    assert r.returncode == 0, r.stderr
    r = d.cli("train", "diary", *TINY_TRAIN, "--watch", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "succeeded" in r.stdout
    s = d.cli("status")
    assert "profile   server (auto: no battery in /sys/class/power_supply" in s.stdout, s.stdout
    assert "training  allowed now" in s.stdout


def test_declared_phone_with_unknown_sensors_waits_and_status_says_how_to_change_it(
    make_daemon: Any, tmp_path: Path
) -> None:
    h = make_daemon(probe_values={}, device={"profile": "phone"})  # the probe file knows nothing
    assert _cli(tmp_path, h.data_dir, "app", "register", "notes", "--save").returncode == 0
    data = tmp_path / "notes.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in SAMPLES) + "\n")
    assert _cli(tmp_path, h.data_dir, "data", "add", "diary", str(data)).returncode == 0
    r = _cli(tmp_path, h.data_dir, "train", "diary", *TINY_TRAIN, "--json")
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)
    shown = _cli(tmp_path, h.data_dir, "jobs", "show", job["job_id"], "--json")
    assert json.loads(shown.stdout)["job"]["state"] == "waiting"
    out = _cli(tmp_path, h.data_dir, "status").stdout
    assert "profile   phone (set in the daemon config ([device] profile))" in out, out
    assert "training  blocked: conditions unknown" in out and "cannot read charger state, temperature" in out
    assert 'to change it: if this machine runs on mains power, set `profile = "server"` under [device]' in out
    s = json.loads(_cli(tmp_path, h.data_dir, "status", "--json").stdout)
    assert s["profile"] == "phone" and "LORAD_DEVICE_PROFILE=server" in s["unblock_hint"]
    assert s["current_job"]["state"] == "waiting" and 'profile = "server"' in s["current_job"]["blocked_detail"]
