"""Authenticates every call, binds the caller to the handler, and turns domain errors into statuses (one place)."""

from __future__ import annotations

import asyncio
import contextvars
import errno
import secrets
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from grpc import aio

from lorad.server.auth import Authenticator, Principal
from lorad.server.errors import (
    Internal,
    InvalidArgument,
    LoradError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from lorad.server.rpc.errors import status_for, trailing_metadata
from lorad.server.rpc.streams import OpenStreams
from lorad.server.rpc.wire import TooMany, Undecodable, bad_utf8_path, lenient

log = structlog.get_logger(__name__)

PRINCIPAL: contextvars.ContextVar[Principal] = contextvars.ContextVar("lorad_principal")
# Standard services answered without a token (health probes from service managers, reflection for grpcurl).
PUBLIC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def principal() -> Principal:
    """The authenticated caller of the current RPC."""
    return PRINCIPAL.get()


def _auth_header(context: aio.ServicerContext) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == "authorization":
            return v if isinstance(v, str) else v.decode()
    return None


async def _fail(context: aio.ServicerContext, method: str, exc: LoradError) -> None:
    code = status_for(exc)
    log.info("rpc_error", method=method, code=code.name, error=str(exc)[:200])
    context.set_trailing_metadata(trailing_metadata(exc))
    await context.abort(code, str(exc))


class AuthInterceptor(aio.ServerInterceptor):
    """Wraps each handler: token → Principal (UNAUTHENTICATED otherwise), domain error → status code."""

    def __init__(self, auth: Authenticator, serving: Callable[[], bool], streams: OpenStreams | None = None) -> None:
        self.auth = auth
        self.serving = serving
        self.streams = streams or OpenStreams()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(PUBLIC_PREFIXES):
            return handler
        return _wrap(handler, method, self)

    def begin(self, context: aio.ServicerContext, method: str) -> Principal:
        """Authenticates and binds the caller to the current context for one call (raises a LoradError).

        Nothing is reset afterwards, on purpose: grpc.aio runs every RPC in its own task, whose context is a copy,
        so the binding ends with the call. Resetting a token is also wrong for streams: a generator the client
        abandoned is closed later by asyncio's finaliser in another task and context, where reset() raises.
        """
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=secrets.token_hex(4), method=method.rsplit("/", 1)[-1])
        if not self.serving():
            raise Unavailable("lorad is shutting down; retry after it restarts")
        p = self.auth.authenticate(_auth_header(context))
        structlog.contextvars.bind_contextvars(app_id=p.app_id or "owner")
        PRINCIPAL.set(p)
        return p


def _environment_error(exc: Exception) -> LoradError:
    """A full disk (ENOSPC, SQLITE_FULL) is RESOURCE_EXHAUSTED; anything else is INTERNAL without its text/paths."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return ResourceExhausted("no space left on the device; free some space and retry")
    if isinstance(exc, sqlite3.OperationalError) and "full" in str(exc):
        return ResourceExhausted("the database cannot grow: no space left on the device; free some space and retry")
    log.error("rpc_internal_error", error_type=type(exc).__name__, exc_info=exc)
    return Internal(f"internal error ({type(exc).__name__}); the device owner finds the details in the daemon log")


def _checked(request: Any) -> Any:
    """The request, or InvalidArgument naming the field that is not UTF-8."""
    if isinstance(request, TooMany):
        raise InvalidArgument(request.field, f"too many: more than {request.limit:,} per call; split the batch")
    if isinstance(request, Undecodable):
        path = bad_utf8_path(request.raw, request.descriptor)
        if path:
            raise InvalidArgument(path, "not valid UTF-8")
        raise InvalidArgument("request", "malformed protobuf message")
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for r in requests:
        yield _checked(r)


REVOKED = "the app's token was revoked or replaced; this stream ended (nothing after it was stored)"


def _track(ic: AuthInterceptor, p: Principal) -> asyncio.Task | None:
    """Registers the current streaming call of an app so revocation can end it."""
    task = asyncio.current_task()
    if task is not None and p.app_id:
        ic.streams.add(p.app_id, task)
    return task


def _ended_by_revocation(ic: AuthInterceptor, task: asyncio.Task | None) -> bool:
    if task is not None and ic.streams.was_ended(task):
        task.uncancel()  # the call continues just long enough to answer UNAUTHENTICATED
        return True
    return False


def _wrap(h: grpc.RpcMethodHandler, method: str, ic: AuthInterceptor) -> grpc.RpcMethodHandler:
    deser = h.request_deserializer
    desc = getattr(getattr(deser, "__self__", None), "DESCRIPTOR", None)
    deser = lenient(deser, desc)
    streaming_in = h.request_streaming
    if h.unary_unary or h.stream_unary:
        inner = h.unary_unary or h.stream_unary

        async def unary(request: Any, context: aio.ServicerContext) -> Any:
            try:
                p = ic.begin(context, method)
            except LoradError as exc:
                await _fail(context, method, exc)
            task = _track(ic, p) if streaming_in else None
            try:
                request = _checked_stream(request) if streaming_in else _checked(request)
                return await inner(request, context)
            except asyncio.CancelledError:
                if not _ended_by_revocation(ic, task):
                    raise
                await _fail(context, method, Unauthenticated(REVOKED))
            except LoradError as exc:
                await _fail(context, method, exc)
            except aio.AbortError:
                raise
            except Exception as exc:
                await _fail(context, method, _environment_error(exc))
            finally:
                if task is not None and p.app_id:
                    ic.streams.remove(p.app_id, task)

        make = grpc.unary_unary_rpc_method_handler if h.unary_unary else grpc.stream_unary_rpc_method_handler
        return make(unary, request_deserializer=deser, response_serializer=h.response_serializer)

    inner_s = h.unary_stream or h.stream_stream

    async def streaming(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            p = ic.begin(context, method)
        except LoradError as exc:
            await _fail(context, method, exc)
        task = _track(ic, p)
        try:
            request = _checked_stream(request) if streaming_in else _checked(request)
            async for item in inner_s(request, context):
                yield item
        except asyncio.CancelledError:
            if not _ended_by_revocation(ic, task):
                raise
            await _fail(context, method, Unauthenticated(REVOKED))
        except LoradError as exc:
            await _fail(context, method, exc)
        except aio.AbortError:
            raise
        except Exception as exc:
            await _fail(context, method, _environment_error(exc))
        finally:
            if task is not None and p.app_id:
                ic.streams.remove(p.app_id, task)

    make_s = grpc.unary_stream_rpc_method_handler if h.unary_stream else grpc.stream_stream_rpc_method_handler
    return make_s(streaming, request_deserializer=deser, response_serializer=h.response_serializer)


__all__ = ["AuthInterceptor", "Unauthenticated", "principal"]
