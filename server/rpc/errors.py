"""The one table mapping domain errors to gRPC status codes."""

from __future__ import annotations

import grpc

from lorad.server import errors as e

# Checked in order; the first matching class wins.
STATUS: tuple[tuple[type[e.LoradError], grpc.StatusCode], ...] = (
    (e.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (e.NotFound, grpc.StatusCode.NOT_FOUND),
    (e.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (e.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (e.Aborted, grpc.StatusCode.ABORTED),
    (e.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (e.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (e.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (e.Internal, grpc.StatusCode.INTERNAL),
)

FIELD_METADATA_KEY = "lorad-error-field"


def status_for(exc: e.LoradError) -> grpc.StatusCode:
    """The status code of a domain error (INTERNAL for an unmapped subclass)."""
    for cls, code in STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def trailing_metadata(exc: e.LoradError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata for an error: the bad field's path for INVALID_ARGUMENT."""
    if isinstance(exc, e.InvalidArgument):
        return ((FIELD_METADATA_KEY, exc.field),)
    return ()
