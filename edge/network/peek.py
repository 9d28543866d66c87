"""The name a TCP connection asks for, read from its first bytes (issue: name-aware egress).

A connection that a sandbox's policy allows only because of a domain rule is decided on the
name the client actually asks for, not on the address it connects to (many sites share one
CDN address). That name is in the first bytes the client sends:

- TLS: the ClientHello's ``server_name`` extension (RFC 6066 3). Nothing is decrypted: the
  ClientHello is plaintext. An *encrypted* ClientHello (ECH, extension 0xfe0d) hides the real
  name behind a public one, so it is reported (``ech``) and refused by the caller.
- plain HTTP/1.x: the ``Host`` header (RFC 9112 3.2), or the authority of an absolute-form
  request target, which wins over Host as the RFC says.

:func:`peek` is pure: it takes the bytes read so far and answers :data:`NEED_MORE`, or a
:class:`Peeked` with the protocol and the name (``""`` when the client sent none). Callers
read at most :data:`MAX_PEEK_BYTES` and give up on a client that has not said enough by then
(a ClientHello is a few hundred bytes; with post-quantum key shares ~1.8 KB).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

#: What a caller reads at most before it decides (a ClientHello may span TLS records).
MAX_PEEK_BYTES = 16 * 1024

TLS_HANDSHAKE = 0x16
TLS_CLIENT_HELLO = 0x01
EXT_SERVER_NAME = 0x0000
EXT_ECH = 0xFE0D  # encrypted_client_hello (RFC 9849 / draft-ietf-tls-esni)
SNI_HOST_NAME = 0x00

HTTP_METHODS = (
    b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"TRACE", b"CONNECT"
)  # fmt: skip


@dataclass(frozen=True)
class Peeked:
    """What the first bytes say: ``protocol`` "tls", "http" or "unknown"; ``name`` the host
    name asked for (lower case, no trailing dot, no port; "" = none given); ``ech``: the
    ClientHello is encrypted (the real name is hidden); ``error``: why it is malformed."""

    protocol: str
    name: str = ""
    ech: bool = False
    error: str = ""


#: Not enough bytes yet to decide.
NEED_MORE = None


def peek(data: bytes) -> Peeked | None:
    """The protocol and name of a connection's first ``data`` bytes, or NEED_MORE."""
    if not data:
        return NEED_MORE
    if data[0] == TLS_HANDSHAKE:
        return _tls(data)
    if _may_be_http(data):
        return _http(data)
    return Peeked("unknown")


def normalize(name: str) -> str:
    """A host name as policies hold them: lower case, no trailing dot."""
    return name.strip().lower().rstrip(".")


# ----------------------------------------------------------------------------- TLS


def _tls(data: bytes) -> Peeked | None:
    body = _handshake_bytes(data)
    if body is None:
        return NEED_MORE
    if isinstance(body, Peeked):
        return body
    if len(body) < 4:
        return NEED_MORE
    if body[0] != TLS_CLIENT_HELLO:
        return Peeked("tls", error="the first handshake message is not a ClientHello")
    length = int.from_bytes(body[1:4], "big")
    if len(body) < 4 + length:
        return NEED_MORE if len(data) < MAX_PEEK_BYTES else Peeked("tls", error="too long")
    try:
        return _client_hello(memoryview(body)[4 : 4 + length])
    except (IndexError, struct.error, ValueError) as exc:
        return Peeked("tls", error=f"malformed ClientHello: {exc}")


def _handshake_bytes(data: bytes) -> bytes | Peeked | None:
    """The handshake layer's bytes from the TLS records in ``data`` (a ClientHello may be
    split over several records), as far as they go; None if not even one record header."""
    out = bytearray()
    off = 0
    while off + 5 <= len(data):
        ctype, major, _minor, length = struct.unpack_from("!BBBH", data, off)
        if ctype != TLS_HANDSHAKE or major != 3:
            if not out:
                return Peeked("tls", error="not a TLS handshake record")
            break
        if length == 0 or length > 16384 + 2048:
            return Peeked("tls", error=f"a TLS record of {length} bytes")
        out += data[off + 5 : off + 5 + length]
        if off + 5 + length > len(data):
            break
        off += 5 + length
    return bytes(out) if out else None


def _client_hello(m: memoryview) -> Peeked:
    off = 2 + 32  # legacy_version, random
    off += 1 + m[off]  # legacy_session_id
    (n,) = struct.unpack_from("!H", m, off)
    off += 2 + n  # cipher_suites
    off += 1 + m[off]  # legacy_compression_methods
    if off == len(m):  # no extensions at all (SSL 3.0 style): no name
        return Peeked("tls")
    (ext_total,) = struct.unpack_from("!H", m, off)
    off += 2
    end = off + ext_total
    if end > len(m):
        raise ValueError("extensions run past the ClientHello")
    name, ech, seen = "", False, set()
    while off < end:
        etype, elen = struct.unpack_from("!HH", m, off)
        off += 4
        if etype in seen:  # RFC 8446 4.2: duplicates are illegal (and a classic evasion)
            raise ValueError(f"extension {etype:#06x} twice")
        seen.add(etype)
        ext = m[off : off + elen]
        if len(ext) != elen:
            raise ValueError("an extension runs past the ClientHello")
        off += elen
        if etype == EXT_SERVER_NAME:
            name = _server_name(ext)
        elif etype == EXT_ECH:
            ech = True
    return Peeked("tls", name=name, ech=ech)


def _server_name(ext: memoryview) -> str:
    (list_len,) = struct.unpack_from("!H", ext, 0)
    if list_len + 2 != len(ext):
        raise ValueError("server_name list length")
    off, names = 2, []
    while off < len(ext):
        kind, n = struct.unpack_from("!BH", ext, off)
        off += 3
        if kind == SNI_HOST_NAME:
            names.append(bytes(ext[off : off + n]))
        off += n
    if len(names) != 1:  # RFC 6066: at most one host_name; several is an evasion attempt
        raise ValueError(f"{len(names)} host names in server_name")
    return _host(names[0])


def _host(raw: bytes) -> str:
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("a host name that is not ASCII (IDNA names are sent as xn--)") from None
    name = normalize(text)
    if not name or len(name) > 253 or any(c in name for c in " /\\@\x00"):
        raise ValueError(f"not a host name: {text!r}")
    return name


# ---------------------------------------------------------------------------- HTTP


def _may_be_http(data: bytes) -> bool:
    head = data[:8]
    return any(m.startswith(head[: len(m)]) or head.startswith(m + b" ") for m in HTTP_METHODS)


def _http(data: bytes) -> Peeked | None:
    end = data.find(b"\r\n\r\n")
    if end < 0:
        if len(data) >= MAX_PEEK_BYTES:
            return Peeked("http", error="request headers longer than the peek limit")
        return NEED_MORE
    lines = data[:end].split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[0] not in HTTP_METHODS or not parts[2].startswith(b"HTTP/1."):
        return Peeked("unknown", error="not an HTTP/1.x request line")
    hosts = []
    for line in lines[1:]:
        key, sep, value = line.partition(b":")
        if not sep or key != key.strip():  # "Host :" (whitespace before the colon): RFC 9112 5.1
            return Peeked("http", error=f"malformed header line {line[:40]!r}")
        if key.lower() == b"host":
            hosts.append(value.strip())
    if len(hosts) > 1:  # RFC 9112 3.2: more than one Host is a 400 (and an evasion attempt)
        return Peeked("http", error="several Host headers")
    target = parts[1]
    try:
        if b"://" in target:  # absolute-form: its authority is the host asked for
            authority = target.split(b"://", 1)[1].split(b"/", 1)[0].split(b"?", 1)[0]
            return Peeked("http", name=_host(_strip_port(authority.rsplit(b"@", 1)[-1])))
        if parts[0] == b"CONNECT":
            return Peeked("http", error="CONNECT (a proxy request)")
        if not hosts:
            return Peeked("http")  # HTTP/1.0 without Host: no name
        return Peeked("http", name=_host(_strip_port(hosts[0])))
    except ValueError as exc:
        return Peeked("http", error=str(exc))


def _strip_port(authority: bytes) -> bytes:
    if authority.startswith(b"["):  # an IPv6 literal
        return authority[1 : authority.find(b"]")]
    host, sep, port = authority.rpartition(b":")
    return host if sep and port.isdigit() else authority
