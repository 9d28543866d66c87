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
    │   ├── OutcomeUnknown        an operation under way when its edge died (never run again)
    │   ├── OperationIdReused     an operation id already names another request
    │   ├── ExceedsEveryEdge      more cpu/memory than any edge has (never queued)
    │   ├── ClientClosed          a handle used after its client was closed (SDK-side)
    │   ├── LayerCorrupt
    │   └── BackendNotOffered     no edge of the cluster offers the backend asked for
    ├── ResourceExhausted         RESOURCE_EXHAUSTED   quota/capacity: retry later
    │   ├── QuotaExceeded
    │   ├── NoEligibleEdge
    │   └── EdgeCapacity
    │       ├── NodeDiskLow       the edge's disk is below its free-space reserve
    │       └── NodeMemoryFull    a paused sandbox's memory does not fit its node to resume
    ├── Unavailable               UNAVAILABLE          transient: retry
    │   └── ChannelClosed
    ├── Unauthenticated           UNAUTHENTICATED      bad or missing token
    ├── PermissionDenied          PERMISSION_DENIED
    ├── DeadlineExceeded          DEADLINE_EXCEEDED
    │   └── QueueTimeout          a create waited its wait_s in the queue, never placed
    ├── Cancelled                 CANCELLED
    ├── Unimplemented             UNIMPLEMENTED        not in this version/backend
    │   └── BackendCapabilityMissing   the sandbox's backend lacks the capability
    └── Internal                  INTERNAL             a dsec bug

Mapping a status to a class and back, for code that makes or handles gRPC calls
itself (the services and the SDK use the same functions, so both sides agree):
:func:`from_rpc_error` turns a failed call into its class, :func:`error_trailer` is the trailing metadata a server sends with an error,
:func:`item_status` is the ``dsec.types.v1.ItemStatus`` one item of a batch result carries
(its error), :func:`item_error` reads it back as its class, :func:`status_for` rebuilds an error
from a numeric code carried in a message, :func:`code_number` is the number of a code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import grpc

from dsec.types.v1 import types_pb2

__all__ = [
    "AlreadyExists",
    "BackendCapabilityMissing",
    "BackendNotOffered",
    "Cancelled",
    "ChannelClosed",
    "ClientClosed",
    "DSecError",
    "DeadlineExceeded",
    "EdgeCapacity",
    "ExceedsEveryEdge",
    "FailedPrecondition",
    "ImageNotFound",
    "Internal",
    "InvalidArgument",
    "LayerCorrupt",
    "LayerNotFound",
    "NoEligibleEdge",
    "NodeDiskLow",
    "NodeMemoryFull",
    "NotFound",
    "OperationIdReused",
    "OutcomeUnknown",
    "PathNotFound",
    "PermissionDenied",
    "QueueTimeout",
    "QuotaExceeded",
    "ResourceExhausted",
    "SandboxNotFound",
    "SandboxTerminated",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "code_number",
    "error_class_for",
    "error_trailer",
    "from_rpc_error",
    "item_error",
    "item_status",
    "status_for",
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


class ClientClosed(FailedPrecondition):
    """The client a handle belongs to (a sandbox, a process, a session) was closed. Nothing
    happened to the sandbox: open a new client and get it again (``client.get(sandbox_id)``).
    Raised by the SDK itself; never sent by a server."""

    default_reason = "CLIENT_CLOSED"


class SandboxTerminated(FailedPrecondition):
    """The sandbox has ended; ``metadata["termination_reason"]`` says why."""

    default_reason = "SANDBOX_TERMINATED"


class OutcomeUnknown(FailedPrecondition):
    """The operation (``metadata["operation_id"]``) was under way when the edge running it
    died: it may have run, in full or in part. A retry with its id is answered so and never
    runs it again; ``metadata["exec_id"]`` names its command when it had started."""

    default_reason = "OUTCOME_UNKNOWN"


class OperationIdReused(FailedPrecondition):
    """The operation id (``metadata["operation_id"]``) already names another request in the
    sandbox's operation log (entry ``metadata["seq"]``): a new request needs a new id."""

    default_reason = "OPERATION_ID_REUSED"


class LayerCorrupt(FailedPrecondition):
    """A layer's files do not match its digest (corrupt or truncated); it is never mounted.
    ``metadata["layer"]`` names it, ``metadata["file"]`` the file that failed the check."""

    default_reason = "LAYER_CORRUPT"


class BackendNotOffered(FailedPrecondition):
    """No edge of the cluster offers the backend asked for (``metadata["backend"]``): a retry
    cannot help, unlike NoEligibleEdge (edges offer it but have no room or health now)."""

    default_reason = "BACKEND_NOT_OFFERED"


class ExceedsEveryEdge(FailedPrecondition):
    """No edge of the cluster that offers the backend (and matches its node selector) could
    hold the sandbox even empty: more cpu or memory than the largest has. Never queued: a
    wait cannot help."""

    default_reason = "EXCEEDS_EVERY_EDGE"


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


class NodeMemoryFull(EdgeCapacity):
    """A paused sandbox whose memory was given back does not fit on its node to resume now
    (the node's memory admission is full): it stays PAUSED with everything kept; retry once
    other sandboxes end or pause. ``metadata``: ``edge``, ``need_mb``, ``free_mb``."""

    default_reason = "NODE_MEMORY_FULL"


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


class QueueTimeout(DeadlineExceeded):
    """A create with ``wait_s`` waited that long in the queue and was never placed; the
    message names what it waited for (the last refusal), ``metadata["queue_id"]`` its entry."""

    default_reason = "QUEUE_TIMEOUT"


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


def from_rpc_error(exc: grpc.RpcError) -> DSecError:
    """The most specific :class:`DSecError` for a failed call: its code, and the reason and
    metadata of its ``dsec-error-bin`` trailer if it has one (a foreign or corrupt trailer is
    ignored: the code still picks the class)::

        try:
            await stub.GetSandbox(request, metadata=auth, timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc   # NOT_FOUND + SANDBOX_NOT_FOUND: SandboxNotFound
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    info = _trailer_info(trailing)
    reason = info.reason if info is not None and info.reason else None
    cls = error_class_for(code, reason)
    return cls(details or "", reason=reason, metadata=dict(info.metadata) if info else None)


def error_trailer(err: DSecError) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata that carries ``err``'s reason and metadata to the caller
    (a server sends it with ``err.code``; :func:`from_rpc_error` reads it back)::

        await context.abort(err.code, err.message, trailing_metadata=error_trailer(err))
    """
    info = types_pb2.ErrorInfo(reason=err.reason, metadata=err.metadata)
    return ((ERROR_TRAILER, info.SerializeToString()),)


def status_for(
    code_value: int, reason: str, message: str, metadata: Mapping[str, str] | None = None
) -> DSecError:
    """An error from a numeric status code carried inside a message (e.g. the per-item
    results of ``CreateSandboxes``); an unknown number gives ``UNKNOWN``::

        >>> status_for(8, "QUOTA_EXCEEDED", "sandboxes would be 33 > 32")
        QuotaExceeded('sandboxes would be 33 > 32')
    """
    code = _CODES.get(code_value, grpc.StatusCode.UNKNOWN)
    return error_class_for(code, reason or None)(message, reason=reason or None, metadata=metadata)


def item_status(err: DSecError, out: types_pb2.ItemStatus | None = None) -> types_pb2.ItemStatus:
    """The per-item status that carries ``err`` in a batch result (the one encoder of every
    batch's per-item errors); written into ``out`` if given (a result's own field, no copy)::

        item_status(err, result.error)
    """
    if out is None:
        out = types_pb2.ItemStatus()
    out.code = code_number(err.code)
    out.reason = err.reason
    out.message = err.message
    out.metadata.update(err.metadata)
    return out


def item_error(status: types_pb2.ItemStatus) -> DSecError:
    """The most specific error for a per-item status (the one decoder; see
    :func:`item_status`). Only for a status that carries an error (``code`` != 0)::

        if r.error.code:
            raise item_error(r.error)
    """
    return status_for(status.code, status.reason, status.message, status.metadata)


def code_number(code: grpc.StatusCode) -> int:
    """The numeric value of a status code (``code_number(grpc.StatusCode.NOT_FOUND) == 5``),
    as carried in messages (see :func:`status_for`)."""
    return int(code.value[0])


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _trailer_info(trailing: Sequence[Any] | None) -> types_pb2.ErrorInfo | None:
    for item in trailing or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key == ERROR_TRAILER:
            info = types_pb2.ErrorInfo()
            try:
                info.ParseFromString(value)
            except Exception:  # a foreign or corrupt trailer: ignore, keep the code
                return None
            return info
    return None
