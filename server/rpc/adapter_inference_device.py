"""AdapterService, InferenceService and DeviceService servicers."""
# ruff: noqa: N802  (servicer method names are fixed by the generated gRPC base classes)

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import threading
from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from lorad.server import disk
from lorad.server import validation as v
from lorad.server.domain import JobState, Message
from lorad.server.downloads import CHUNK
from lorad.server.errors import InvalidArgument
from lorad.server.generation import (
    GenerationQueue,
    Generator,
    GenRequest,
    check_generate,
    check_repetition_penalty,
)
from lorad.server.jobs.files import tree_size
from lorad.server.rpc import convert as cv
from lorad.server.rpc.interceptor import principal
from lorad.server.services import Services
from lorad.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    common_pb2,
    device_pb2,
    device_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    jobs_pb2,
)

FINISH: dict[str, Any] = {
    "stop": inference_pb2.FINISH_REASON_STOP,
    "length": inference_pb2.FINISH_REASON_LENGTH,
    "context": inference_pb2.FINISH_REASON_CONTEXT,
}


class AdapterServicer(adapters_pb2_grpc.AdapterServiceServicer):
    """The calling app's adapters."""

    def __init__(self, s: Services) -> None:
        self.s = s

    async def ListAdapters(self, request: adapters_pb2.ListAdaptersRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        recs, nxt = await asyncio.to_thread(self.s.library.list_page, app_id, request.page_size, request.page_token)
        return adapters_pb2.ListAdaptersResponse(adapters=[cv.adapter_pb(r) for r in recs], next_page_token=nxt)

    async def GetAdapter(self, request: adapters_pb2.GetAdapterRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        rec = await asyncio.to_thread(self.s.library.get, app_id, v.check_server_id("adapter_id", request.adapter_id))
        return adapters_pb2.GetAdapterResponse(adapter=cv.adapter_pb(rec))

    async def DownloadAdapter(
        self, request: adapters_pb2.DownloadAdapterRequest, context: aio.ServicerContext
    ) -> AsyncIterator[adapters_pb2.DownloadAdapterResponse]:
        app_id = principal().require_app()
        rec = await asyncio.to_thread(self.s.library.get, app_id, v.check_server_id("adapter_id", request.adapter_id))
        fmt = cv.FORMAT_NAMES.get(request.format)
        if fmt is None:
            raise InvalidArgument("format", f"{request.format} unknown; ADAPTER_FORMAT_PEFT, _GGUF or _MERGED")
        f, size, sha, name = await asyncio.to_thread(self.s.library.export, rec, fmt)
        with f:
            if request.read_offset > size:
                raise InvalidArgument("read_offset", f"{request.read_offset} is past the end of the file ({size} B)")
            header = adapters_pb2.DownloadHeader(
                total_size_bytes=size, sha256=sha, filename=name, format=cv.FORMAT_ENUMS[fmt]
            )
            yield adapters_pb2.DownloadAdapterResponse(header=header, offset=request.read_offset)
            offset = request.read_offset
            f.seek(offset)
            while chunk := await asyncio.to_thread(f.read, CHUNK):
                yield adapters_pb2.DownloadAdapterResponse(chunk=chunk, offset=offset)
                offset += len(chunk)

    async def ImportAdapter(
        self, request_iterator: AsyncIterator[adapters_pb2.ImportAdapterRequest], context: aio.ServicerContext
    ) -> Any:
        from lorad.server.adapter_import import Upload, check_header, store_import

        app_id = principal().require_app()
        up: Upload | None = None
        try:
            async for msg in request_iterator:
                which = msg.WhichOneof("payload")
                if up is None:
                    if which != "header":
                        raise InvalidArgument("header", "the first message must carry the header")
                    h = msg.header
                    hdr = check_header(h.base_model, h.base_model_sha256, h.total_size_bytes, h.sha256, self.s)
                    up = await asyncio.to_thread(Upload, self.s, app_id, hdr)
                elif which == "chunk":
                    await asyncio.to_thread(up.write, msg.chunk)
                else:
                    raise InvalidArgument("header", "only the first message may carry a header")
            if up is None:
                raise InvalidArgument("header", "no messages received; send the header, then the chunks")
            await asyncio.to_thread(up.finish)
            rec = await asyncio.to_thread(store_import, self.s, app_id, up)
        finally:
            if up is not None:
                up.discard()
        return adapters_pb2.ImportAdapterResponse(adapter=cv.adapter_pb(rec))

    async def DeleteAdapter(self, request: adapters_pb2.DeleteAdapterRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        aid = v.check_server_id("adapter_id", request.adapter_id)
        freed = await asyncio.to_thread(self.s.library.delete, app_id, aid)
        return adapters_pb2.DeleteAdapterResponse(freed_bytes=freed)


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """Streams generated text."""

    def __init__(self, s: Services) -> None:
        self.s = s
        self.gen = Generator(s.models)
        self.queue = GenerationQueue()
        s.on_forget.append(self.gen.drop_app)

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        app_id = principal().require_app()
        which = request.WhichOneof("prompt")
        text = messages = None
        if which == "text":
            if not request.text or len(request.text.encode()) > 65_536:
                raise InvalidArgument("text", "must be 1 to 65,536 bytes of UTF-8")
            text = request.text
        elif which == "chat":
            body = cv.sample_from_pb(common_pb2.Sample(chat=request.chat))
            v.validate_samples([body], field="chat")
            messages = tuple(Message(m.role, m.content) for m in body.messages or ()) if body else ()
        else:
            raise InvalidArgument("prompt", "exactly one of text or chat must be set")
        n, temp, top_p = check_generate(request.max_tokens, request.temperature, request.top_p, list(request.stop))
        if request.base_model:
            self.s.models.entry(request.base_model, field="base_model")
        rec = None
        if request.adapter_id:
            rec = await asyncio.to_thread(self.s.library.get, app_id, request.adapter_id)
        if len(request.extra_adapter_ids) > 8:
            raise InvalidArgument("extra_adapter_ids", f"{len(request.extra_adapter_ids)} given; at most 8")
        extra = [
            await asyncio.to_thread(self.s.library.get, app_id, v.check_server_id(f"extra_adapter_ids[{i}]", a))
            for i, a in enumerate(request.extra_adapter_ids)
        ]
        penalty = check_repetition_penalty(request.repetition_penalty)
        req = GenRequest(text, messages, n, temp, top_p, request.seed, tuple(request.stop), request.base_model, penalty)
        async with self.queue.admit(app_id):
            async for piece in self._generate(req, rec, extra):
                yield piece

    async def _generate(
        self, req: GenRequest, rec: Any, extra: list[Any]
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stop = threading.Event()

        def produce() -> None:
            try:
                for piece in self.gen.stream(req, rec, stop.is_set, extra):
                    loop.call_soon_threadsafe(queue.put_nowait, piece)
                loop.call_soon_threadsafe(queue.put_nowait, None)
            except BaseException as exc:  # handed to the RPC task, which maps it
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(queue.put_nowait, exc)

        worker = loop.run_in_executor(self.queue.pool, produce)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield inference_pb2.GenerateResponse(
                    text=item.text,
                    token_count=item.token_count,
                    finish_reason=FINISH.get(item.finish, 0),
                    prompt_token_count=item.prompt_tokens,
                )
        finally:
            stop.set()
            if not worker.cancel():  # not started yet: dropped; running: ends at its next token
                with contextlib.suppress(BaseException):
                    await worker


class DeviceServicer(device_pb2_grpc.DeviceServiceServicer):
    """Backend, readings and what the caller's job waits for."""

    def __init__(self, s: Services) -> None:
        self.s = s

    def _status(self, app_id: str | None) -> device_pb2.GetDeviceStatusResponse:
        from lorad.kernels import detect_backend

        info = detect_backend(self.s.cfg.training.backend)
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
            if facts is not None:
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
            out.apps.append(device_pb2.AppDiskUsage(
                app_id=u.app_id, data_bytes=u.data_bytes, checkpoint_bytes=u.checkpoint_bytes,
                adapter_bytes=u.adapter_bytes, export_bytes=u.export_bytes,
            ))  # fmt: skip
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
        return device_pb2.CollectGarbageResponse(freed_bytes=c.freed_bytes, removed_files=c.removed_files,
                                                 caches_kept_reason=c.caches_kept_reason)  # fmt: skip


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lorad")
    except PackageNotFoundError:
        return "0+unknown"


__all__ = ["AdapterServicer", "DeviceServicer", "InferenceServicer", "jobs_pb2"]
