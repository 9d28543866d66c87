"""Small conversions between protobuf well-known types and Python values."""

from __future__ import annotations

import time
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from libdsec.errors import InvalidArgument


def ts(seconds: float | None) -> Timestamp | None:
    """A Timestamp for a unix time, or None."""
    if seconds is None:
        return None
    out = Timestamp()
    out.FromNanoseconds(int(seconds * 1e9))
    return out


def from_ts(value: Timestamp) -> float | None:
    if value.seconds == 0 and value.nanos == 0:
        return None
    return value.seconds + value.nanos / 1e9


def enum_name(enum: Any, value: int, field: str, prefix: str = "") -> str:
    """The name of enum ``value`` read from a request's ``field``, less ``prefix``.

    proto3 enums are open: any int32 parses, and ``Enum.Name`` raises ValueError for a
    number it does not know, which reached callers as INTERNAL (found by tests/fuzz). An
    unknown number is the caller's error: INVALID_ARGUMENT naming the field.
    """
    try:
        name: str = enum.Name(value)
    except ValueError:
        raise InvalidArgument(
            f"{field}: unknown enum value {value}",
            reason="UNKNOWN_ENUM_VALUE",
            metadata={"field": field, "value": str(value)},
        ) from None
    return name.removeprefix(prefix)


#: The longest stop grace a request may ask for (SIGTERM, then SIGKILL after it), in seconds.
MAX_GRACE_S = 600.0


def grace_s(value: float, field: str = "grace_s") -> float:
    """A request's stop grace, checked: 0 (the default) up to :data:`MAX_GRACE_S`.

    The grace is added to the deadline of the call that carries it; a NaN or infinite one
    made that deadline expire at once, so the edges "did not answer" and a task's stop was
    reported as an edge failure while it went on (found by tests/fuzz).
    """
    if not (0 <= value <= MAX_GRACE_S):  # False for NaN too
        raise InvalidArgument(
            f"{field}={value} must be in [0, {MAX_GRACE_S:g}] seconds",
            reason="INVALID_GRACE",
            metadata={"field": field, "value": str(value)},
        )
    return value


def metrics_window(request: Any) -> tuple[float, float]:
    """A GetSandboxMetricsRequest's [start, end] in Unix seconds: no start is the oldest
    sample kept, no end is now; an end before the start is INVALID_ARGUMENT (BAD_TIME_RANGE)."""
    start = (from_ts(request.start) or 0.0) if request.HasField("start") else 0.0
    end = from_ts(request.end) if request.HasField("end") else None
    if end is None:
        end = time.time()
    if end < start:
        raise InvalidArgument(
            f"metrics window: end ({end:.0f}) is before start ({start:.0f})",
            reason="BAD_TIME_RANGE",
        )
    return start, end
