"""DeviceService: the device's status (backend, readings, models), disk usage and garbage collection."""
# ruff: noqa: N802  (servicer method names are fixed by the generated gRPC base classes)

from __future__ import annotations

import asyncio
import dataclasses
import re
import sys
from typing import Any

from grpc import aio

from lorad.server import disk
from lorad.server.jobs.files import tree_size
from lorad.server.modelhost import UNREADABLE
from lorad.server.records import JobState
from lorad.server.rpc import convert as cv
from lorad.server.rpc.interceptor import principal
from lorad.server.services import Services
from lorad.v1 import (
    device_pb2,
    device_pb2_grpc,
)

CPU_KERNELS_UNDECIDED = "not loaded yet: decided when the daemon first loads a model"


def _cpu_kernels() -> tuple[bool, str]:
    """Whether training runs the fused CPU kernels, and why (``fused.describe``), once this process has imported them
    with its first model; before that torch is not imported, and a status line is no reason to import it."""
    if "lorad.kernels.fused" not in sys.modules:
        return False, CPU_KERNELS_UNDECIDED
    from lorad.kernels import fused  # waits for an import another thread is finishing

    return fused.describe()


class DeviceServicer(device_pb2_grpc.DeviceServiceServicer):
    """Backend, readings and what the caller's job waits for."""

    def __init__(self, s: Services) -> None:
        self.s = s

    def _status(self, app_id: str | None) -> device_pb2.GetDeviceStatusResponse:
        info = self.s.backend.info
        backend = device_pb2.BackendStatus(
            backend=cv.BACKEND_ENUMS.get(info.name, 0),
            reason=info.reason,
            soc_model=info.soc_model,
            htp_arch=info.htp_arch,
            available=[
                device_pb2.BackendAvailability(
                    backend=cv.BACKEND_ENUMS.get(k, 0), usable=not st.startswith("unavailable"), detail=st
                )
                for k, st in info.available.items()
            ],
        )
        backend.cpu_kernels.active, detail = _cpu_kernels()
        if app_id is None:  # the detail names paths on the device
            backend.cpu_kernels.detail = detail
        r = self.s.monitor.latest()
        if app_id is not None:  # an app sees which kind of probe, never a device path
            r = dataclasses.replace(r, source=re.sub(r":[^+]*", "", r.source))
        verdict = self.s.judge(r, self.s.default_requirements)
        out = device_pb2.GetDeviceStatusResponse(
            backend=backend,
            readings=cv.readings_pb(r),
            can_train=verdict.ok,
            blocked_reasons=[cv.blocked_pb(b) for b in verdict.reasons],
            blocked_detail=verdict.detail,
            version=_version(),
            profile=cv.PROFILE_ENUMS[self.s.profile.name],
            profile_reason=self.s.profile.reason,
            unblock_hint=verdict.hint,
        )
        if app_id is not None:
            active = self.s.manager.list_page(
                app_id, [JobState.RUNNING, JobState.PAUSING, JobState.QUEUED, JobState.WAITING], 1000, ""
            )[0]
            if active:
                job = min(active, key=lambda j: (j.state not in (JobState.RUNNING, JobState.PAUSING), j.created_at_ms))
                out.current_job_id, out.current_job_state = job.job_id, cv.state_pb(job.state)
                if job.blocked_detail and not out.blocked_detail:
                    out.blocked_detail = job.blocked_detail
        for e in self.s.models.entries.values():
            m = device_pb2.ModelInfo(name=e.name, is_default=e.is_default)
            facts = self.s.models.facts(e.name)
            if isinstance(facts, str):  # an app is told that a model is unreadable, never the path in the error
                m.detail = facts if app_id is None or not facts.startswith(UNREADABLE) else UNREADABLE
            else:
                m.family, m.parameters, m.sha256 = facts.family, facts.parameters, facts.sha256
            out.models.append(m)
        return out

    async def GetDeviceStatus(self, request: device_pb2.GetDeviceStatusRequest, context: aio.ServicerContext) -> Any:
        return await asyncio.to_thread(self._status, principal().app_id)

    def _app_ids(self, app_id: str | None) -> list[str]:
        """The caller's app, or every app for the owner (revoked ones still hold files)."""
        if app_id is not None:
            return [app_id]
        out, token = [], ""
        while True:
            page, token = self.s.registry.list_page(1000, token)
            out += [a.app_id for a in page]
            if not token:
                return out

    def _usage(self, app_id: str | None) -> device_pb2.GetDiskUsageResponse:
        out = device_pb2.GetDiskUsageResponse(
            export_cache_limit_bytes=self.s.cfg.storage.export_cache_max_mb * 1024 * 1024
        )
        for a in self._app_ids(app_id):
            u = disk.app_usage(self.s.layout, a, self.s.registry.get(a).sample_bytes)
            out.apps.append(
                device_pb2.AppDiskUsage(
                    app_id=u.app_id,
                    data_bytes=u.data_bytes,
                    checkpoint_bytes=u.checkpoint_bytes,
                    adapter_bytes=u.adapter_bytes,
                    export_bytes=u.export_bytes,
                )
            )
        if app_id is None:
            out.cache_bytes = tree_size(self.s.models.cache_root)
            out.database_bytes = disk.database_bytes(self.s.db.path)
        return out

    async def GetDiskUsage(self, request: device_pb2.GetDiskUsageRequest, context: aio.ServicerContext) -> Any:
        return await asyncio.to_thread(self._usage, principal().app_id)

    async def CollectGarbage(self, request: device_pb2.CollectGarbageRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().app_id
        owner_caches = self.s.models.cache_root if app_id is None else None
        training = self.s.runner.current_job_id is not None
        c = await asyncio.to_thread(disk.collect, self.s.layout, self._app_ids(app_id), owner_caches, training)
        return device_pb2.CollectGarbageResponse(
            freed_bytes=c.freed_bytes, removed_files=c.removed_files, caches_kept_reason=c.caches_kept_reason
        )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lorad")
    except PackageNotFoundError:
        return "0+unknown"
