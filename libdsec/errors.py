"""The one error vocabulary of dsec, shared by the services and the SDK.

Every class binds one gRPC status code (what the caller should do) and a
stable machine-readable ``reason`` (what happened). Servers raise these; the
boundary maps them to a status plus a ``dsec.types.v1.ErrorInfo`` trailer
(``dsec-error-bin``); the SDK maps the status back to the most specific class.
Nobody branches on message text.

    try:
        sandbox.run("make test")
    except libdsec.errors.SandboxTerminated as exc:
        print("trajectory failed:", exc.reason, exc.metadata)

Tree::

    DSecError
    ├── InvalidArgument           INVALID_ARGUMENT     fix the request
    ├── NotFound                  NOT_FOUND
    │   ├── SandboxNotFound
    │   ├── ImageNotFound
    │   ├── LayerNotFound
    │   └── PathNotFound
    ├── AlreadyExists             ALREADY_EXISTS
    ├── FailedPrecondition        FAILED_PRECONDITION  wrong lifecycle state
    │   ├── SandboxTerminated
    │   └── LayerCorrupt
    ├── ResourceExhausted         RESOURCE_EXHAUSTED   quota/capacity: retry later
    │   ├── QuotaExceeded
    │   ├── NoEligibleEdge
    │   └── EdgeCapacity
    │       └── NodeDiskLow       the edge's disk is below its free-space reserve
    ├── Unavailable               UNAVAILABLE          transient: retry
    │   └── ChannelClosed
    ├── Unauthenticated           UNAUTHENTICATED      bad or missing token
    ├── PermissionDenied          PERMISSION_DENIED
    ├── DeadlineExceeded          DEADLINE_EXCEEDED
    ├── Cancelled                 CANCELLED
    ├── Unimplemented             UNIMPLEMENTED        not in this version/backend
    │   └── BackendCapabilityMissing   the sandbox's backend lacks the capability
    └── Internal                  INTERNAL             a dsec bug
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import grpc

__all__ = [
    "AlreadyExists",
    "BackendCapabilityMissing",
    "BackendNotOffered",
    "Cancelled",
    "ChannelClosed",
    "DSecError",
    "DeadlineExceeded",
    "EdgeCapacity",
    "FailedPrecondition",
    "ImageNotFound",
    "Internal",
    "InvalidArgument",
    "LayerCorrupt",
    "LayerNotFound",
    "NoEligibleEdge",
    "NodeDiskLow",
    "NotFound",
    "PathNotFound",
    "PermissionDenied",
    "QuotaExceeded",
    "ResourceExhausted",
    "SandboxNotFound",
    "SandboxTerminated",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "error_class_for",
]

#: Name of the binary trailer carrying a serialized ``dsec.types.v1.ErrorInfo``.
ERROR_TRAILER = "dsec-error-bin"


class DSecError(Exception):
    """Root of every dsec error.

    Attributes:
        code: the gRPC status code this error travels as.
        reason: a stable UPPER_SNAKE identifier, safe to branch on.
        metadata: extra machine-readable facts (e.g. ``{"project": "root/a"}``).
    """

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN
    default_reason: ClassVar[str] = "UNKNOWN"

    def __init__(
        self,
        message: str = "",
        *,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message or (reason or self.default_reason))
        self.message = message or (reason or self.default_reason)
        self.reason = reason or self.default_reason
        self.metadata: dict[str, str] = dict(metadata or {})

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}" if self.reason not in self.message else self.message


class InvalidArgument(DSecError):
    """The request is malformed or out of range; retrying it unchanged fails again."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    default_reason = "INVALID_ARGUMENT"


class NotFound(DSecError):
    code = grpc.StatusCode.NOT_FOUND
    default_reason = "NOT_FOUND"


class SandboxNotFound(NotFound):
    """No such sandbox visible to the caller (another project's sandbox looks the same)."""

    default_reason = "SANDBOX_NOT_FOUND"


class ImageNotFound(NotFound):
    default_reason = "IMAGE_NOT_FOUND"


class LayerNotFound(NotFound):
    """A layer an environment names is missing from the layer store; ``metadata["layer"]``."""

    default_reason = "LAYER_NOT_FOUND"


class PathNotFound(NotFound):
    default_reason = "PATH_NOT_FOUND"


class AlreadyExists(DSecError):
    code = grpc.StatusCode.ALREADY_EXISTS
    default_reason = "ALREADY_EXISTS"


class FailedPrecondition(DSecError):
    """The target is in the wrong state for this call (e.g. the sandbox has stopped)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    default_reason = "FAILED_PRECONDITION"


class SandboxTerminated(FailedPrecondition):
    """The sandbox has ended; ``metadata["termination_reason"]`` says why."""

    default_reason = "SANDBOX_TERMINATED"


class LayerCorrupt(FailedPrecondition):
    """A layer's files do not match its digest (corrupt or truncated); it is never mounted.
    ``metadata["layer"]`` names it, ``metadata["file"]`` the file that failed the check."""

    default_reason = "LAYER_CORRUPT"


class BackendNotOffered(FailedPrecondition):
    """No edge of the cluster offers the backend asked for (``metadata["backend"]``): a retry
    cannot help, unlike NoEligibleEdge (edges offer it but have no room or health now)."""

    default_reason = "BACKEND_NOT_OFFERED"


class ResourceExhausted(DSecError):
    """Quota or capacity is short; retry later or ask for less."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = "RESOURCE_EXHAUSTED"


class QuotaExceeded(ResourceExhausted):
    """A project's quota would be exceeded; ``metadata["project"]`` names the limiting one."""

    default_reason = "QUOTA_EXCEEDED"


class NoEligibleEdge(ResourceExhausted):
    default_reason = "NO_ELIGIBLE_EDGE"


class EdgeCapacity(ResourceExhausted):
    default_reason = "EDGE_CAPACITY"


class NodeDiskLow(EdgeCapacity):
    """The edge's disk is below its free-space reserve; placement tries another edge.
    ``metadata``: ``edge``, ``path`` (the filesystem), ``free_mb``, ``reserve_mb``."""

    default_reason = "NODE_DISK_LOW"


class Unavailable(DSecError):
    """A transient failure (a service restarting, a node unreachable); safe to retry."""

    code = grpc.StatusCode.UNAVAILABLE
    default_reason = "UNAVAILABLE"


class ChannelClosed(Unavailable):
    """The channel into the sandbox dropped mid-call (the sandbox died, or is being reconnected)."""

    default_reason = "CHANNEL_CLOSED"


class Unauthenticated(DSecError):
    code = grpc.StatusCode.UNAUTHENTICATED
    default_reason = "UNAUTHENTICATED"


class PermissionDenied(DSecError):
    code = grpc.StatusCode.PERMISSION_DENIED
    default_reason = "PERMISSION_DENIED"


class DeadlineExceeded(DSecError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    default_reason = "DEADLINE_EXCEEDED"


class Cancelled(DSecError):
    code = grpc.StatusCode.CANCELLED
    default_reason = "CANCELLED"


class Unimplemented(DSecError):
    code = grpc.StatusCode.UNIMPLEMENTED
    default_reason = "UNIMPLEMENTED"


class BackendCapabilityMissing(Unimplemented):
    """The sandbox's backend does not offer the operation (e.g. pack_diff on a microVM);
    ``metadata``: ``backend``, ``capability``."""

    default_reason = "BACKEND_CAPABILITY"


class Internal(DSecError):
    """A bug in dsec. The message carries an incident id to find it in the logs."""

    code = grpc.StatusCode.INTERNAL
    default_reason = "INTERNAL"


def _all_subclasses(cls: type[DSecError]) -> list[type[DSecError]]:
    out: list[type[DSecError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def error_class_for(code: grpc.StatusCode, reason: str | None) -> type[DSecError]:
    """The most specific class for a status code and reason.

    A reason known for that code picks its class; otherwise the code's base
    class; an unknown code gives ``DSecError``.
    """
    by_code: type[DSecError] | None = None
    for cls in _all_subclasses(DSecError):
        if cls.code != code:
            continue
        if reason is not None and cls.default_reason == reason:
            return cls
        if by_code is None or issubclass(by_code, cls):
            by_code = cls
    return by_code or DSecError
