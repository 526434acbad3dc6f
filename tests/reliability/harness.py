"""Daemons for the reliability suite: a subprocess (`python -m lorad.server`, kill -9-able) and an in-process one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorad.client._atomic import atomic_write_text
from lorad.v1 import (
    adapters_pb2_grpc,
    apps_pb2,
    apps_pb2_grpc,
    common_pb2,
    data_pb2,
    data_pb2_grpc,
    device_pb2_grpc,
    inference_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
)

REPO = Path(__file__).resolve().parents[2]
GOOD = {"battery_percent": 90, "charging": True, "temperature_celsius": 30.0, "idle": True}
# Not charging and at 10 %: every job parks in WAITING (fuzzing must not start training).
BAD = {"battery_percent": 10, "charging": False, "temperature_celsius": 30.0, "idle": True}
FINAL = {jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED}
DB_FILES = ("lorad.sqlite", "lorad.sqlite-wal", "lorad.sqlite-shm")


def tiny_model(root: Path) -> Path:
    """A 2-layer random Llama HF folder (vocab 320, hidden 64) with a BPE tokenizer, as the unit tests use."""
    from tests.fixtures.tiny_hf import save_tiny_hf

    return save_tiny_hf(root, "llama")


def write_probe(path: Path, values: dict[str, Any]) -> None:
    """Atomically rewrites the fake device probe file (the daemon's `probe = "file"` source)."""
    atomic_write_text(path, json.dumps(values))


def config_values(data_dir: Path, model_dir: Path, probe_file: Path | None, **sections: dict[str, Any]) -> dict:
    """The daemon config used by every reliability daemon; ``sections`` override keys per section."""
    values: dict[str, dict[str, Any]] = {
        "storage": {"data_dir": str(data_dir)},
        "server": {"shutdown_grace_seconds": 1.0, "checkpoint_timeout_seconds": 20.0},
        "conditions": {"probe": "file", "probe_file": str(probe_file), "poll_seconds": 0.2}
        if probe_file
        else {"poll_seconds": 0.2},
        "training": {"default_model": str(model_dir), "backend": "torch", "torch_threads": 1},
        "logging": {"level": "info", "format": "json"},
    }
    for sec, kv in sections.items():
        values.setdefault(sec, {}).update(kv)
    return values


def _toml(values: dict[str, dict[str, Any]]) -> str:
    lines = []
    for sec, kv in values.items():
        lines.append(f"[{sec}]")
        for k, v in kv.items():
            lines.append(f"{k} = {json.dumps(v)}")  # JSON scalars/strings/lists are valid TOML for our types
    return "\n".join(lines) + "\n"


class Stubs:
    """Sync stubs for every service on one channel, carrying one bearer token."""

    def __init__(self, channel: grpc.Channel, token: str | None) -> None:
        self.channel = channel
        self.token = token
        self.md: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.apps = apps_pb2_grpc.AppServiceStub(channel)
        self.data = data_pb2_grpc.DataServiceStub(channel)
        self.jobs = jobs_pb2_grpc.JobServiceStub(channel)
        self.adapters = adapters_pb2_grpc.AdapterServiceStub(channel)
        self.inference = inference_pb2_grpc.InferenceServiceStub(channel)
        self.device = device_pb2_grpc.DeviceServiceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    def healthy(self, timeout: float = 2.0) -> bool:
        """True when grpc.health.v1 answers SERVING."""
        try:
            r = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING


class _Base:
    data_dir: Path
    socket_path: Path
    probe_file: Path

    def __init__(self) -> None:
        self.channels: list[grpc.Channel] = []

    @property
    def owner_token(self) -> str:
        return (self.data_dir / "owner.token").read_text().strip()

    def channel(self) -> grpc.Channel:
        ch = grpc.insecure_channel(
            f"unix:{self.socket_path}",
            options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)],
        )
        self.channels.append(ch)
        return ch

    def stubs(self, token: str | None) -> Stubs:
        return Stubs(self.channel(), token)

    def owner(self) -> Stubs:
        return self.stubs(self.owner_token)

    def register(self, app_id: str, **quota: int) -> Stubs:
        o = self.owner()
        resp = o.apps.RegisterApp(apps_pb2.RegisterAppRequest(app_id=app_id, quota=apps_pb2.AppQuota(**quota)),
                                  metadata=o.md, timeout=10)  # fmt: skip
        return self.stubs(resp.token)

    def set_probe(self, values: dict[str, Any]) -> None:
        write_probe(self.probe_file, values)

    def close_channels(self) -> None:
        for ch in self.channels:
            ch.close()
        self.channels.clear()


class SubprocessDaemon(_Base):
    """`python -m lorad.server --config <toml>`; stderr (JSON log lines) is appended to ``log_path`` across restarts."""

    def __init__(self, root: Path, model_dir: Path, probe: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, **sections: dict[str, Any]) -> None:  # fmt: skip
        super().__init__()
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.data_dir = root / "data"
        self.probe_file = root / "probe.json"
        self.socket_path = self.data_dir / "run" / "lorad.sock"
        self.log_path = root / "daemon.log"
        write_probe(self.probe_file, GOOD if probe is None else probe)
        use_file = "conditions" not in sections or "probe" not in sections["conditions"]
        values = config_values(self.data_dir, model_dir, self.probe_file if use_file else None, **sections)
        self.config_path = root / "lorad.toml"
        self.config_path.write_text(_toml(values))
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        for k in list(self.env):
            if k.startswith("LORAD_") and k not in (env or {}):
                del self.env[k]  # the test's own environment must not reconfigure the daemon
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout_s: float = 90.0, wait: bool = True) -> SubprocessDaemon:
        """Starts the daemon and waits until health says SERVING (or raises with the log tail)."""
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lorad.server", "--config", str(self.config_path)],
            stdout=log, stderr=log, env=self.env, cwd=self.root,
        )  # fmt: skip
        log.close()
        self.starts += 1
        if wait:
            self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.socket_path.exists():
                ch = grpc.insecure_channel(f"unix:{self.socket_path}")
                try:
                    if Stubs(ch, None).healthy(1.0):
                        return
                finally:
                    ch.close()
            time.sleep(0.05)
        raise AssertionError(f"daemon not SERVING after {timeout_s}s:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL: no handler runs, nothing is flushed beyond what the daemon already made durable."""
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.close_channels()

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code (SIGKILL after ``timeout_s``)."""
        self.close_channels()
        if not self.alive():
            return self.proc.returncode if self.proc else 0
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"daemon ignored SIGTERM for {timeout_s}s") from None

    def rss_bytes(self) -> int:
        import psutil

        return int(psutil.Process(self.pid).memory_info().rss)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_lines(self) -> list[str]:
        return self.log_text().splitlines()

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_lines()[-n:])


class InProcDaemon(_Base):
    """A real lorad Daemon served by a background event loop in this process (for monkeypatched fault injection)."""

    def __init__(self, root: Path, model_dir: Path, probe: dict[str, Any] | None = None, factory: Any = None,
                 **sections: dict[str, Any]) -> None:  # fmt: skip
        from lorad.server.config import build_config
        from lorad.server.daemon import Daemon

        super().__init__()
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.data_dir = root / "data"
        self.probe_file = root / "probe.json"
        write_probe(self.probe_file, GOOD if probe is None else probe)
        values = config_values(self.data_dir, model_dir, self.probe_file, **sections)
        values["logging"] = {"level": "warning"}
        self.cfg = build_config(values, env={})
        self.socket_path = self.cfg.socket_path
        self.daemon = Daemon(self.cfg, factory=factory)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.daemon.start(), self.loop).result(90)

    @property
    def services(self) -> Any:
        return self.daemon.services

    def stop(self) -> None:
        self.close_channels()
        if not self.thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.daemon.stop(), self.loop).result(120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# -- request helpers ---------------------------------------------------------------------------------------------
def chat(user: str, assistant: str) -> common_pb2.Sample:
    return common_pb2.Sample(chat=common_pb2.Chat(messages=[
        common_pb2.ChatMessage(role=common_pb2.ROLE_USER, content=user),
        common_pb2.ChatMessage(role=common_pb2.ROLE_ASSISTANT, content=assistant),
    ]))  # fmt: skip


def corpus(n: int = 24, tag: str = "") -> list[common_pb2.Sample]:
    out = [chat(f"What is note {i}{tag} about?", f"Note {i}{tag} is about the quick brown fox, item {i}.")
           for i in range(n)]  # fmt: skip
    out += [common_pb2.Sample(text=f"Hello world {i}{tag}! The lazy dog sleeps.") for i in range(n // 2)]
    return out


def tiny_config(steps: int = 6, **kw: Any) -> common_pb2.TrainingConfig:
    base: dict[str, Any] = dict(max_steps=steps, seq_len=64, eval_fraction=0.3, batch_size=2, learning_rate=1e-3,
                                eval_every_steps=max(steps, 1), checkpoint_every_steps=2, seed=7,
                                lora=common_pb2.LoraConfig(rank=4))  # fmt: skip
    base.update(kw)
    return common_pb2.TrainingConfig(**base)


def append(stubs: Stubs, dataset: str, samples: list[common_pb2.Sample], timeout: float = 30) -> Any:
    return stubs.data.AppendSamples(data_pb2.AppendSamplesRequest(dataset_id=dataset, samples=samples),
                                    metadata=stubs.md, timeout=timeout)  # fmt: skip


def create_job(stubs: Stubs, request_id: str, datasets: tuple[str, ...], steps: int = 6, **cfg: Any) -> Any:
    return stubs.jobs.CreateJob(jobs_pb2.CreateJobRequest(request_id=request_id, dataset_ids=list(datasets),
                                                          config=tiny_config(steps, **cfg)),
                                metadata=stubs.md, timeout=30).job  # fmt: skip


def get_job(stubs: Stubs, job_id: str) -> Any:
    return stubs.jobs.GetJob(jobs_pb2.GetJobRequest(job_id=job_id), metadata=stubs.md, timeout=10).job


def wait_for(cond: Callable[[], Any], timeout_s: float = 60.0, what: str = "condition", every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def wait_state(stubs: Stubs, job_id: str, states: set[int], timeout_s: float = 120.0) -> Any:
    names = [jobs_pb2.JobState.Name(s) for s in states]
    return wait_for(lambda: (j := get_job(stubs, job_id)).state in states and j, timeout_s, f"{job_id} in {names}")


def all_events(stubs: Stubs, job_id: str, after: int = 0) -> list[Any]:
    out: list[Any] = []
    while True:
        r = stubs.jobs.ListJobEvents(
            jobs_pb2.ListJobEventsRequest(job_id=job_id, after_event_id=after, page_size=1000),
            metadata=stubs.md,
            timeout=10,
        )
        out += list(r.events)
        if not r.has_more or not r.events:
            return out
        after = r.events[-1].event_id


def all_samples(stubs: Stubs, dataset: str) -> dict[str, common_pb2.Sample]:
    out: dict[str, common_pb2.Sample] = {}
    token = ""
    while True:
        r = stubs.data.ListSamples(data_pb2.ListSamplesRequest(dataset_id=dataset, page_size=1000, page_token=token),
                                   metadata=stubs.md, timeout=30)  # fmt: skip
        for s in r.samples:
            out[s.sample_id] = s.sample
        token = r.next_page_token
        if not token:
            return out


def code_of(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    """Calls ``fn`` and returns (code, details); OK with '' when it succeeds (streams are drained)."""
    try:
        r = fn()
        if hasattr(r, "__iter__") and not hasattr(r, "ListFields"):
            for _ in r:
                pass
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def download(stubs: Stubs, adapter_id: str) -> bytes:
    """The PEFT tar of an adapter, sha256-checked against the header."""
    import hashlib

    from lorad.v1 import adapters_pb2

    header, chunks = None, []
    for m in stubs.adapters.DownloadAdapter(adapters_pb2.DownloadAdapterRequest(adapter_id=adapter_id),
                                            metadata=stubs.md, timeout=60):  # fmt: skip
        if m.WhichOneof("payload") == "header":
            header = m.header
        else:
            chunks.append(m.chunk)
    blob = b"".join(chunks)
    assert header is not None and header.total_size_bytes == len(blob)
    assert hashlib.sha256(blob).hexdigest() == header.sha256
    return blob


def adapter_tensors(tar_blob: bytes) -> dict[str, Any]:
    import io
    import tarfile

    from safetensors.torch import load as st_load

    with tarfile.open(fileobj=io.BytesIO(tar_blob)) as tar:
        f = tar.extractfile("adapter_model.safetensors")
        assert f is not None
        return st_load(f.read())


# -- store snapshots -----------------------------------------------------------------------------------------------
def store_snapshot(data_dir: Path, ignore_tables: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every row of every table of the daemon's SQLite DB (read-only connection) plus the data dir's file tree.

    DB files themselves are left out of the tree (their bytes change with WAL checkpoints, not with data).
    """
    uri = f"file:{data_dir / 'lorad.sqlite'}?mode=ro"
    conn = sqlite3.connect(uri, uri=True, timeout=10)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        snap: dict[str, Any] = {}
        for t in tables:
            if t in ignore_tables or t.startswith("sqlite_"):
                continue
            snap[t] = sorted(repr(tuple(r)) for r in conn.execute(f'SELECT * FROM "{t}"'))
    finally:
        conn.close()
    snap["__files__"] = sorted(
        (str(p.relative_to(data_dir)), p.stat().st_size if p.is_file() else -1)
        for p in iter_tree(data_dir)
        if p.name not in DB_FILES and not p.is_socket()
    )
    return snap


def iter_tree(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            yield Path(dirpath) / n


def diff_snapshots(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = set(a.get(k, [])), set(b.get(k, []))
        if x != y:
            out.append(f"{k}: -{sorted(x - y)[:3]} +{sorted(y - x)[:3]}")
    return out
