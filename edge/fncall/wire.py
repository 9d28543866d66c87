"""Frames between the edge and a pool container's runner. Standard library only.

The runner (``runner.py``) runs inside every warm-pool container on the image's own Python, so
this module must import nothing but the standard library; the edge imports it too. The channel is
a socketpair private to one edge and one container it started from the same source tree (the
runner kit is copied from this package at edge start), so the format has no compatibility
constraints beyond one edge's lifetime. That, and the payloads (source files, stdin and output
as raw bytes, a handful of scalars), is why it is not protobuf like the aether channel: JSON for
the small header, bytes appended unencoded.

A frame: u32 big-endian body length, then the body:
    u32 big-endian header length | header (UTF-8 JSON object) | blob bytes, back to back
The header's ``"blobs"`` key lists ``[name, length]`` pairs in order; decoding puts each blob
into the returned dict under its name (as ``bytes``) and removes ``"blobs"``.
"""

from __future__ import annotations

import json
import struct

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAX_FRAME_BYTES = 256 * 1024 * 1024
_LEN = struct.Struct(">I")


class WireError(ValueError):
    """A malformed or oversized frame: the channel cannot be trusted any more."""


def encode(message: dict[str, Any]) -> bytes:
    """A whole frame (length prefix included) for `message`; bytes values travel as blobs."""
    header: dict[str, Any] = {}
    blobs: list[bytes] = []
    names: list[list[Any]] = []
    for k, v in message.items():
        if isinstance(v, (bytes, bytearray, memoryview)):
            b = bytes(v)
            names.append([k, len(b)])
            blobs.append(b)
        else:
            header[k] = v
    if names:
        header["blobs"] = names
    head = json.dumps(header, separators=(",", ":")).encode()
    body_len = 4 + len(head) + sum(len(b) for b in blobs)
    if body_len > MAX_FRAME_BYTES:
        raise WireError(f"frame of {body_len} bytes exceeds {MAX_FRAME_BYTES}")
    return b"".join([_LEN.pack(body_len), _LEN.pack(len(head)), head, *blobs])


def body_length(prefix: bytes) -> int:
    """The body length announced by a 4-byte prefix (validated)."""
    (n,) = _LEN.unpack(prefix)
    if n < 4 or n > MAX_FRAME_BYTES:
        raise WireError(f"bad frame length {n}")
    return int(n)


def decode(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The message of one frame body (without its length prefix)."""
    view = memoryview(body)
    if len(view) < 4:
        raise WireError("truncated frame")
    (hlen,) = _LEN.unpack(view[:4])
    if 4 + hlen > len(view):
        raise WireError("truncated frame header")
    try:
        msg = json.loads(bytes(view[4 : 4 + hlen]))
    except ValueError as exc:
        raise WireError(f"bad frame header: {exc}") from None
    if not isinstance(msg, dict):
        raise WireError("frame header is not an object")
    pos = 4 + hlen
    for entry in msg.pop("blobs", []):
        name, size = entry
        if pos + size > len(view):
            raise WireError("truncated frame blob")
        msg[name] = bytes(view[pos : pos + size])
        pos += size
    if pos != len(view):
        raise WireError("trailing bytes in frame")
    return msg
