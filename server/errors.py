"""Typed domain errors; rpc/errors.py maps each to one gRPC status code."""
# ruff: noqa: N818  (names mirror the gRPC status codes they map to)

from __future__ import annotations


class LoradError(Exception):
    """Base of all domain errors; the message is safe to show the caller (never contains sample text)."""


class InvalidArgument(LoradError):
    """A request field is invalid; ``field`` is its path, e.g. ``samples[3].chat.messages[1].role``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFound(LoradError):
    """Absent, or not the caller's (the two are indistinguishable by design)."""

    def __init__(self, kind: str, ident: str) -> None:
        super().__init__(f"{kind} {ident!r} not found")


class AlreadyExists(LoradError):
    """An id is taken, or a request_id was reused with a different payload."""


class FailedPrecondition(LoradError):
    """The operation is illegal in the resource's current state (the message names it)."""


class Aborted(LoradError):
    """A concurrent operation on the same data conflicts (e.g. a deletion of it is running); retry once it ends."""


class ResourceExhausted(LoradError):
    """A quota or the disk is full."""


class PermissionDenied(LoradError):
    """The caller is authenticated but may not call this method (e.g. an app calling an owner-only RPC)."""


class Unauthenticated(LoradError):
    """No valid token."""


class Internal(LoradError):
    """A daemon bug; the message carries no exception text or path (the log has the traceback)."""


class Unavailable(LoradError):
    """The daemon is shutting down or a dependency cannot be reached; retrying later may succeed."""
