"""Runs a throwaway lorad daemon as a subprocess on a temporary data directory with a fake device-probe file."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from lorad.client._atomic import atomic_write_text
from lorad.client.errors import Unavailable

# What a phone on its charger at night reports; the demo starts unplugged to show the gate.
PLUGGED_IN: dict[str, object] = {"battery_percent": 92, "charging": True, "temperature_celsius": 31.5, "idle": True}
UNPLUGGED: dict[str, object] = {"battery_percent": 38, "charging": False, "temperature_celsius": 31.5, "idle": True}


def write_probe(path: Path, readings: dict[str, object]) -> None:
    """Atomically rewrites the fake probe file the daemon reads (conditions.probe = "file")."""
    atomic_write_text(path, json.dumps(readings))


def daemon_config(data_dir: Path, probe_file: Path, torch_threads: int) -> str:
    """The daemon's TOML config for the demo (keys of lorad.server.config)."""
    return (
        "# lorad demo daemon (temporary)\n"
        f'[storage]\ndata_dir = "{data_dir}"\n\n'
        "[conditions]\nrequire_charging = true\nmax_temperature_celsius = 40.0\nrequire_idle = false\n"
        f'probe = "file"\nprobe_file = "{probe_file}"\npoll_seconds = 1.0\n\n'
        f"[training]\ntorch_threads = {torch_threads}\n\n"
        '[logging]\nlevel = "info"\nformat = "json"\n'
    )


class DemoDaemon:
    """A daemon subprocess (`python -m lorad.server --config ...`) that is always stopped and cleaned up.

    Args:
        keep: Leave the temporary directory (data, logs, adapter) in place after stopping.
        root: Use this directory instead of a fresh temporary one.
        torch_threads: The daemon's training threads (0 = torch default).
    """

    def __init__(self, keep: bool = False, root: Path | None = None, torch_threads: int = 0) -> None:
        # Short path under /tmp: Unix socket paths are limited to 107 bytes.
        self.root = root or Path(tempfile.mkdtemp(prefix="lorad-demo-", dir="/tmp" if Path("/tmp").is_dir() else None))
        self.keep = keep
        self.data_dir = self.root / "data"
        self.probe_file = self.root / "device.json"
        self.config_file = self.root / "lorad.toml"
        self.log_file = self.root / "daemon.log"
        self.torch_threads = torch_threads
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> Path:
        """The daemon's Unix socket (<data_dir>/run/lorad.sock)."""
        return self.data_dir / "run" / "lorad.sock"

    @property
    def owner_token_file(self) -> Path:
        """The owner token the daemon writes at first start."""
        return self.data_dir / "owner.token"

    def start(self, timeout: float = 120.0) -> None:
        """Writes config and probe file, starts the daemon, and waits for its socket and owner token.

        Raises:
            Unavailable: The daemon exited or did not come up in time (the message holds its log tail).
        """
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # lorad refuses a data dir others can read
        write_probe(self.probe_file, UNPLUGGED)
        self.config_file.write_text(daemon_config(self.data_dir, self.probe_file, self.torch_threads))
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAD_")}
        log = self.log_file.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lorad.server", "--config", str(self.config_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while not (self.socket_path.exists() and self.owner_token_file.exists()):
            if self.proc.poll() is not None:
                raise Unavailable(f"the demo daemon exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise Unavailable(f"the demo daemon did not start within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of the daemon's log."""
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 90.0) -> int | None:
        """SIGTERM (the daemon checkpoints and stops gracefully), then SIGKILL after `timeout` seconds."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return proc.returncode

    def cleanup(self) -> None:
        """Stops the daemon and removes the temporary directory unless `keep`."""
        self.stop()
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> DemoDaemon:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.cleanup()
