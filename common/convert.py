"""Small conversions between protobuf well-known types and Python values."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp


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
