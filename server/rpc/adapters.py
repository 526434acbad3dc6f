"""AdapterService: the calling app's adapters (list, get, download, import, delete)."""
# ruff: noqa: N802  (servicer method names are fixed by the generated gRPC base classes)

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from lorad.server import validation as v
from lorad.server.errors import InvalidArgument
from lorad.server.exports import CHUNK
from lorad.server.forget import delete_adapter
from lorad.server.rpc import convert as cv
from lorad.server.rpc.interceptor import principal
from lorad.server.services import Services
from lorad.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
)


class AdapterServicer(adapters_pb2_grpc.AdapterServiceServicer):
    """The calling app's adapters."""

    def __init__(self, s: Services, remove_window: Any = None) -> None:
        self.s = s
        self.remove_window = remove_window

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
        freed = await asyncio.to_thread(
            delete_adapter,
            self.s,
            app_id,
            aid,
            cancel_dependents=request.cancel_dependents,
            remove_window=self.remove_window,
        )
        return adapters_pb2.DeleteAdapterResponse(freed_bytes=freed)
