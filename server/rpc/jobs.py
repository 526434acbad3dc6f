"""JobService: create (idempotent), control, watch (paged, resumable) and schedules."""
# ruff: noqa: N802  (servicer method names are fixed by the generated gRPC base classes)

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from lorad.server import validation as v
from lorad.server.errors import InvalidArgument, Unauthenticated
from lorad.server.init_adapter import with_init_adapter
from lorad.server.records import JobSpec
from lorad.server.rpc import convert as cv
from lorad.server.rpc.interceptor import principal
from lorad.server.scheduler.windows import WindowScheduler
from lorad.server.services import Services
from lorad.v1 import jobs_pb2, jobs_pb2_grpc

WATCH_PAGE = 100  # events read per query while catching up: a long history streams in pages, never all at once
WATCH_POLL_S = 2.0  # re-check even without a wake-up (revocation, missed notify)


class JobServicer(jobs_pb2_grpc.JobServiceServicer):
    """Jobs of the calling app."""

    def __init__(self, s: Services, scheduler: WindowScheduler | None) -> None:
        self.s = s
        self.scheduler = scheduler

    def _spec(
        self, dataset_ids: Any, config: Any, requirements: Any, window: Any, has_window: bool, *, app_id: str
    ) -> JobSpec:
        ids = v.check_dataset_ids("dataset_ids", list(dataset_ids))
        raw = cv.training_raw(config)
        params = v.build_params(raw)
        base, init = v.build_job_model(raw)
        self.s.models.entry(base)
        lora_given = bool(config.lora.rank or config.lora.alpha or config.lora.target_modules)
        params = with_init_adapter(self.s, app_id, params, base_model=base, init_adapter_id=init, lora_given=lora_given)
        v.check_precision_for_backend(params, self.s.backend.for_job(params.backend).name)
        reqs = v.build_requirements(cv.requirements_raw(requirements), self.s.default_requirements)
        win = v.build_window(window.cron, window.jitter_seconds, window.timezone) if has_window else None
        return JobSpec(ids, params, reqs, win, base_model=base, init_adapter_id=init)

    async def CreateJob(self, request: jobs_pb2.CreateJobRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        rid = v.check_request_id(request.request_id)
        spec = self._spec(
            request.dataset_ids,
            request.config,
            request.requirements,
            request.window,
            request.HasField("window"),
            app_id=app_id,
        )
        job = await asyncio.to_thread(self.s.manager.create, app_id, rid, spec)
        return jobs_pb2.CreateJobResponse(job=cv.job_pb(job))

    async def GetJob(self, request: jobs_pb2.GetJobRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        job = await asyncio.to_thread(self.s.manager.get, app_id, v.check_server_id("job_id", request.job_id))
        return jobs_pb2.GetJobResponse(job=cv.job_pb(job))

    async def ListJobs(self, request: jobs_pb2.ListJobsRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        states = []
        for i, raw in enumerate(request.states):
            st = cv.state_from_pb(raw)
            if st is None:
                raise InvalidArgument(f"states[{i}]", f"{raw} is not a job state; use JOB_STATE_QUEUED … CANCELLED")
            states.append(st)
        jobs, nxt = await asyncio.to_thread(
            self.s.manager.list_page, app_id, states, request.page_size, request.page_token
        )
        return jobs_pb2.ListJobsResponse(jobs=[cv.job_pb(j) for j in jobs], next_page_token=nxt)

    async def PauseJob(self, request: jobs_pb2.PauseJobRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        job = await asyncio.to_thread(self.s.manager.pause, app_id, v.check_server_id("job_id", request.job_id))
        return jobs_pb2.PauseJobResponse(job=cv.job_pb(job))

    async def ResumeJob(self, request: jobs_pb2.ResumeJobRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        job = await asyncio.to_thread(self.s.manager.resume, app_id, v.check_server_id("job_id", request.job_id))
        return jobs_pb2.ResumeJobResponse(job=cv.job_pb(job))

    async def CancelJob(self, request: jobs_pb2.CancelJobRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        job_id = v.check_server_id("job_id", request.job_id)
        job = await asyncio.to_thread(self.s.manager.cancel, app_id, job_id)
        if self.scheduler is not None:
            self.scheduler.remove(f"window:{job_id}")
        return jobs_pb2.CancelJobResponse(job=cv.job_pb(job))

    async def WatchJob(
        self, request: jobs_pb2.WatchJobRequest, context: aio.ServicerContext
    ) -> AsyncIterator[jobs_pb2.WatchJobResponse]:
        p = principal()
        app_id = p.require_app()
        job_id = v.check_server_id("job_id", request.job_id)
        await asyncio.to_thread(self.s.manager.get, app_id, job_id)
        cursor = v.check_int64("after_event_id", request.after_event_id)
        while True:
            seen = self.s.hub.version
            events, more = await asyncio.to_thread(self.s.manager.events, app_id, job_id, cursor, WATCH_PAGE)
            if events:
                job_pb = cv.job_pb(await asyncio.to_thread(self.s.manager.get, app_id, job_id))
                for e in events:
                    # A slow reader applies back-pressure here (write waits on flow control), so memory stays flat.
                    yield jobs_pb2.WatchJobResponse(event=cv.event_pb(e), job=job_pb)
                    cursor = e.event_id
            if more:
                continue
            job = await asyncio.to_thread(self.s.manager.get, app_id, job_id)
            if job.state.final:
                tail, _ = await asyncio.to_thread(self.s.manager.events, app_id, job_id, cursor, 1)
                if not tail:
                    return
                continue
            await self.s.hub.wait_change(seen, WATCH_POLL_S)
            # Revocation is immediate for streams too: re-check the token's app is still active.
            if await asyncio.to_thread(self.s.registry.is_revoked, app_id):
                raise Unauthenticated("unknown or revoked token")

    async def ListJobEvents(self, request: jobs_pb2.ListJobEventsRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        job_id = v.check_server_id("job_id", request.job_id)
        after = v.check_int64("after_event_id", request.after_event_id)
        events, more = await asyncio.to_thread(
            self.s.manager.events,
            app_id,
            job_id,
            after,
            request.page_size,  # the manager applies the paging rule
        )
        return jobs_pb2.ListJobEventsResponse(events=[cv.event_pb(e) for e in events], has_more=more)

    async def ListCheckpoints(self, request: jobs_pb2.ListCheckpointsRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        cks = await asyncio.to_thread(self.s.manager.checkpoints, app_id, v.check_server_id("job_id", request.job_id))
        return jobs_pb2.ListCheckpointsResponse(checkpoints=[cv.checkpoint_pb(c) for c in cks])

    async def CreateSchedule(self, request: jobs_pb2.CreateScheduleRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        if not request.HasField("window"):
            raise InvalidArgument("window.cron", "required: a five-field cron expression, e.g. '30 2 * * *'")
        spec = self._spec(
            request.dataset_ids, request.config, request.requirements, request.window, True, app_id=app_id
        )
        sched = await asyncio.to_thread(self._add_schedule, app_id, spec)
        return jobs_pb2.CreateScheduleResponse(schedule=cv.schedule_pb(sched))

    def _add_schedule(self, app_id: str, spec: JobSpec) -> Any:
        with self.s.manager.adding(app_id, spec):
            assert self.scheduler is not None
            return self.scheduler.add_schedule(app_id, spec)

    async def ListSchedules(self, request: jobs_pb2.ListSchedulesRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        assert self.scheduler is not None
        scheds = await asyncio.to_thread(self.scheduler.list_schedules, app_id)
        return jobs_pb2.ListSchedulesResponse(schedules=[cv.schedule_pb(x) for x in scheds])

    async def DeleteSchedule(self, request: jobs_pb2.DeleteScheduleRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        sid = v.check_server_id("schedule_id", request.schedule_id)
        assert self.scheduler is not None
        await asyncio.to_thread(self.scheduler.delete_schedule, app_id, sid)
        return jobs_pb2.DeleteScheduleResponse()
