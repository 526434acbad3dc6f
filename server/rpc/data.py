"""DataService (app scoped): an app's samples and datasets, and forgetting an app."""
# ruff: noqa: N802  (servicer method names are fixed by the generated gRPC base classes)

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from lorad.server import validation as v
from lorad.server.errors import InvalidArgument, PermissionDenied
from lorad.server.forget import delete_dataset, forget_app
from lorad.server.rpc import convert as cv
from lorad.server.rpc.interceptor import principal
from lorad.server.services import Services
from lorad.v1 import data_pb2, data_pb2_grpc


class DataServicer(data_pb2_grpc.DataServiceServicer):
    """Stores, lists and deletes an app's samples."""

    def __init__(self, s: Services, remove_window: Any = None) -> None:
        self.s = s
        self.remove_window = remove_window

    def _append(self, app_id: str, dataset_id: str, samples: Any) -> Any:
        v.check_batch_size(len(samples))  # before any conversion: 10^6 tiny samples must cost nothing
        bodies = [cv.sample_from_pb(x) for x in samples]
        v.validate_samples(bodies)
        return self.s.data.append(app_id, dataset_id, [b for b in bodies if b is not None])  # validated: none is None

    async def AppendSamples(self, request: data_pb2.AppendSamplesRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        ds = v.check_id("dataset_id", request.dataset_id)
        r = await asyncio.to_thread(self._append, app_id, ds, request.samples)
        return data_pb2.AppendSamplesResponse(
            accepted_count=r.accepted,
            duplicate_count=r.duplicates,
            sample_ids=r.sample_ids,
            dataset=cv.dataset_pb(r.dataset),
        )

    async def StreamSamples(
        self, request_iterator: AsyncIterator[data_pb2.StreamSamplesRequest], context: aio.ServicerContext
    ) -> Any:
        app_id = principal().require_app()
        ds = ""
        accepted = dups = 0
        dataset = None
        async for msg in request_iterator:
            if not ds:
                ds = v.check_id("dataset_id", msg.dataset_id)
            elif msg.dataset_id and msg.dataset_id != ds:
                raise InvalidArgument("dataset_id", f"changed mid-stream from {ds!r}; one stream feeds one dataset")
            r = await asyncio.to_thread(self._append, app_id, ds, msg.samples)
            accepted, dups, dataset = accepted + r.accepted, dups + r.duplicates, r.dataset
        if dataset is None:
            raise InvalidArgument("dataset_id", "empty stream; send at least one message with samples")
        return data_pb2.StreamSamplesResponse(
            accepted_count=accepted, duplicate_count=dups, dataset=cv.dataset_pb(dataset)
        )

    async def ListDatasets(self, request: data_pb2.ListDatasetsRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        page, nxt = await asyncio.to_thread(self.s.data.list_datasets, app_id, request.page_size, request.page_token)
        return data_pb2.ListDatasetsResponse(datasets=[cv.dataset_pb(d) for d in page], next_page_token=nxt)

    async def GetDataset(self, request: data_pb2.GetDatasetRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        d = await asyncio.to_thread(self.s.data.get_dataset, app_id, v.check_id("dataset_id", request.dataset_id))
        return data_pb2.GetDatasetResponse(dataset=cv.dataset_pb(d))

    async def ListSamples(self, request: data_pb2.ListSamplesRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        ds = v.check_id("dataset_id", request.dataset_id)
        page, nxt = await asyncio.to_thread(self.s.data.list_samples, app_id, ds, request.page_size, request.page_token)
        return data_pb2.ListSamplesResponse(samples=[cv.stored_sample_pb(x) for x in page], next_page_token=nxt)

    async def DeleteDataset(self, request: data_pb2.DeleteDatasetRequest, context: aio.ServicerContext) -> Any:
        app_id = principal().require_app()
        ds = v.check_id("dataset_id", request.dataset_id)
        r = await asyncio.to_thread(
            delete_dataset,
            self.s,
            app_id,
            ds,
            cancel_dependents=request.cancel_dependents,
            remove_window=self.remove_window,
            delete_adapters=request.delete_adapters,
        )
        return data_pb2.DeleteDatasetResponse(deleted_samples=r.deleted_samples, deleted_adapters=r.deleted_adapters)

    async def ForgetApp(self, request: data_pb2.ForgetAppRequest, context: aio.ServicerContext) -> Any:
        p = principal()
        if p.is_owner:
            target = v.check_id("app_id", request.app_id)
        else:
            target = p.require_app()
            if request.app_id and request.app_id != target:
                raise PermissionDenied("an app may only forget itself; leave app_id empty or name your own app")
        r = await asyncio.to_thread(forget_app, self.s, target, self.remove_window)
        return data_pb2.ForgetAppResponse(
            deleted_samples=r.deleted_samples,
            deleted_adapters=r.deleted_adapters,
            deleted_jobs=r.deleted_jobs,
            freed_bytes=r.freed_bytes,
        )
