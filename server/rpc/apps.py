"""AppService (owner only): register, list, revoke apps and rotate their tokens."""
# ruff: noqa: N802  (servicer method names are fixed by the generated gRPC base classes)

from __future__ import annotations

import asyncio
from typing import Any

from grpc import aio

from lorad.server import validation as v
from lorad.server.errors import InvalidArgument
from lorad.server.rpc import convert as cv
from lorad.server.rpc.interceptor import principal
from lorad.server.services import Services
from lorad.v1 import apps_pb2, apps_pb2_grpc


class AppServicer(apps_pb2_grpc.AppServiceServicer):
    """Registers, lists and revokes apps."""

    def __init__(self, s: Services) -> None:
        self.s = s

    async def RegisterApp(self, request: apps_pb2.RegisterAppRequest, context: aio.ServicerContext) -> Any:
        principal().require_owner()
        app_id = v.check_id("app_id", request.app_id)
        name = request.display_name or app_id
        if len(name.encode()) > 128:
            raise InvalidArgument("display_name", "too long (at most 128 bytes)")
        for f in ("max_samples", "max_sample_bytes"):
            v.check_int64(f"quota.{f}", getattr(request.quota, f))
        quota = cv.quota_from_pb(request.quota, self.s.cfg)
        app, token = await asyncio.to_thread(self.s.registry.register, app_id, name, quota)
        return apps_pb2.RegisterAppResponse(app=cv.app_pb(app), token=token)

    async def ListApps(self, request: apps_pb2.ListAppsRequest, context: aio.ServicerContext) -> Any:
        principal().require_owner()
        apps, nxt = await asyncio.to_thread(self.s.registry.list_page, request.page_size, request.page_token)
        return apps_pb2.ListAppsResponse(apps=[cv.app_pb(a) for a in apps], next_page_token=nxt)

    async def RevokeApp(self, request: apps_pb2.RevokeAppRequest, context: aio.ServicerContext) -> Any:
        principal().require_owner()
        app_id = v.check_id("app_id", request.app_id)
        await asyncio.to_thread(self.s.registry.revoke, app_id)
        self.s.streams.end_app(app_id)  # after the commit: a stream's next write is refused by the store anyway
        return apps_pb2.RevokeAppResponse()

    async def RotateAppToken(self, request: apps_pb2.RotateAppTokenRequest, context: aio.ServicerContext) -> Any:
        principal().require_owner()
        app_id = v.check_id("app_id", request.app_id)
        token = await asyncio.to_thread(self.s.registry.rotate, app_id)
        self.s.streams.end_app(app_id)  # streams opened with the old token end with it
        return apps_pb2.RotateAppTokenResponse(token=token)
