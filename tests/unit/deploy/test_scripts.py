"""Deploy scripts: shellcheck-clean, the Android layout installs into a temp prefix, and the wake-lock hook works."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
ANDROID = DEPLOY / "android"


def shell_scripts() -> list[Path]:
    """Every file under deploy/ whose first line is a sh or bash shebang."""
    out = []
    for p in sorted(DEPLOY.rglob("*")):
        if p.is_file():
            with p.open("rb") as f:
                first = f.readline()
            if first.startswith(b"#!") and (first.rstrip().endswith(b"/sh") or first.rstrip().endswith(b"bash")):
                out.append(p)
    return out


def test_every_expected_script_is_found() -> None:
    names = {str(p.relative_to(DEPLOY)) for p in shell_scripts()}
    expected = {
        "android/install.sh", "android/lorad-inproot.sh", "android/lorad-wakelock.sh", "android/boot/start-lorad",
        "android/service/lorad/run", "android/service/lorad/log/run", "android/service/lorad/control/t",
        "android/service/lorad-wakelock/run", "android/service/lorad-wakelock/log/run",
        "android/userland-install.sh", "arm64/test-userland.sh", "arm64/e2e-inroot.sh",
    }  # fmt: skip
    assert expected <= names, expected - names
    for p in shell_scripts():
        assert os.access(p, os.X_OK), f"{p} is not executable"


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_shellcheck_clean(script: Path) -> None:
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck not installed (Debian: apt-get install shellcheck); CI must install it")
    r = subprocess.run([exe, "-x", str(script)], check=False, capture_output=True, text=True, cwd=script.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def _services_install(tmp_path: Path) -> tuple[Path, Path, Path]:
    prefix, home = tmp_path / "usr", tmp_path / "home"
    rootfs = prefix / "var/lib/proot-distro/installed-rootfs/debian"
    rootfs.mkdir(parents=True)
    home.mkdir()
    env = {"PATH": os.environ["PATH"], "PREFIX": str(prefix), "HOME": str(home), "LORAD_DISTRO": "debian"}
    for _ in range(2):  # idempotent: the second run must change nothing that matters
        cmd = ["bash", str(ANDROID / "install.sh"), "--services-only"]
        r = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    return prefix, home, rootfs


def test_services_install_into_temp_prefix(tmp_path: Path) -> None:
    prefix, home, rootfs = _services_install(tmp_path)
    sv = prefix / "var/service"
    for rel in ("lorad/run", "lorad/log/run", "lorad/control/t", "lorad-wakelock/run", "lorad-wakelock/log/run"):
        assert os.access(sv / rel, os.X_OK), rel
    assert (sv / "lorad/distro").read_text().strip() == "debian"
    assert "exec proot-distro login" in (sv / "lorad/run").read_text()
    assert "exec svlogd -tt" in (sv / "lorad/log/run").read_text()
    assert os.access(home / ".termux/boot/start-lorad", os.X_OK)
    for helper in ("lorad-inproot", "lorad-wakelock"):
        assert os.access(rootfs / "opt/lorad/bin" / helper, os.X_OK)
    cfg = (rootfs / "root/.config/lorad/lorad.toml").read_text()
    assert cfg.count("[device]") == 1, "re-running the installer must not append the [device] section twice"
    assert 'wake_lock_acquire = "/opt/lorad/bin/lorad-wakelock acquire"' in cfg
    import tomllib

    parsed = tomllib.loads(cfg)
    assert parsed["device"]["wake_lock_release"] == "/opt/lorad/bin/lorad-wakelock release"


def _fake_termux_bin(tmp_path: Path) -> tuple[Path, Path]:
    bin_dir, log = tmp_path / "bin", tmp_path / "wakelock.log"
    bin_dir.mkdir()
    for cmd in ("termux-wake-lock", "termux-wake-unlock"):
        (bin_dir / cmd).write_text(f"#!/bin/sh\necho {cmd} >> {log}\n")
        (bin_dir / cmd).chmod(0o755)
    return bin_dir, log


def _wait_for(pred, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def _fake_daemon(tmp_path: Path) -> subprocess.Popen[bytes]:
    # "lorad" in its command line, like the real daemon; exits 0 on SIGTERM (a graceful stop).
    ready = tmp_path / "daemon.ready"
    code = (
        "import pathlib,signal,sys,time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
        f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, "lorad-fake-daemon"])
    assert _wait_for(ready.exists), "fake daemon did not start"
    return proc


def test_wakelock_held_only_while_training_and_daemon_alive(tmp_path: Path) -> None:
    prefix, _, rootfs = _services_install(tmp_path)
    state = rootfs / "root/.local/state/lorad"
    bin_dir, log = _fake_termux_bin(tmp_path)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PREFIX": str(prefix), "LORAD_WAKELOCK_POLL_SECONDS": "0.05"}
    hook_env = {**env, "LORAD_STATE_DIR": str(state)}
    hook = rootfs / "opt/lorad/bin/lorad-wakelock"
    daemon = _fake_daemon(tmp_path)
    state.mkdir(parents=True, exist_ok=True)
    (state / "lorad.pid").write_text(f"{daemon.pid}\n")
    watcher = subprocess.Popen(["sh", "./run"], cwd=prefix / "var/service/lorad-wakelock", env=env)
    lines = lambda: log.read_text().split() if log.exists() else []  # noqa: E731
    try:
        assert _wait_for(lambda: lines() == ["termux-wake-unlock"]), lines()  # stale lock dropped at start
        subprocess.run(["sh", str(hook), "acquire"], env=hook_env, check=True)
        assert (state / "wakelock").read_text().strip() == "held"
        assert _wait_for(lambda: lines()[-1:] == ["termux-wake-lock"]), lines()
        subprocess.run(["sh", str(hook), "release"], env=hook_env, check=True)
        assert _wait_for(lambda: lines()[-1:] == ["termux-wake-unlock"]), lines()
        subprocess.run(["sh", str(hook), "acquire"], env=hook_env, check=True)
        assert _wait_for(lambda: lines()[-1:] == ["termux-wake-lock"]), lines()
        daemon.kill()  # killed mid-job: the request says "held" but nobody trains
        daemon.wait()
        assert _wait_for(lambda: lines()[-1:] == ["termux-wake-unlock"]), lines()
        n = len(lines())
        time.sleep(0.3)
        assert len(lines()) == n, "the watcher must not toggle the lock while nothing changes"
    finally:
        watcher.send_signal(signal.SIGTERM)
        watcher.wait(timeout=5)
        daemon.kill()
    assert lines().count("termux-wake-lock") == 2


def test_control_t_signals_the_daemon_not_proot(tmp_path: Path) -> None:
    prefix, _, rootfs = _services_install(tmp_path)
    state = rootfs / "root/.local/state/lorad"
    state.mkdir(parents=True)
    svc = prefix / "var/service/lorad"
    env = {"PATH": os.environ["PATH"], "PREFIX": str(prefix)}
    daemon = _fake_daemon(tmp_path)
    try:
        (state / "lorad.pid").write_text(f"{daemon.pid}\n")
        assert subprocess.run(["sh", "./control/t"], check=False, cwd=svc, env=env).returncode == 0
        assert daemon.wait(timeout=5) == 0  # it got SIGTERM and stopped gracefully
        # The pid is gone now: control/t must fail so runsv falls back to signalling proot itself.
        assert subprocess.run(["sh", "./control/t"], check=False, cwd=svc, env=env).returncode == 1
        (state / "lorad.pid").write_text(f"{os.getpid()}\n")  # a live pid that is not lorad (pytest)
        cmdline = Path(f"/proc/{os.getpid()}/cmdline").read_bytes()
        if b"lorad" not in cmdline:
            assert subprocess.run(["sh", "./control/t"], check=False, cwd=svc, env=env).returncode == 1
    finally:
        daemon.kill()


def test_wakelock_hook_rejects_unknown_action(tmp_path: Path) -> None:
    r = subprocess.run(["sh", str(ANDROID / "lorad-wakelock.sh"), "grab"], check=False, capture_output=True, text=True,
                       env={"PATH": os.environ["PATH"], "LORAD_STATE_DIR": str(tmp_path)})  # fmt: skip
    assert r.returncode == 2 and "usage" in r.stderr
