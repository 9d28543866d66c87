"""dsec errors as E2B answers them: HTTP statuses with E2B's body, and Connect codes.

The control API answers ``{"code": <status>, "message": ...}`` with the status the SDK maps
to its exception classes (404 -> SandboxNotFoundException where it asks, 401 ->
AuthenticationException, 429 -> RateLimitException, ...). envd answers Connect codes; a
sandbox that is gone is what E2B's proxy says then: UNAVAILABLE (HTTP 502 outside a
stream) with "... was not found", which the SDK turns into SandboxNotRunningException.
"""

from __future__ import annotations

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from libdsec import errors as e

#: Checked in order: the first class that matches wins (subclasses before their bases).
_HTTP: list[tuple[type[e.DSecError], int]] = [
    (e.InvalidArgument, 400),
    (e.Unauthenticated, 401),
    (e.PermissionDenied, 403),
    (e.NotFound, 404),
    (e.AlreadyExists, 409),
    (e.FailedPrecondition, 409),
    (e.QuotaExceeded, 429),
    (e.ResourceExhausted, 503),
    (e.Unimplemented, 501),
    (e.Unavailable, 503),
    (e.DeadlineExceeded, 504),
    (e.Cancelled, 499),
]

_CONNECT: list[tuple[type[e.DSecError], Code]] = [
    (e.InvalidArgument, Code.INVALID_ARGUMENT),
    (e.Unauthenticated, Code.UNAUTHENTICATED),
    (e.PermissionDenied, Code.PERMISSION_DENIED),
    (e.NotFound, Code.NOT_FOUND),
    (e.AlreadyExists, Code.ALREADY_EXISTS),
    (e.FailedPrecondition, Code.FAILED_PRECONDITION),
    (e.ResourceExhausted, Code.RESOURCE_EXHAUSTED),
    (e.Unimplemented, Code.UNIMPLEMENTED),
    (e.Unavailable, Code.UNAVAILABLE),
    (e.DeadlineExceeded, Code.DEADLINE_EXCEEDED),
    (e.Cancelled, Code.CANCELED),
]


def http_status(exc: e.DSecError) -> int:
    for cls, status in _HTTP:
        if isinstance(exc, cls):
            return status
    return 500


def sandbox_gone(exc: BaseException) -> bool:
    """The sandbox does not exist (for this caller) or has ended: E2B's proxy says 502."""
    return isinstance(exc, e.SandboxNotFound | e.SandboxTerminated)


def gone_message(sandbox_id: str) -> str:
    # "was not found" is what the SDK looks for (e2b.exceptions.SANDBOX_NOT_FOUND_MESSAGE).
    return f"The sandbox {sandbox_id} was not found"


def connect_error(exc: e.DSecError, sandbox_id: str = "") -> ConnectError:
    if sandbox_gone(exc):
        return ConnectError(Code.UNAVAILABLE, gone_message(sandbox_id))
    for cls, code in _CONNECT:
        if isinstance(exc, cls):
            return ConnectError(code, exc.message)
    return ConnectError(Code.INTERNAL, exc.message)
