"""Wake-lock hooks: real shell commands (a script that records its calls), ordering, dedupe, timeout, shutdown."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from lorad.server.device.wakelock import WakeLockHooks


def _recorder(tmp: Path, sleep_s: float = 0.0) -> tuple[str, Path]:
    log = tmp / "calls.log"
    script = tmp / "hook.sh"
    script.write_text(f'#!/bin/sh\nsleep {sleep_s}\necho "$1" >> "{log}"\n')
    script.chmod(0o755)
    return str(script), log


def _calls(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def _wait(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_commands_run_in_order_once_per_change(tmp_path: Path) -> None:
    script, log = _recorder(tmp_path)
    h = WakeLockHooks(f"{script} acquire", f"{script} release")
    h.set_held(False)  # not held yet: nothing to release
    h.set_held(True)
    h.set_held(True)
    h.set_held(False)
    h.set_held(True)
    assert _wait(lambda: len(_calls(log)) == 3)
    h.shutdown()
    assert _calls(log) == ["acquire", "release", "acquire", "release"]


def test_set_held_never_blocks_and_a_hung_command_is_killed(tmp_path: Path) -> None:
    script, log = _recorder(tmp_path, sleep_s=30)
    h = WakeLockHooks(f"{script} acquire", f"{script} release", timeout_s=0.5)
    t0 = time.monotonic()
    h.set_held(True)
    h.set_held(False)
    assert time.monotonic() - t0 < 0.2, "the caller (runner lock, RPC thread) must not wait for the command"
    t0 = time.monotonic()
    h.shutdown()
    assert time.monotonic() - t0 < 5, "each command is killed after its timeout"
    time.sleep(0.3)
    assert _calls(log) == [], "killed with its children: the sleeping script never got to write"


def test_shutdown_releases_and_empty_commands_are_a_no_op(tmp_path: Path) -> None:
    script, log = _recorder(tmp_path)
    h = WakeLockHooks("", f"{script} release")
    assert h.enabled
    h.set_held(True)  # no acquire command: nothing runs
    h.shutdown()
    assert _calls(log) == ["release"]
    none = WakeLockHooks("", "")
    assert not none.enabled
    none.set_held(True)
    none.shutdown()


def test_a_failing_command_does_not_stop_later_ones(tmp_path: Path) -> None:
    script, log = _recorder(tmp_path)
    h = WakeLockHooks("exit 3", f"{script} release")
    h.set_held(True)
    h.set_held(False)
    assert _wait(lambda: _calls(log) == ["release"])
    h.shutdown()
