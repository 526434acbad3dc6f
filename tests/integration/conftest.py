"""Fixtures: a real lorad daemon running in-process (own thread and event loop) on the shared tiny Llama."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from lorad.client.demo.daemon import write_probe
from lorad.server.config import build_config
from lorad.v1 import (
    apps_pb2,
    device_pb2,
)
from tests.integration.helpers import GOOD, Stubs, wait_for


class DaemonHandle:
    """A real Daemon on a temp Unix socket (and TCP port 0 when asked), served by a background event loop."""

    def __init__(
        self,
        data_dir: Path,
        model_dir: Path,
        tcp: bool = False,
        factory: Any = None,
        probe_values: dict[str, Any] | None = None,
        device: dict[str, Any] | None = None,
        training: dict[str, Any] | None = None,
        **conditions: Any,
    ) -> None:
        from lorad.server.daemon import Daemon

        self.data_dir = data_dir
        self.probe_file = data_dir.parent / f"{data_dir.name}-probe.json"
        write_probe(self.probe_file, GOOD if probe_values is None else probe_values)  # read as the daemon starts
        cfg = build_config({
            "storage": {"data_dir": str(data_dir)},
            "server": {"tcp_address": "127.0.0.1:0" if tcp else "", "shutdown_grace_seconds": 1.0},
            "conditions": {"probe": "file", "probe_file": str(self.probe_file), "poll_seconds": 0.1, **conditions},
            "training": {"default_model": str(model_dir), "backend": "torch", **(training or {})},
            "logging": {"level": "warning"},
            "device": device or {},
        }, env={})  # fmt: skip
        self.daemon = Daemon(cfg, factory=factory)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.daemon.start(), self.loop).result(60)
        self.owner_token = (data_dir / "owner.token").read_text().strip()
        self.channels: list[grpc.Channel] = []

    def set_probe(self, values: dict[str, Any]) -> None:
        """Writes the probe file and waits until the running daemon has read these values, so what the test does
        next (a CreateJob that should wait, say) meets them and not the readings of the poll before."""
        write_probe(self.probe_file, values)
        keys = ("battery_percent", "charging", "temperature_celsius", "idle")
        want = tuple(values.get(k) for k in keys)
        owner = self.owner()

        def seen() -> bool:
            r = owner.device.GetDeviceStatus(device_pb2.GetDeviceStatusRequest(), metadata=owner.md).readings
            return tuple(getattr(r, k) if r.HasField(k) else None for k in keys) == want

        wait_for(seen, 30, f"the daemon to read the probe values {values}")

    def channel(self, tcp: bool = False) -> grpc.Channel:
        target = f"127.0.0.1:{self.daemon.tcp_port}" if tcp else f"unix:{self.daemon.socket_path}"
        ch = grpc.insecure_channel(target)
        self.channels.append(ch)
        return ch

    def stubs(self, token: str, tcp: bool = False) -> Stubs:
        return Stubs(self.channel(tcp), token)

    def owner(self, tcp: bool = False) -> Stubs:
        return self.stubs(self.owner_token, tcp)

    def register(self, app_id: str, **quota: int) -> tuple[Stubs, str]:
        resp = self.owner().apps.RegisterApp(
            apps_pb2.RegisterAppRequest(app_id=app_id, quota=apps_pb2.AppQuota(**quota)), metadata=self.owner().md
        )
        return self.stubs(resp.token), resp.token

    def stop(self) -> None:
        for ch in self.channels:
            ch.close()
        asyncio.run_coroutine_threadsafe(self.daemon.stop(), self.loop).result(120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def make_daemon(tmp_path: Path, tiny_llama: Path) -> Iterator[Any]:
    """Factory: ``make_daemon(tcp=False, factory=None, **conditions)`` → a started DaemonHandle (stopped after)."""
    started: list[DaemonHandle] = []

    def make(name: str = "data", **kw: Any) -> DaemonHandle:
        h = DaemonHandle(tmp_path / name, tiny_llama, **kw)
        started.append(h)
        return h

    yield make
    for h in started:
        if h.thread.is_alive():
            h.stop()


def served_env(root: Path, model_dir: Path, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a `lorad serve` with the DEFAULT config: only data dir, model and backend are set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAD_")}
    env.update(HOME=str(root), LORAD_CLIENT_CONFIG=str(root / "client.toml"), PATH=f"{Path(sys.executable).parent}:"
               f"{env.get('PATH', '')}", LORAD_STORAGE_DATA_DIR=str(root / "data"),
               LORAD_TRAINING_DEFAULT_MODEL=str(model_dir), LORAD_TRAINING_BACKEND="torch",
               LORAD_LOGGING_LEVEL="warning")  # fmt: skip
    env.update(extra_env or {})
    return env


class ServedDaemon:
    """`lorad serve` in a subprocess (no probe file), plus a way to run CLI commands at it."""

    def __init__(self, root: Path, env: dict[str, str], command: list[str] | None = None,
                 cwd: Path | None = None) -> None:  # fmt: skip
        self.root, self.env, self.data_dir = root, env, Path(env["LORAD_STORAGE_DATA_DIR"])
        self.log = (root / "serve.log").open("wb")
        self.proc = subprocess.Popen(command or [sys.executable, "-m", "lorad.client.cli", "serve"], env=env, cwd=cwd,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        sock = self.data_dir / "run" / "lorad.sock"
        deadline = time.monotonic() + 120
        while not sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"lorad serve did not start: {(root / 'serve.log').read_text()[-2000:]}")
            time.sleep(0.1)

    def cli(self, *argv: str, stdin: str | None = None, cwd: Path | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """Runs `lorad ARGV...` against this daemon."""
        return subprocess.run([sys.executable, "-m", "lorad.client.cli", *argv], check=False, input=stdin,
                              capture_output=True, text=True, env=self.env, cwd=cwd, timeout=timeout)  # fmt: skip

    def stop(self) -> None:
        """SIGTERM to the daemon's process group, then SIGKILL after 60 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


@pytest.fixture
def lorad_serve(tmp_path: Path, tiny_llama: Path) -> Iterator[Any]:
    """Factory: ``lorad_serve(**extra_env)`` → a started ServedDaemon on the tiny Llama (stopped after the test)."""
    started: list[ServedDaemon] = []

    def make(**extra_env: str) -> ServedDaemon:
        root = tmp_path / f"served{len(started)}"
        root.mkdir()
        d = ServedDaemon(root, served_env(root, tiny_llama, extra_env))
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()
