"""Wires the daemon's parts together: store, auth, runner, manager, monitor, scheduler, models."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from lorad.server.adapters import AdapterLibrary
from lorad.server.apps import AppRegistry
from lorad.server.auth import Authenticator, ensure_owner_token
from lorad.server.backend import BackendDecision, decide_backend
from lorad.server.config import Config
from lorad.server.data import AppData
from lorad.server.device.conditions import Verdict, evaluate
from lorad.server.device.monitor import ConditionMonitor
from lorad.server.device.probes import Probe, Readings, make_probe
from lorad.server.device.profile import DeviceProfile, resolve_profile
from lorad.server.device.wakelock import WakeLockHooks
from lorad.server.gate import DeletionGate
from lorad.server.intents import SpaceReserve
from lorad.server.jobs import EventHub, JobManager, Layout, Runner, SessionFactory
from lorad.server.modelhost import ModelHost
from lorad.server.records import Job, Requirements
from lorad.server.rpc.streams import OpenStreams
from lorad.server.singleton import private_dir
from lorad.server.store import AdapterRepo, AppRepo, Database, JobRepo, SampleRepo
from lorad.server.store.schedules import ScheduleRepo

log = structlog.get_logger(__name__)


@dataclass
class Services:
    """Everything a servicer may call."""

    cfg: Config
    db: Database
    apps: AppRepo
    samples: SampleRepo
    jobs: JobRepo
    adapters: AdapterRepo
    schedules: ScheduleRepo
    layout: Layout
    hub: EventHub
    runner: Runner
    manager: JobManager
    monitor: ConditionMonitor
    models: ModelHost
    auth: Authenticator
    owner_token: str
    wake_lock: WakeLockHooks
    profile: DeviceProfile
    registry: AppRegistry  # the domain layer servicers call (the repos above are for the daemon's own parts)
    data: AppData
    library: AdapterLibrary
    reserve: SpaceReserve
    backend: BackendDecision  # the one backend decision of this daemon (status, CreateJob, jobs, inference)
    gate: DeletionGate  # deletions against the app's writes of the same data
    on_forget: list[Callable[[str], None]] = field(default_factory=list)  # per-app in-memory caches to drop
    # in-memory copies of deleted adapters to drop (DeleteAdapter, DeleteDataset with its adapters), by adapter id
    on_adapters_deleted: list[Callable[[Collection[str]], None]] = field(default_factory=list)
    streams: OpenStreams = field(default_factory=OpenStreams)  # open streaming calls, ended on revocation

    @property
    def default_requirements(self) -> Requirements:
        """The configured default device requirements."""
        c = self.cfg.conditions
        return Requirements(c.require_charging, c.min_battery_percent, c.max_temperature_celsius, c.require_idle)

    def judge(self, r: Readings, req: Requirements) -> Verdict:
        """Whether ``req`` holds for ``r`` on this device's profile."""
        return evaluate(r, req, self.profile)


def build_services(cfg: Config, factory: SessionFactory | None = None, probe: Probe | None = None) -> Services:
    """Opens the store and builds every part (nothing runs until the daemon starts the runner and monitor).

    Args:
        cfg: configuration.
        factory: training sessions; default the real engine (tests may inject others for store/RPC logic).
        probe: device readings; default from ``cfg.conditions``.
    """
    data = cfg.data_dir
    private_dir(data, "data directory")
    db = Database(data / "lorad.sqlite")
    apps, samples, jobs, adapters = AppRepo(db), SampleRepo(db), JobRepo(db), AdapterRepo(db)
    layout = Layout(data)
    hub = EventHub()
    cache_root = data / "cache"
    t = cfg.training
    backend = decide_backend(t.backend, qnn_bundle=bool(t.qnn_bundle))
    models = ModelHost(t.default_model, t.model_dirs, cache_root, backend)
    loader = None
    if t.qnn_bundle:  # checked before anything runs: a wrong bundle stops the start with a clear error
        from lorad.server.qnn_bundle import bundle_loader, open_bundle

        loader = bundle_loader(open_bundle(t.qnn_bundle, models.default, cache_root))
        models = ModelHost(t.default_model, t.model_dirs, cache_root, backend, loader=loader)
    if factory is None:
        from lorad.server.jobs.engine import engine_factory

        factory = engine_factory(models, cache_root, backend, t.torch_threads, loader=loader)
    c = cfg.conditions
    profile = resolve_profile(cfg.device.profile, c.probe)
    log.info("device_profile", profile=profile.name, reason=profile.reason)
    monitor = ConditionMonitor(probe or make_probe(c.probe, c.probe_file, c.termux_timeout_seconds), c.poll_seconds)
    dev = cfg.device
    wake = WakeLockHooks(dev.wake_lock_acquire, dev.wake_lock_release, dev.wake_lock_timeout_seconds)
    reserve = SpaceReserve(data)
    runner = Runner(
        jobs,
        samples,
        adapters,
        layout,
        factory,
        hub,
        monitor.latest,
        cfg.storage.keep_checkpoints,
        backend_for=lambda job: job_backend(job, backend),
        on_running=wake.set_held,
        judge=lambda r, req: evaluate(r, req, profile),
        reserve=reserve,
    )
    gate = DeletionGate()
    manager = JobManager(apps, jobs, samples, adapters, runner, hub, layout, gate)
    owner = ensure_owner_token(data)
    return Services(
        cfg,
        db,
        apps,
        samples,
        jobs,
        adapters,
        ScheduleRepo(db),
        layout,
        hub,
        runner,
        manager,
        monitor,
        models,
        Authenticator(owner, apps),
        owner,
        wake,
        profile,
        AppRegistry(apps),
        AppData(apps, samples, gate),
        AdapterLibrary(adapters, layout, models, gate, cfg.storage.export_cache_max_mb * 1024 * 1024),
        reserve,
        backend,
        gate,
    )


def job_backend(job: Job, decision: BackendDecision) -> tuple[str, str]:
    """(backend, why) a job trains on: its own choice if this device runs it, else the daemon's decision."""
    info = decision.for_job(job.spec.params.backend)
    return info.name, info.reason


def owner_token_path(data_dir: Path) -> Path:
    """Where the owner token lives."""
    return data_dir / "owner.token"
