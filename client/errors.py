"""Typed SDK exceptions and the one table mapping gRPC status codes onto them (with CLI exit codes)."""

# The class names mirror gRPC status codes (NotFound, InvalidArgument, ...) as the API documents them.
# ruff: noqa: N818

from __future__ import annotations

import grpc

#: Trailing-metadata key in which the daemon names the bad field of an INVALID_ARGUMENT error.
ERROR_FIELD_KEY = "lorad-error-field"


class LoradError(Exception):
    """Base of every error the SDK raises.

    Attributes:
        message: What went wrong (and, from the daemon, how to fix it).
        code: The gRPC status code name, e.g. "NOT_FOUND"; "CLIENT" for errors raised before any call.
        exit_code: Exit status the `lorad` CLI uses for this error.
    """

    exit_code = 1

    def __init__(self, message: str, *, code: str = "CLIENT", field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.field = field

    def __str__(self) -> str:
        return self.message


class NotFound(LoradError):
    """The resource does not exist (or belongs to another app)."""

    exit_code = 3


class InvalidArgument(LoradError):
    """A request field is invalid; `.field` names it (e.g. `samples[3].chat.messages[1].role`)."""

    exit_code = 4


class AlreadyExists(LoradError):
    """The id is taken, or a request_id was reused with a different payload."""

    exit_code = 7


class FailedPrecondition(LoradError):
    """The operation is illegal in the resource's current state (the message names it)."""

    exit_code = 7


class Aborted(LoradError):
    """The operation was aborted by a concurrent change; retry it."""

    exit_code = 7


class ResourceExhausted(LoradError):
    """A quota or the disk is full."""

    exit_code = 8


class Unauthenticated(LoradError):
    """No valid token was sent."""

    exit_code = 5


class PermissionDenied(LoradError):
    """The token is valid but not allowed to do this (e.g. an app token on an owner-only call)."""

    exit_code = 5


class Unavailable(LoradError):
    """The daemon cannot be reached (not running, wrong socket, or restarting)."""

    exit_code = 6


class DeadlineExceeded(LoradError):
    """The call did not finish within its deadline."""

    exit_code = 6


class Cancelled(LoradError):
    """The call was cancelled."""

    exit_code = 1


class Unimplemented(LoradError):
    """The daemon does not implement this call (an older daemon)."""

    exit_code = 1


class InternalError(LoradError):
    """The daemon failed unexpectedly (INTERNAL, UNKNOWN, DATA_LOSS and other codes)."""

    exit_code = 1


class ConfigurationError(LoradError):
    """The client is not configured to make the call (e.g. no token); the message says where to set it."""

    exit_code = 5


class IntegrityError(LoradError):
    """A download's size or sha256 does not match what the daemon announced."""

    exit_code = 1


#: The one mapping of status codes onto exceptions. Codes not listed map to InternalError.
STATUS_TO_ERROR: dict[grpc.StatusCode, type[LoradError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
}


def _trailing_field(err: grpc.RpcError) -> str:
    trailing = getattr(err, "trailing_metadata", None)
    pairs = trailing() if callable(trailing) else None
    for key, value in pairs or ():
        if key == ERROR_FIELD_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


def from_rpc_error(err: grpc.RpcError, *, target: str = "") -> LoradError:
    """Converts a gRPC error (sync or aio) into the matching typed exception.

    Args:
        err: The error raised by a stub call.
        target: The daemon address, named in "cannot reach the daemon" messages.

    Returns:
        The typed exception, ready to raise.
    """
    code_fn = getattr(err, "code", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details_fn = getattr(err, "details", None)
    details = (details_fn() if callable(details_fn) else None) or str(err)
    cls = STATUS_TO_ERROR.get(code, InternalError)
    if cls is Unavailable:
        where = f" at {target}" if target else ""
        details = (
            f"cannot reach the lorad daemon{where}: {details}. Start it with `lorad serve`, or point the client "
            "at the right socket with --target / LORAD_TARGET"
        )
    return cls(details, code=code.name, field=_trailing_field(err))
