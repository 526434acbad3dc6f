"""`lorad serve`: the grpc.aio daemon on a Unix socket (and optional loopback TCP), with health and reflection."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
import structlog
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lorad.server.config import Config, ConfigError, serve_config
from lorad.server.device.probes import Probe
from lorad.server.engine.api import malloc_in_use
from lorad.server.jobs import SessionFactory
from lorad.server.logs import configure_logging
from lorad.server.qnn_bundle import StartupError
from lorad.server.rpc.adapters import AdapterServicer
from lorad.server.rpc.apps import AppServicer
from lorad.server.rpc.data import DataServicer
from lorad.server.rpc.device import DeviceServicer
from lorad.server.rpc.inference import InferenceServicer
from lorad.server.rpc.interceptor import AuthInterceptor
from lorad.server.rpc.jobs import JobServicer
from lorad.server.scheduler import WindowScheduler
from lorad.server.services import Services, build_services
from lorad.server.singleton import DataDirLock, StartRefusedError, private_dir
from lorad.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    apps_pb2,
    apps_pb2_grpc,
    data_pb2,
    data_pb2_grpc,
    device_pb2,
    device_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
)

log = structlog.get_logger(__name__)

TCP_ADDRESS_FILE = "tcp.address"

SERVICE_NAMES = tuple(
    m.DESCRIPTOR.services_by_name[n].full_name
    for m, n in (
        (apps_pb2, "AppService"),
        (data_pb2, "DataService"),
        (jobs_pb2, "JobService"),
        (adapters_pb2, "AdapterService"),
        (inference_pb2, "InferenceService"),
        (device_pb2, "DeviceService"),
    )
)


class Daemon:
    """The running daemon: services, the gRPC server, the runner, the condition monitor and the scheduler."""

    def __init__(self, cfg: Config, factory: SessionFactory | None = None, probe: Probe | None = None) -> None:
        self.cfg, self._factory, self._probe = cfg, factory, probe
        self.services: Services | None = None
        self.server: aio.Server | None = None
        self.scheduler: WindowScheduler | None = None
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.tcp_port: int | None = None
        self.serving = False
        self.lock = DataDirLock(cfg.data_dir)

    @property
    def socket_path(self) -> Path:
        """The Unix socket."""
        return self.cfg.socket_path

    @property
    def tcp_address_file(self) -> Path:
        """``host:port`` of the TCP listener while it runs (``tcp.address`` next to the socket)."""
        return self.cfg.socket_path.with_name(TCP_ADDRESS_FILE)

    async def start(self) -> None:
        """Locks the data dir, opens the store, finishes what a kill interrupted, recovers jobs, starts serving.

        Raises:
            StartRefusedError: another daemon serves the data dir, or a directory is not private.
        """
        private_dir(self.cfg.data_dir, "data directory")
        self.lock.acquire()  # before anything else: a second daemon must not touch the store or the socket
        try:
            await self._start()
        except BaseException:
            self.lock.release()
            raise

    async def _start(self) -> None:
        from lorad.server.disk import remove_stranded
        from lorad.server.forget import resume_pending

        s = self.services = await asyncio.to_thread(build_services, self.cfg, self._factory, self._probe)
        await asyncio.to_thread(resume_pending, s)  # an interrupted ForgetApp/DeleteDataset ends before any job runs
        await asyncio.to_thread(remove_stranded, s.layout, s.adapters.ids)
        s.hub.bind(asyncio.get_running_loop())
        await asyncio.to_thread(s.monitor.read_now)
        await asyncio.to_thread(s.runner.start)
        s.monitor.listeners.append(s.runner.reconcile)
        s.monitor.start()
        self.scheduler = WindowScheduler(
            f"sqlite:///{self.cfg.data_dir / 'scheduler.sqlite'}",
            s.manager,
            s.schedules,
            self.cfg.scheduler.misfire_grace_hours,
            self.cfg.scheduler.timezone,
        )
        self.scheduler.start()
        limit = self.cfg.server.max_message_bytes
        server = self.server = aio.server(
            interceptors=[AuthInterceptor(s.auth, lambda: self.serving, s.streams)],
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ],
        )
        apps_pb2_grpc.add_AppServiceServicer_to_server(AppServicer(s), server)
        data_pb2_grpc.add_DataServiceServicer_to_server(DataServicer(s, self.scheduler.remove), server)
        jobs_pb2_grpc.add_JobServiceServicer_to_server(JobServicer(s, self.scheduler), server)
        adapters_pb2_grpc.add_AdapterServiceServicer_to_server(AdapterServicer(s, self.scheduler.remove), server)
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(s), server)
        device_pb2_grpc.add_DeviceServiceServicer_to_server(DeviceServicer(s), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        sock = self.socket_path
        private_dir(sock.parent, "socket directory")  # only the owner may even reach the socket
        if sock.exists() or sock.is_symlink():
            sock.unlink()  # stale socket of a previous (crashed) run: we hold the data dir's lock
        server.add_insecure_port(f"unix:{sock}")
        if self.cfg.server.tcp_address:
            self.tcp_port = server.add_insecure_port(self.cfg.server.tcp_address)
        await server.start()
        sock.chmod(0o600)
        if self.tcp_port is not None:
            # The bound address for owner tools and docs/api.md ("port 0 = any" is only known after binding); in
            # the owner-only run directory, next to the socket, removed on stop.
            host = self.cfg.server.tcp_address.rpartition(":")[0]
            self.tcp_address_file.write_text(f"{host}:{self.tcp_port}\n")
        self.serving = True
        for name in ("", *SERVICE_NAMES):
            await self._set_health(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("daemon_started", socket=str(sock), tcp_port=self.tcp_port, data_dir=str(self.cfg.data_dir),
                 malloc=malloc_in_use())  # fmt: skip

    async def _set_health(self, name: str, status: int) -> None:
        res = self.health.set(name, status)
        if asyncio.iscoroutine(res):
            await res

    async def stop(self) -> None:
        """NOT_SERVING → checkpoint the running job → stop the scheduler and monitor → server.stop(grace)."""
        self.serving = False
        for name in ("", *SERVICE_NAMES):
            await self._set_health(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        s = self.services
        ok = True
        if s is not None:
            ok = await asyncio.to_thread(s.runner.close, self.cfg.server.checkpoint_timeout_seconds)
            log.info("runner_stopped", checkpointed=ok)
            await asyncio.to_thread(s.wake_lock.shutdown)  # release even if the worker is still inside a step
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if s is not None:
            await s.monitor.stop()
        if self.server is not None:
            await self.server.stop(self.cfg.server.shutdown_grace_seconds)
        if s is not None and ok:  # a worker still inside a step keeps the connection until the process exits
            s.db.close()
        if self.socket_path.exists():
            self.socket_path.unlink()
        self.tcp_address_file.unlink(missing_ok=True)
        self.lock.release()
        log.info("daemon_stopped")


async def _serve(cfg: Config) -> int:
    d = Daemon(cfg)
    await d.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("daemon_stopping")
    await d.stop()
    return 0


def serve_main(argv: Sequence[str]) -> int:
    """Entry point of `lorad serve`; returns the exit code (2 for a bad configuration)."""
    try:
        cfg = serve_config(argv)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    configure_logging(cfg.logging.level, cfg.logging.format)
    if cfg.training.allocator == "tcmalloc" and malloc_in_use() != "tcmalloc":
        print(f"lorad: training.allocator='tcmalloc' but LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r} did not "
              "load it", file=sys.stderr)  # fmt: skip
        return 2
    try:
        return asyncio.run(_serve(cfg))
    except StartRefusedError as exc:  # another daemon on this data dir, or a shared directory
        log.error("daemon_refused_to_start", error=str(exc)[:500])
        print(f"lorad: {exc}", file=sys.stderr)
        return 1
    except StartupError as exc:  # e.g. a QNN bundle made for another model or SoC
        log.error("daemon_refused_to_start", error=str(exc)[:500])
        print(f"lorad: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:  # e.g. the socket cannot be bound
        log.error("daemon_failed", error=str(exc)[:300])
        return 1
    except sqlite3.DatabaseError as exc:  # a corrupt or foreign lorad.sqlite: say which file, no traceback
        db = cfg.data_dir / "lorad.sqlite"
        log.error("store_unreadable", path=str(db), error=str(exc)[:300])
        print(
            f"lorad: cannot open the database {db}: {exc}; restore it from a backup or move it aside "
            "(a new, empty one is created at the next start)",
            file=sys.stderr,
        )
        return 1
