"""Mapping between gRPC statuses and the error vocabulary (both directions)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from dsec.types.v1 import types_pb2
from libdsec.errors import ERROR_TRAILER, DSecError, error_class_for


def error_trailer(err: DSecError) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata that carries ``err``'s reason and metadata."""
    info = types_pb2.ErrorInfo(reason=err.reason, metadata=err.metadata)
    return ((ERROR_TRAILER, info.SerializeToString()),)


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


def from_rpc_error(exc: grpc.RpcError) -> DSecError:
    """The most specific :class:`DSecError` for a failed call."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    info = _trailer_info(trailing)  # type: ignore[arg-type]
    reason = info.reason if info is not None and info.reason else None
    cls = error_class_for(code, reason)
    err = cls(details or "", reason=reason, metadata=dict(info.metadata) if info else None)
    return err


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def status_for(
    code_value: int, reason: str, message: str, metadata: Mapping[str, str] | None = None
) -> DSecError:
    """An error from a numeric code carried in a message (e.g. per-item batch results)."""
    code = _CODES.get(code_value, grpc.StatusCode.UNKNOWN)
    return error_class_for(code, reason or None)(message, reason=reason or None, metadata=metadata)


def code_number(code: grpc.StatusCode) -> int:
    return int(code.value[0])
