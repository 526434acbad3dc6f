"""TEST DOUBLE of the lorad daemon for SDK/CLI tests: a real grpc.aio server with in-memory state and fault injection.

It implements only the RPCs the client tests exercise, with the documented status codes. It is never shipped and
never used by the product; it exists until (and next to) tests against the real daemon in lorad.server.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from lorad.client import RetryPolicy
from lorad.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    apps_pb2,
    apps_pb2_grpc,
    common_pb2,
    data_pb2,
    data_pb2_grpc,
    device_pb2,
    device_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
)

OWNER_TOKEN = "owner-secret-token"
FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_seconds=0.01, max_backoff_seconds=0.02)
CHUNK = 1000  # bytes per download chunk: small, so tests see many chunks


@dataclass
class State:
    """Shared in-memory state plus fault-injection knobs."""

    tokens: dict[str, str] = field(default_factory=dict)  # token -> app_id
    apps: dict[str, apps_pb2.App] = field(default_factory=dict)
    samples: dict[tuple[str, str], list[bytes]] = field(default_factory=lambda: defaultdict(list))
    jobs: dict[str, jobs_pb2.Job] = field(default_factory=dict)
    job_owner: dict[str, str] = field(default_factory=dict)
    requests: dict[tuple[str, str], tuple[bytes, str]] = field(default_factory=dict)
    events: dict[str, list[jobs_pb2.JobEvent]] = field(default_factory=lambda: defaultdict(list))
    adapter_blob: bytes = bytes(range(256)) * 40  # 10,240 bytes
    adapter_sha_override: str = ""
    # method name -> number of upcoming calls to fail with UNAVAILABLE
    fail_next: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    download_offsets: list[int] = field(default_factory=list)
    download_cut_after_chunks: list[int] = field(default_factory=list)  # per call, popped; abort after n chunks
    download_chunk_delay_s: float = 0.0  # sleep before each chunk, so concurrent downloads overlap
    watch_cut_after_events: list[int] = field(default_factory=list)
    watch_after_ids: list[int] = field(default_factory=list)
    create_job_payloads: list[str] = field(default_factory=list)
    can_train: bool = True


def _app_of(ctx: grpc.aio.ServicerContext, st: State) -> str:
    md = dict(ctx.invocation_metadata() or ())
    auth = md.get("authorization", "")
    token = auth.removeprefix("Bearer ")
    if token == OWNER_TOKEN:
        return ""
    if token in st.tokens:
        return st.tokens[token]
    raise _Abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, msg: str, field: str = "") -> None:
        super().__init__(msg)
        self.code, self.msg, self.field = code, msg, field


async def _fault(st: State, method: str, ctx: grpc.aio.ServicerContext) -> None:
    st.calls[method] += 1
    if st.fail_next[method] > 0:
        st.fail_next[method] -= 1
        await ctx.abort(grpc.StatusCode.UNAVAILABLE, "injected outage")


def _wrap(st: State, method: str, fn: Any) -> Any:
    async def unary(self: Any, request: Any, ctx: grpc.aio.ServicerContext) -> Any:
        await _fault(st, method, ctx)
        try:
            return await fn(self, request, ctx)
        except _Abort as a:
            if a.field:
                ctx.set_trailing_metadata((("lorad-error-field", a.field),))
            await ctx.abort(a.code, a.msg)

    return unary


class Apps(apps_pb2_grpc.AppServiceServicer):
    def __init__(self, st: State) -> None:
        self.st = st

    async def _register(self, req: apps_pb2.RegisterAppRequest, ctx: Any) -> apps_pb2.RegisterAppResponse:
        if _app_of(ctx, self.st) != "":
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED, "RegisterApp needs the owner token")
        if not req.app_id:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "app_id is empty", "app_id")
        if req.app_id in self.st.apps:
            raise _Abort(grpc.StatusCode.ALREADY_EXISTS, f"app {req.app_id!r} exists")
        app = apps_pb2.App(app_id=req.app_id, display_name=req.display_name or req.app_id, created_at_ms=1)
        self.st.apps[req.app_id] = app
        token = f"tok-{req.app_id}"
        self.st.tokens[token] = req.app_id
        return apps_pb2.RegisterAppResponse(app=app, token=token)

    async def _list(self, req: apps_pb2.ListAppsRequest, ctx: Any) -> apps_pb2.ListAppsResponse:
        if _app_of(ctx, self.st) != "":
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED, "ListApps needs the owner token")
        ids = sorted(self.st.apps)
        start = int(req.page_token or 0)
        page = ids[start : start + 2]  # tiny pages so paging is exercised
        nxt = str(start + 2) if start + 2 < len(ids) else ""
        return apps_pb2.ListAppsResponse(apps=[self.st.apps[i] for i in page], next_page_token=nxt)

    async def _revoke(self, req: apps_pb2.RevokeAppRequest, ctx: Any) -> apps_pb2.RevokeAppResponse:
        if _app_of(ctx, self.st) != "":
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED, "RevokeApp needs the owner token")
        if req.app_id not in self.st.apps:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"app {req.app_id!r} not found")
        for tok in [k for k, v in self.st.tokens.items() if v == req.app_id]:
            del self.st.tokens[tok]
        return apps_pb2.RevokeAppResponse()


class Data(data_pb2_grpc.DataServiceServicer):
    def __init__(self, st: State) -> None:
        self.st = st

    def _ds(self, app: str, dsid: str) -> data_pb2.Dataset:
        items = self.st.samples.get((app, dsid), [])
        return data_pb2.Dataset(dataset_id=dsid, sample_count=len(items), size_bytes=sum(map(len, items)))

    async def _append(self, req: data_pb2.AppendSamplesRequest, ctx: Any) -> data_pb2.AppendSamplesResponse:
        app = _app_of(ctx, self.st)
        for i, s in enumerate(req.samples):
            if s.WhichOneof("content") == "chat":
                for j, m in enumerate(s.chat.messages):
                    if m.role == common_pb2.ROLE_UNSPECIFIED:
                        raise _Abort(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            "role is unspecified",
                            f"samples[{i}].chat.messages[{j}].role",
                        )
            elif not s.text:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "text is empty", f"samples[{i}].text")
        store = self.st.samples[(app, req.dataset_id)]
        acc = dup = 0
        ids = []
        for s in req.samples:
            b = s.SerializeToString()
            if b in store:
                dup += 1
            else:
                store.append(b)
                acc += 1
            ids.append(f"s{store.index(b)}")
        return data_pb2.AppendSamplesResponse(
            accepted_count=acc, duplicate_count=dup, sample_ids=ids, dataset=self._ds(app, req.dataset_id)
        )

    async def _list(self, req: data_pb2.ListDatasetsRequest, ctx: Any) -> data_pb2.ListDatasetsResponse:
        app = _app_of(ctx, self.st)
        names = sorted(d for (a, d) in self.st.samples if a == app)
        return data_pb2.ListDatasetsResponse(datasets=[self._ds(app, d) for d in names])

    async def _get(self, req: data_pb2.GetDatasetRequest, ctx: Any) -> data_pb2.GetDatasetResponse:
        app = _app_of(ctx, self.st)
        if (app, req.dataset_id) not in self.st.samples:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"dataset {req.dataset_id!r} not found")
        return data_pb2.GetDatasetResponse(dataset=self._ds(app, req.dataset_id))

    async def _delete(self, req: data_pb2.DeleteDatasetRequest, ctx: Any) -> data_pb2.DeleteDatasetResponse:
        app = _app_of(ctx, self.st)
        if (app, req.dataset_id) not in self.st.samples:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"dataset {req.dataset_id!r} not found")
        return data_pb2.DeleteDatasetResponse(deleted_samples=len(self.st.samples.pop((app, req.dataset_id))))


class Jobs(jobs_pb2_grpc.JobServiceServicer):
    def __init__(self, st: State) -> None:
        self.st = st

    def _get(self, app: str, job_id: str) -> jobs_pb2.Job:
        if self.st.job_owner.get(job_id) != app:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"job {job_id!r} not found")
        return self.st.jobs[job_id]

    def add_event(self, job_id: str, state: int, step: int, total: int, loss: float) -> None:
        ev = self.st.events[job_id]
        job = self.st.jobs[job_id]
        job.state = state
        job.progress.step, job.progress.total_steps, job.progress.train_loss = step, total, loss
        if state == jobs_pb2.JOB_STATE_SUCCEEDED:
            job.adapter_id = f"ad_{job_id}"
        kind = jobs_pb2.JOB_EVENT_KIND_PROGRESS if step else jobs_pb2.JOB_EVENT_KIND_STATE_CHANGED
        ev.append(jobs_pb2.JobEvent(event_id=len(ev) + 1, job_id=job_id, kind=kind, state=state, progress=job.progress))

    async def _create(self, req: jobs_pb2.CreateJobRequest, ctx: Any) -> jobs_pb2.CreateJobResponse:
        app = _app_of(ctx, self.st)
        self.st.create_job_payloads.append(req.request_id)
        if not req.dataset_ids:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "dataset_ids is empty", "dataset_ids")
        key = (app, req.request_id)
        body = req.SerializeToString()
        if key in self.st.requests:
            prev_body, job_id = self.st.requests[key]
            if prev_body != body:
                raise _Abort(grpc.StatusCode.ALREADY_EXISTS, "request_id reused with a different payload")
            return jobs_pb2.CreateJobResponse(job=self.st.jobs[job_id])
        job_id = f"job_{len(self.st.jobs) + 1:04d}"
        job = jobs_pb2.Job(
            job_id=job_id,
            request_id=req.request_id,
            dataset_ids=req.dataset_ids,
            config=req.config,
            state=jobs_pb2.JOB_STATE_QUEUED,
        )
        if req.HasField("window"):
            job.window.CopyFrom(req.window)
        self.st.jobs[job_id] = job
        self.st.job_owner[job_id] = app
        self.st.requests[key] = (body, job_id)
        self.add_event(job_id, jobs_pb2.JOB_STATE_QUEUED, 0, 0, 0.0)
        return jobs_pb2.CreateJobResponse(job=job)

    async def _getjob(self, req: jobs_pb2.GetJobRequest, ctx: Any) -> jobs_pb2.GetJobResponse:
        return jobs_pb2.GetJobResponse(job=self._get(_app_of(ctx, self.st), req.job_id))

    async def _list(self, req: jobs_pb2.ListJobsRequest, ctx: Any) -> jobs_pb2.ListJobsResponse:
        app = _app_of(ctx, self.st)
        jobs = [j for k, j in sorted(self.st.jobs.items(), reverse=True) if self.st.job_owner[k] == app]
        if req.states:
            jobs = [j for j in jobs if j.state in req.states]
        return jobs_pb2.ListJobsResponse(jobs=jobs)

    async def _pause(self, req: jobs_pb2.PauseJobRequest, ctx: Any) -> jobs_pb2.PauseJobResponse:
        job = self._get(_app_of(ctx, self.st), req.job_id)
        if job.state in (jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED):
            name = jobs_pb2.JobState.Name(job.state)
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, f"job {job.job_id} is {name}; cannot pause")
        self.add_event(job.job_id, jobs_pb2.JOB_STATE_PAUSED, job.progress.step, job.progress.total_steps, 0.0)
        return jobs_pb2.PauseJobResponse(job=job)

    async def _cancel(self, req: jobs_pb2.CancelJobRequest, ctx: Any) -> jobs_pb2.CancelJobResponse:
        job = self._get(_app_of(ctx, self.st), req.job_id)
        self.add_event(job.job_id, jobs_pb2.JOB_STATE_CANCELLED, job.progress.step, job.progress.total_steps, 0.0)
        return jobs_pb2.CancelJobResponse(job=job)

    async def _events(self, req: jobs_pb2.ListJobEventsRequest, ctx: Any) -> jobs_pb2.ListJobEventsResponse:
        self._get(_app_of(ctx, self.st), req.job_id)
        evs = [e for e in self.st.events[req.job_id] if e.event_id > req.after_event_id]
        size = req.page_size or 2
        return jobs_pb2.ListJobEventsResponse(events=evs[:size], has_more=len(evs) > size)

    async def WatchJob(self, req: jobs_pb2.WatchJobRequest, ctx: Any) -> Any:
        await _fault(self.st, "WatchJob", ctx)
        try:
            self._get(_app_of(ctx, self.st), req.job_id)
        except _Abort as a:
            await ctx.abort(a.code, a.msg)
        self.st.watch_after_ids.append(req.after_event_id)
        cut = self.st.watch_cut_after_events.pop(0) if self.st.watch_cut_after_events else -1
        sent, last = 0, req.after_event_id
        while True:
            for ev in [e for e in self.st.events[req.job_id] if e.event_id > last]:
                if sent == cut:
                    await ctx.abort(grpc.StatusCode.UNAVAILABLE, "injected stream break")
                yield jobs_pb2.WatchJobResponse(event=ev, job=self.st.jobs[req.job_id])
                sent, last = sent + 1, ev.event_id
            if self.st.jobs[req.job_id].state in (6, 7, 8):
                return
            await asyncio.sleep(0.01)


class Adapters(adapters_pb2_grpc.AdapterServiceServicer):
    def __init__(self, st: State) -> None:
        self.st = st

    async def DownloadAdapter(self, req: adapters_pb2.DownloadAdapterRequest, ctx: Any) -> Any:
        await _fault(self.st, "DownloadAdapter", ctx)
        try:
            _app_of(ctx, self.st)
        except _Abort as a:
            await ctx.abort(a.code, a.msg)
        if not req.adapter_id.startswith("ad_"):
            await ctx.abort(grpc.StatusCode.NOT_FOUND, f"adapter {req.adapter_id!r} not found")
        blob = self.st.adapter_blob
        if req.read_offset > len(blob):
            await ctx.abort(grpc.StatusCode.OUT_OF_RANGE, "read_offset beyond the file size")
        self.st.download_offsets.append(req.read_offset)
        sha = self.st.adapter_sha_override or hashlib.sha256(blob).hexdigest()
        cut = self.st.download_cut_after_chunks.pop(0) if self.st.download_cut_after_chunks else -1
        yield adapters_pb2.DownloadAdapterResponse(
            header=adapters_pb2.DownloadHeader(
                total_size_bytes=len(blob), sha256=sha, filename=f"{req.adapter_id}.peft.tar", format=req.format
            ),
            offset=req.read_offset,
        )
        for n, off in enumerate(range(req.read_offset, len(blob), CHUNK)):
            if n == cut:
                await ctx.abort(grpc.StatusCode.UNAVAILABLE, "injected stream break")
            if self.st.download_chunk_delay_s:
                await asyncio.sleep(self.st.download_chunk_delay_s)
            yield adapters_pb2.DownloadAdapterResponse(chunk=blob[off : off + CHUNK], offset=off)


class Inference(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, st: State) -> None:
        self.st = st

    async def Generate(self, req: inference_pb2.GenerateRequest, ctx: Any) -> Any:
        prompt = req.text if req.WhichOneof("prompt") == "text" else req.chat.messages[-1].content
        words = f"echo[{req.adapter_id or 'base'}]: {prompt}".split(" ")
        for i, w in enumerate(words):
            last = i == len(words) - 1
            yield inference_pb2.GenerateResponse(
                text=w + ("" if last else " "),
                token_count=i + 1,
                finish_reason=inference_pb2.FINISH_REASON_STOP if last else 0,
                prompt_token_count=len(prompt.split()) if i == 0 else 0,
            )


class Device(device_pb2_grpc.DeviceServiceServicer):
    def __init__(self, st: State) -> None:
        self.st = st

    async def _status(self, req: device_pb2.GetDeviceStatusRequest, ctx: Any) -> device_pb2.GetDeviceStatusResponse:
        app = _app_of(ctx, self.st)
        r = device_pb2.GetDeviceStatusResponse(can_train=self.st.can_train, version="fake")
        active = [
            j for k, j in sorted(self.st.jobs.items()) if self.st.job_owner[k] == app and j.state not in (6, 7, 8)
        ]
        if active:
            r.current_job_id, r.current_job_state = active[0].job_id, active[0].state
        r.backend.backend = common_pb2.BACKEND_TORCH
        r.backend.reason = "test double"
        r.readings.battery_percent, r.readings.charging, r.readings.source = 80, True, "fake"
        if not self.st.can_train:
            r.blocked_reasons.append(jobs_pb2.BLOCKED_REASON_TOO_HOT)
            r.blocked_detail = "temperature 45.0 °C > 40.0 °C"
        return r


_UNARY = {
    (Apps, "RegisterApp"): Apps._register,
    (Apps, "ListApps"): Apps._list,
    (Apps, "RevokeApp"): Apps._revoke,
    (Data, "AppendSamples"): Data._append,
    (Data, "ListDatasets"): Data._list,
    (Data, "GetDataset"): Data._get,
    (Data, "DeleteDataset"): Data._delete,
    (Jobs, "CreateJob"): Jobs._create,
    (Jobs, "GetJob"): Jobs._getjob,
    (Jobs, "ListJobs"): Jobs._list,
    (Jobs, "PauseJob"): Jobs._pause,
    (Jobs, "CancelJob"): Jobs._cancel,
    (Jobs, "ListJobEvents"): Jobs._events,
    (Device, "GetDeviceStatus"): Device._status,
}


class FakeDaemon:
    """Runs the test double on a Unix socket in a background thread with its own event loop."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.target = f"unix://{socket_path}"
        self.state = State()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.jobs: Jobs | None = None

    def start(self) -> FakeDaemon:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        self.server = grpc.aio.server()
        st = self.state
        classes: list[tuple[type, Any]] = [
            (Apps, apps_pb2_grpc.add_AppServiceServicer_to_server),
            (Data, data_pb2_grpc.add_DataServiceServicer_to_server),
            (Jobs, jobs_pb2_grpc.add_JobServiceServicer_to_server),
            (Adapters, adapters_pb2_grpc.add_AdapterServiceServicer_to_server),
            (Inference, inference_pb2_grpc.add_InferenceServiceServicer_to_server),
            (Device, device_pb2_grpc.add_DeviceServiceServicer_to_server),
        ]
        for cls, add in classes:
            methods = {name: _wrap(st, name, fn) for (c, name), fn in _UNARY.items() if c is cls}
            servicer = type(f"Fake{cls.__name__}", (cls,), methods)(st)
            if cls is Jobs:
                self.jobs = servicer
            add(servicer, self.server)
        self.server.add_insecure_port(self.target)
        await self.server.start()

    def call(self, fn: Any, *args: Any) -> Any:
        """Runs fn(*args) on the server loop (to mutate state race-free)."""

        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def app_token(self, app_id: str) -> str:
        """Registers app_id directly in state and returns its token."""

        def reg() -> str:
            self.state.apps[app_id] = apps_pb2.App(app_id=app_id, display_name=app_id)
            self.state.tokens[f"tok-{app_id}"] = app_id
            return f"tok-{app_id}"

        return self.call(reg)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
