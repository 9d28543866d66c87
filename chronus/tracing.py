"""A command's span, recorded inside the sandbox without OpenTelemetry.

The edge puts its span's W3C ``traceparent`` on the Request of a traced exec (only when that
span is recorded). chronus times the command and answers with a ``CommandSpan`` (trace id,
the edge's span as parent, a span id of its own, start and end): the edge exports it under
chronus's service name. Nothing else is needed in here: the OpenTelemetry SDK and an exporter
would cost megabytes per sandbox (STYLE.md: every megabyte counts), this costs a string split.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing costs ~2 MB at run time: annotations are strings
if TYPE_CHECKING:
    from typing import Any

_HEX = frozenset("0123456789abcdef")


def parse_traceparent(value: str) -> tuple[bytes, bytes] | None:
    """(trace id, parent span id) of a sampled W3C traceparent (version 00); None for anything
    else (malformed, an all-zero id, not sampled): a bad header is ignored, never an error."""
    parts = value.split("-")
    if len(parts) != 4:
        return None
    version, trace_id, span_id, flags = parts
    if version != "00" or len(trace_id) != 32 or len(span_id) != 16 or len(flags) != 2:
        return None
    if not _HEX.issuperset(trace_id + span_id + flags):
        return None
    if int(flags, 16) & 1 == 0 or int(trace_id, 16) == 0 or int(span_id, 16) == 0:
        return None
    return bytes.fromhex(trace_id), bytes.fromhex(span_id)


def command_span(
    trace: tuple[bytes, bytes], started_at: float, exit: dict[str, Any]
) -> dict[str, Any]:
    """The CommandSpan of a command started at ``started_at`` (time.time()) that ended with
    ``exit`` (its ExitStatus, whose duration_s is wall time from start to exit)."""
    start_ns = int(started_at * 1e9)
    return {
        "trace_id": trace[0],
        "parent_span_id": trace[1],
        "span_id": os.urandom(8),
        "start_unix_ns": start_ns,
        "end_unix_ns": start_ns + int(exit.get("duration_s", 0.0) * 1e9),
    }
