"""Pure-Python protobuf codec and frame I/O of the in-sandbox channel.

The in-sandbox agents cannot afford the protobuf runtime (~10 MB per process,
measured) and must run on a bare interpreter from the toolkit layer, so this
module encodes and decodes the contract messages from the generated table
`dsec.wire_schema.SCHEMA` with the standard library only. It must import
nothing else from `dsec`: the toolkit ships `dsec/__init__.py` and
`dsec/wire_schema.py` and nothing more.

Dict form of a message: field name -> value. Sub-messages are dicts, repeated
fields lists, maps dicts, enums ints, bytes fields bytes, strings str;
`google.protobuf.Timestamp` is `{"seconds": s, "nanos": n}`. proto3 defaults
are omitted on encode and absent on decode (read fields with `dict.get`),
except oneof members, which are present whenever set, even to a default
(`{"close_stdin": False}` is a real message). A message field is present
whenever its key is (an empty dict encodes as an empty sub-message).

Frames: a 4-byte big-endian length, then one encoded `dsec.aether.v1.Frame`,
at most 8 MiB.
"""

from __future__ import annotations

import _socket  # not `socket`: its enum conversions cost ~1 MB per process
import struct

from dsec.wire_schema import SCHEMA as _GENERATED

TYPE_CHECKING = False  # typing costs ~2 MB at run time: annotations are strings
if TYPE_CHECKING:
    from typing import Any

# The generated literal is too heterogeneous for inference; this is its shape.
SCHEMA: dict[str, dict[int, tuple[Any, ...]]] = _GENERATED  # type: ignore[assignment]

MAX_FRAME_BYTES = 8 * 1024 * 1024
FRAME = "dsec.aether.v1.Frame"

# Descriptor field types (google/protobuf/descriptor.proto).
T_DOUBLE, T_FLOAT, T_INT64, T_UINT64, T_INT32, T_FIXED64, T_FIXED32, T_BOOL = 1, 2, 3, 4, 5, 6, 7, 8
T_STRING, T_GROUP, T_MESSAGE, T_BYTES, T_UINT32, T_ENUM = 9, 10, 11, 12, 13, 14
T_SFIXED32, T_SFIXED64, T_SINT32, T_SINT64 = 15, 16, 17, 18

WT_VARINT, WT_I64, WT_LEN, WT_I32 = 0, 1, 2, 5

_VARINT_TYPES = frozenset(
    (T_INT64, T_UINT64, T_INT32, T_BOOL, T_UINT32, T_ENUM, T_SINT32, T_SINT64)
)
_I64_TYPES = frozenset((T_DOUBLE, T_FIXED64, T_SFIXED64))
_I32_TYPES = frozenset((T_FLOAT, T_FIXED32, T_SFIXED32))
_WIRE_TYPE = {t: WT_VARINT for t in _VARINT_TYPES}
_WIRE_TYPE.update({t: WT_I64 for t in _I64_TYPES})
_WIRE_TYPE.update({t: WT_I32 for t in _I32_TYPES})
_WIRE_TYPE.update({T_STRING: WT_LEN, T_BYTES: WT_LEN, T_MESSAGE: WT_LEN})
_STRUCT = {
    T_DOUBLE: struct.Struct("<d"),
    T_FLOAT: struct.Struct("<f"),
    T_FIXED64: struct.Struct("<Q"),
    T_SFIXED64: struct.Struct("<q"),
    T_FIXED32: struct.Struct("<I"),
    T_SFIXED32: struct.Struct("<i"),
}
_LEN = struct.Struct(">I")
_U64 = (1 << 64) - 1


class WireError(ValueError):
    """Malformed wire data, or a value that does not fit its field."""


class _Field:
    """One field of one message, resolved from the schema table once."""

    __slots__ = (
        "key_type",
        "map",
        "message",
        "name",
        "number",
        "oneof",
        "packable",
        "repeated",
        "type",
        "value_message",
        "wire_type",
    )

    def __init__(self, number: int, entry: tuple[Any, ...]) -> None:
        name, ftype, extra, oneof = entry
        self.number = number
        self.name: str = name
        self.oneof: str = oneof
        self.map = ftype == "map"
        if self.map:
            self.key_type, self.type, self.value_message = extra
            self.repeated = False
            self.message = ""
        else:
            self.type = ftype
            self.repeated, self.message = extra
            self.key_type, self.value_message = 0, ""
        if self.type == T_GROUP:
            raise WireError(f"field {name}: groups are not supported")
        self.wire_type = WT_LEN if self.map else _WIRE_TYPE[self.type]
        self.packable = self.repeated and self.wire_type != WT_LEN


class _Message:
    __slots__ = ("by_name", "by_number", "name")

    def __init__(self, name: str, fields: dict[int, tuple[Any, ...]]) -> None:
        self.name = name
        self.by_number = {n: _Field(n, e) for n, e in fields.items()}
        self.by_name = {f.name: f for f in self.by_number.values()}


_MESSAGES: dict[str, _Message] = {}


def _message(name: str) -> _Message:
    m = _MESSAGES.get(name)
    if m is None:
        try:
            fields = SCHEMA[name]
        except KeyError:
            raise WireError(f"unknown message type {name!r}") from None
        m = _MESSAGES[name] = _Message(name, fields)
    return m


# --------------------------------------------------------------------- encode


def _varint(value: int, out: bytearray) -> None:
    if value < 0:
        value &= _U64  # negative int32/int64 travel as 10-byte two's complement
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _scalar_is_default(ftype: int, value: Any) -> bool:
    if ftype in (T_DOUBLE, T_FLOAT):
        # -0.0 is not the default: protobuf keeps its sign bit on the wire.
        return value == 0 and struct.pack("<d", value)[7] == 0
    return not value


def _encode_scalar(ftype: int, value: Any, out: bytearray) -> None:
    if ftype in _VARINT_TYPES:
        if ftype == T_SINT32 or ftype == T_SINT64:
            value = (value << 1) ^ (value >> 63) if value < 0 else value << 1
        elif ftype == T_BOOL:
            value = 1 if value else 0
        elif not isinstance(value, int):
            raise WireError(f"expected an int, got {type(value).__name__}")
        _varint(value, out)
    elif ftype == T_STRING:
        data = value.encode("utf-8")
        _varint(len(data), out)
        out += data
    elif ftype == T_BYTES:
        _varint(len(value), out)
        out += value
    else:
        out += _STRUCT[ftype].pack(value)


def _encode_into(msg: _Message, value: dict[str, Any], out: bytearray) -> None:
    by_name = msg.by_name
    for name, v in value.items():
        f = by_name.get(name)
        if f is None:
            raise WireError(f"{msg.name} has no field {name!r}")
        if v is None:
            continue
        try:
            _encode_field(f, v, out)
        except WireError:
            raise
        except (TypeError, ValueError, AttributeError, struct.error) as exc:
            raise WireError(f"{msg.name}.{name}: {exc}") from exc


def _encode_field(f: _Field, v: Any, out: bytearray) -> None:
    if f.map:
        entry_key = (f.number << 3) | WT_LEN
        for k, item in v.items():
            entry = bytearray()
            entry.append((1 << 3) | _WIRE_TYPE[f.key_type])
            _encode_scalar(f.key_type, k, entry)
            if f.type == T_MESSAGE:
                entry.append((2 << 3) | WT_LEN)
                sub = bytearray()
                _encode_into(_message(f.value_message), item, sub)
                _varint(len(sub), entry)
                entry += sub
            else:
                entry.append((2 << 3) | _WIRE_TYPE[f.type])
                _encode_scalar(f.type, item, entry)
            _varint(entry_key, out)
            _varint(len(entry), out)
            out += entry
        return
    if f.type == T_MESSAGE:
        sub_msg = _message(f.message)
        items = v if f.repeated else (v,)
        for item in items:
            _varint((f.number << 3) | WT_LEN, out)
            sub = bytearray()
            _encode_into(sub_msg, item, sub)
            _varint(len(sub), out)
            out += sub
        return
    if f.packable:
        # proto3 packs repeated scalars by default.
        if not v:
            return
        body = bytearray()
        for item in v:
            _encode_scalar(f.type, item, body)
        _varint((f.number << 3) | WT_LEN, out)
        _varint(len(body), out)
        out += body
        return
    if f.repeated:  # strings, bytes
        for item in v:
            _varint((f.number << 3) | f.wire_type, out)
            _encode_scalar(f.type, item, out)
        return
    if not f.oneof and _scalar_is_default(f.type, v):
        return
    _varint((f.number << 3) | f.wire_type, out)
    _encode_scalar(f.type, v, out)


def encode(msg_name: str, value: dict[str, Any]) -> bytes:
    """Encode `value` (dict form) as the protobuf message `msg_name`."""
    out = bytearray()
    _encode_into(_message(msg_name), value, out)
    return bytes(out)


# --------------------------------------------------------------------- decode


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result & _U64, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint too long")


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def _varint_value(ftype: int, raw: int) -> Any:
    if ftype == T_INT32 or ftype == T_ENUM:
        return _signed(raw, 32)
    if ftype == T_INT64:
        return _signed(raw, 64)
    if ftype == T_UINT32:
        return raw & 0xFFFFFFFF
    if ftype == T_BOOL:
        return raw != 0
    if ftype == T_SINT32:
        raw &= 0xFFFFFFFF
        return (raw >> 1) ^ -(raw & 1)
    if ftype == T_SINT64:
        return (raw >> 1) ^ -(raw & 1)
    return raw  # uint64


def _skip(buf: memoryview, pos: int, end: int, wire_type: int) -> int:
    if wire_type == WT_VARINT:
        return _read_varint(buf, pos, end)[1]
    if wire_type == WT_I64:
        pos += 8
    elif wire_type == WT_I32:
        pos += 4
    elif wire_type == WT_LEN:
        n, pos = _read_varint(buf, pos, end)
        pos += n
    else:
        raise WireError(f"unsupported wire type {wire_type}")
    if pos > end:
        raise WireError("truncated field")
    return pos


def _read_fixed(ftype: int, buf: memoryview, pos: int, end: int) -> tuple[Any, int]:
    st = _STRUCT[ftype]
    nxt = pos + st.size
    if nxt > end:
        raise WireError("truncated fixed-width field")
    return st.unpack_from(buf, pos)[0], nxt


def _read_len(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    n, pos = _read_varint(buf, pos, end)
    if pos + n > end:
        raise WireError("truncated length-delimited field")
    return pos, pos + n


def _decode_scalar(
    ftype: int, wire_type: int, buf: memoryview, pos: int, end: int
) -> tuple[Any, int]:
    if wire_type == WT_VARINT:
        raw, pos = _read_varint(buf, pos, end)
        return _varint_value(ftype, raw), pos
    if wire_type == WT_LEN:
        start, stop = _read_len(buf, pos, end)
        data = bytes(buf[start:stop])
        if ftype == T_STRING:
            try:
                return data.decode("utf-8"), stop
            except UnicodeDecodeError as exc:
                raise WireError(f"invalid UTF-8 in a string field: {exc}") from None
        return data, stop
    return _read_fixed(ftype, buf, pos, end)


def _decode_map_entry(f: _Field, buf: memoryview, pos: int, end: int) -> tuple[Any, Any]:
    key: Any = "" if f.key_type == T_STRING else (False if f.key_type == T_BOOL else 0)
    if f.type == T_MESSAGE:
        value: Any = {}
    elif f.type == T_STRING:
        value = ""
    elif f.type == T_BYTES:
        value = b""
    elif f.type in (T_DOUBLE, T_FLOAT):
        value = 0.0
    elif f.type == T_BOOL:
        value = False
    else:
        value = 0
    while pos < end:
        tag, pos = _read_varint(buf, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if number == 1 and wire_type == _WIRE_TYPE[f.key_type]:
            key, pos = _decode_scalar(f.key_type, wire_type, buf, pos, end)
        elif number == 2 and f.type == T_MESSAGE and wire_type == WT_LEN:
            start, pos = _read_len(buf, pos, end)
            value = _decode_from(_message(f.value_message), buf, start, pos)
        elif number == 2 and wire_type == _WIRE_TYPE[f.type]:
            value, pos = _decode_scalar(f.type, wire_type, buf, pos, end)
        else:
            pos = _skip(buf, pos, end, wire_type)
    return key, value


def _decode_from(msg: _Message, buf: memoryview, pos: int, end: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    oneof_set: dict[str, str] = {}
    by_number = msg.by_number
    while pos < end:
        tag, pos = _read_varint(buf, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if number == 0:
            raise WireError("field number 0")
        f = by_number.get(number)
        if f is None:
            pos = _skip(buf, pos, end, wire_type)  # unknown field: forward compatible
            continue
        if f.map:
            if wire_type != WT_LEN:
                raise WireError(f"{msg.name}.{f.name}: wrong wire type {wire_type}")
            start, pos = _read_len(buf, pos, end)
            k, v = _decode_map_entry(f, buf, start, pos)
            out.setdefault(f.name, {})[k] = v
            continue
        if f.type == T_MESSAGE:
            if wire_type != WT_LEN:
                raise WireError(f"{msg.name}.{f.name}: wrong wire type {wire_type}")
            start, pos = _read_len(buf, pos, end)
            sub = _decode_from(_message(f.message), buf, start, pos)
            if f.repeated:
                out.setdefault(f.name, []).append(sub)
                continue
            prev = out.get(f.name)
            if prev is not None:
                prev.update(sub)  # a repeated occurrence merges into the first
                sub = prev
            value: Any = sub
        elif f.packable and wire_type == WT_LEN:
            start, pos = _read_len(buf, pos, end)
            items = out.setdefault(f.name, [])
            p = start
            while p < pos:
                item, p = _decode_scalar(f.type, f.wire_type, buf, p, pos)
                items.append(item)
            continue
        else:
            if wire_type != f.wire_type:
                raise WireError(f"{msg.name}.{f.name}: wrong wire type {wire_type}")
            value, pos = _decode_scalar(f.type, wire_type, buf, pos, end)
            if f.repeated:
                out.setdefault(f.name, []).append(value)
                continue
            if not f.oneof and _scalar_is_default(f.type, value):
                out.pop(f.name, None)
                continue
        if f.oneof:
            other = oneof_set.get(f.oneof)
            if other is not None and other != f.name:
                del out[other]  # the last member of a oneof on the wire wins
            oneof_set[f.oneof] = f.name
        out[f.name] = value
    if pos != end:
        raise WireError("field overruns its message")
    return out


def decode(msg_name: str, data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Decode the protobuf message `msg_name` from `data` into dict form."""
    buf = memoryview(data)
    return _decode_from(_message(msg_name), buf, 0, len(buf))


def oneof_fields(msg_name: str, oneof: str) -> tuple[str, ...]:
    """The field names of the oneof `oneof` of `msg_name`, in field-number order (as the
    proto declares them): what a dispatcher must handle."""
    fields = _message(msg_name).by_number
    names = tuple(fields[n].name for n in sorted(fields) if fields[n].oneof == oneof)
    if not names:
        raise WireError(f"{msg_name} has no oneof {oneof!r}")
    return names


# -------------------------------------------------------- frames, raw relay


def split_frame(payload: bytes | bytearray | memoryview) -> tuple[int, int, memoryview]:
    """(stream_id, body field number, encoded body) of an encoded Frame.

    aether relays frames without decoding their bodies: only the stream id is
    rewritten, so a 4 MiB upload chunk is never parsed in the relay.
    """
    buf = memoryview(payload)
    end = len(buf)
    pos = 0
    stream_id = 0
    body_number = 0
    body = buf[0:0]
    while pos < end:
        tag, pos = _read_varint(buf, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if number == 1 and wire_type == WT_VARINT:
            raw, pos = _read_varint(buf, pos, end)
            stream_id = raw & 0xFFFFFFFF
        elif number >= 2 and wire_type == WT_LEN:
            start, pos = _read_len(buf, pos, end)
            body_number, body = number, buf[start:pos]
        else:
            pos = _skip(buf, pos, end, wire_type)
    return stream_id, body_number, body


def join_frame(stream_id: int, body_number: int, body: bytes | bytearray | memoryview) -> bytes:
    """Encode a Frame from a stream id and an already encoded body."""
    out = bytearray()
    if stream_id:
        out.append(1 << 3)
        _varint(stream_id, out)
    _varint((body_number << 3) | WT_LEN, out)
    _varint(len(body), out)
    out += body
    return bytes(out)


def pack_frame(payload: bytes) -> bytes:
    """Length-prefix one encoded Frame."""
    if len(payload) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return _LEN.pack(len(payload)) + payload


def _recv_exact(sock: _socket.socket, n: int) -> bytes | None:
    """Exactly n bytes, or None on EOF before the first byte (a clean end)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return None
            raise WireError("connection closed in the middle of a frame")
        got += k
    return bytes(buf)


def read_frame(sock: _socket.socket) -> bytes | None:
    """Read one frame payload from a blocking socket; None on a clean EOF."""
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME_BYTES:
        raise WireError(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    if n == 0:
        return b""
    data = _recv_exact(sock, n)
    if data is None:
        raise WireError("connection closed in the middle of a frame")
    return data


def write_frame(sock: _socket.socket, payload: bytes) -> None:
    """Write one frame to a blocking socket (sendall handles partial writes)."""
    sock.sendall(pack_frame(payload))


def read_message(sock: _socket.socket) -> dict[str, Any] | None:
    """Read and decode one Frame; None on a clean EOF."""
    payload = read_frame(sock)
    return None if payload is None else decode(FRAME, payload)


def write_message(sock: _socket.socket, frame: dict[str, Any]) -> None:
    """Encode and write one Frame."""
    write_frame(sock, encode(FRAME, frame))


class FrameReader:
    """Reassembles frames from the bytes of a non-blocking socket."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Append received bytes; return every frame payload now complete."""
        self._buf += data
        frames: list[bytes] = []
        buf = self._buf
        pos = 0
        while len(buf) - pos >= 4:
            (n,) = _LEN.unpack_from(buf, pos)
            if n > MAX_FRAME_BYTES:
                raise WireError(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
            if len(buf) - pos - 4 < n:
                break
            frames.append(bytes(buf[pos + 4 : pos + 4 + n]))
            pos += 4 + n
        if pos:
            del buf[:pos]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held."""
        return len(self._buf)
