"""Every lorad.v1 RPC as a bytes-level callable (identity serializers), so tests can send any wire bytes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from lorad.v1 import adapters_pb2, apps_pb2, data_pb2, device_pb2, inference_pb2, jobs_pb2

MODULES = (apps_pb2, data_pb2, jobs_pb2, adapters_pb2, inference_pb2, device_pb2)
# Status codes the API documents (common.proto); anything else (INTERNAL, UNKNOWN, ...) is a violation.
DOCUMENTED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.ABORTED,
}  # fmt: skip


@dataclass(frozen=True)
class Rpc:
    """One method: full path, request/response descriptors and its streaming shape."""

    path: str
    name: str
    request: type
    response: type
    client_streaming: bool
    server_streaming: bool


def all_rpcs() -> list[Rpc]:
    from google.protobuf import message_factory

    out = []
    for mod in MODULES:
        for svc in mod.DESCRIPTOR.services_by_name.values():
            for m in svc.methods:
                out.append(Rpc(f"/{svc.full_name}/{m.name}", m.name,
                               message_factory.GetMessageClass(m.input_type),
                               message_factory.GetMessageClass(m.output_type),
                               m.client_streaming, m.server_streaming))  # fmt: skip
    return out


def call_raw(
    channel: grpc.Channel, rpc: Rpc, payloads: Iterable[bytes] | bytes, md: tuple = (), timeout: float = 10.0
) -> tuple[grpc.StatusCode, str, list[bytes]]:
    """Sends raw request bytes (a list for client streams); returns (code, details, raw responses)."""
    try:
        if rpc.client_streaming:
            items = [payloads] if isinstance(payloads, bytes) else list(payloads)
            if rpc.server_streaming:
                fn = channel.stream_stream(rpc.path)
                out = list(fn(iter(items), metadata=md, timeout=timeout))
            else:
                out = [channel.stream_unary(rpc.path)(iter(items), metadata=md, timeout=timeout)]
        else:
            assert isinstance(payloads, bytes)
            if rpc.server_streaming:
                out = list(channel.unary_stream(rpc.path)(payloads, metadata=md, timeout=timeout))
            else:
                out = [channel.unary_unary(rpc.path)(payloads, metadata=md, timeout=timeout)]
    except grpc.RpcError as e:
        return e.code(), e.details() or "", []
    return grpc.StatusCode.OK, "", out
