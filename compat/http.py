"""HTTP for the compatibility front ends: Starlette's routing, requests and responses, plus
the little the front ends add to them.

Each front end is a Starlette application (``compat.e2b``'s control API and envd,
``compat.sandboxfusion``, ``compat.swe_rex``); what they add here is a bounded body read (a
body over its limit is an ``HttpError`` 413, never read whole: :func:`read_body`, and
:func:`bounded` for a stream read otherwise, such as a multipart upload; :func:`decoded` undoes
a gzip Content-Encoding as the stream is read, so the limit counts decoded bytes), paths matched with or
without a trailing slash (E2B's, SandboxFusion's and SWE-ReX's services accept both; Starlette
would redirect), and ``HttpError``, which each front end renders as the error body its clients
read (``compat.e2b.http.error``; FastAPI's ``{"detail": ...}`` for the SandboxFusion and SWE-ReX
front ends, whose reference servers are FastAPI apps: :func:`detail`, the exception handlers
:func:`http_error`, :func:`status_detail` and :func:`token_refused`, and :func:`serve_http`,
their ASGI entry), and :func:`reset`, which drops a request's connection as a lost one.
"""

from __future__ import annotations

import json
import socket
import struct
import zlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from libdsec.errors import DSecError, Unauthenticated

__all__ = [
    "CONNECTION",
    "ASGIApp",
    "ClientDisconnect",
    "HttpError",
    "Message",
    "Receive",
    "Request",
    "Scope",
    "Send",
    "bounded",
    "decoded",
    "detail",
    "http_error",
    "read_body",
    "read_json",
    "reset",
    "serve_http",
    "status_detail",
    "token_refused",
    "without_trailing_slash",
]


#: The scope key under which ``python -m compat``'s server puts the request's connection
#: (its asyncio transport).
CONNECTION = "dsec.connection"


def reset(scope: Scope) -> bool:
    """Drops the connection ``scope`` came on as a lost one: a TCP reset (SO_LINGER 0), which
    a client reads as "connection reset by peer", where a close after a partial response is
    read as a malformed one. False when the server does not give the app its connection."""
    transport = scope.get(CONNECTION)
    if transport is None or transport.is_closing():
        return False
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
    return True


class HttpError(Exception):
    """An HTTP error status and its message; each front end renders the body its clients read."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def bounded(
    stream: AsyncIterator[bytes], limit: int, what: str = "request body"
) -> AsyncGenerator[bytes, None]:
    """`stream`'s chunks, refused with 413 (naming `what` and `limit`) as soon as they add up
    to more than `limit` bytes: the chunk that crosses it is not passed on."""
    size = 0
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"{what} larger than {limit} bytes")
        yield chunk


#: Content-Encoding names of gzip (RFC 9110 8.4.1.3: "x-gzip" is the same coding).
GZIP_CODINGS = frozenset({"gzip", "x-gzip"})
#: The most a decoded body produces at once: a gzip bomb is inflated this much at a time and
#: counted by :func:`bounded` as it goes, never whole in memory.
DECODED_PIECE_BYTES = 64 * 1024


def decoded(stream: AsyncIterator[bytes], content_encoding: str | None) -> AsyncIterator[bytes]:
    """`stream` with its Content-Encoding undone: none or ``identity`` as it is, gzip inflated
    piece by piece (as many layers as the header lists). Any other coding is refused here,
    before the body is read: ``HttpError`` 415 naming it. Malformed gzip (a bad header,
    corrupt data, a wrong checksum, an end before the end of the gzip data) is ``HttpError``
    400, raised while the stream is read: a consumer that keeps nothing of a stream that
    fails (an atomic upload) keeps nothing of it."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
    codings = [c for c in codings if c and c != "identity"]
    for coding in codings:
        if coding not in GZIP_CODINGS:
            raise HttpError(
                415,
                f"Content-Encoding {coding!r} is not supported: request bodies may be gzip "
                "(or identity)",
            )
    for _ in codings:
        stream = _gunzip(stream)
    return stream


def _bad_gzip(detail: str) -> HttpError:
    return HttpError(400, f"request body is not valid gzip (Content-Encoding: gzip): {detail}")


def _inflater() -> Any:
    return zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # 16+: the gzip format, not zlib's


async def _gunzip(stream: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    inflater = _inflater()
    async for chunk in stream:
        data = chunk
        while data:
            if inflater.eof:  # RFC 1952: a body may be several gzip members, one after another
                inflater = _inflater()
            try:
                while True:  # never more than DECODED_PIECE_BYTES at once
                    piece = inflater.decompress(data, DECODED_PIECE_BYTES)
                    if piece:
                        yield piece
                    data = inflater.unconsumed_tail
                    # a full piece may leave output pending inside zlib: ask again
                    if inflater.eof or (not data and len(piece) < DECODED_PIECE_BYTES):
                        break
            except zlib.error as exc:
                raise _bad_gzip(str(exc)) from None
            data = inflater.unused_data if inflater.eof else b""
    if not inflater.eof:
        raise _bad_gzip("it ends before the end of its gzip data")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it grows past `limit` bytes."""
    return b"".join([chunk async for chunk in bounded(request.stream(), limit)])


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """A JSON object body; an empty body is ``{}``. Strict JSON: ``NaN`` and ``Infinity``
    (which Python's parser takes) are refused, and so is nesting too deep for the parser
    (``[`` x 5000 raised RecursionError: a 500, found by tests/fuzz), both as 400."""
    raw = await read_body(request, limit)
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except ValueError as exc:
        raise HttpError(400, f"request body is not JSON: {exc}") from None
    except RecursionError:
        raise HttpError(400, "request body is not JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise HttpError(400, "request body must be a JSON object")
    return value


def without_trailing_slash(scope: Scope) -> Scope:
    """`scope` with its path's trailing slashes removed (``/`` stays), for routing."""
    path = str(scope["path"])
    trimmed = path.rstrip("/") or "/"
    return scope if trimmed == path else {**scope, "path": trimmed}


async def serve_http(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """`app` on an HTTP request, its path matched with or without a trailing slash; a
    websocket is closed (1003: these APIs have none), lifespan events are ignored, and a
    client that went away mid-request ends it quietly."""
    if scope["type"] != "http":
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1003})
        return
    try:
        await app(without_trailing_slash(scope), receive, send)
    except ClientDisconnect:
        return


def detail(status: int, value: Any) -> JSONResponse:
    """FastAPI's error body (``{"detail": ...}``), which FastAPI servers' clients read."""
    return JSONResponse({"detail": value}, status)


async def http_error(request: Request, exc: Exception) -> Response:
    """An :class:`HttpError` as FastAPI's error body."""
    assert isinstance(exc, HttpError)
    return detail(exc.status, exc.message)


async def status_detail(request: Request, exc: Exception) -> Response:
    """Starlette's own HTTP errors (404, 405) as FastAPI's error body."""
    assert isinstance(exc, HTTPException)
    return detail(exc.status_code, exc.detail)


async def token_refused(request: Request, exc: Exception) -> Response:
    """dsec's refusal of the caller's token: 401 (unknown) or 403 (not allowed)."""
    assert isinstance(exc, DSecError)
    status = 401 if isinstance(exc, Unauthenticated) else 403
    return detail(status, f"dsec refused the token: {exc.message}")
