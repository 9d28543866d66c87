"""HTTP for the compatibility front ends: Starlette's routing, requests and responses, plus
the little the front ends add to them.

Each front end is a Starlette application (``compat.e2b``'s control API and envd,
``compat.sandboxfusion``, ``compat.swe_rex``); what they add here is a bounded body read (a
body over its limit is an ``HttpError`` 413, never read whole: :func:`read_body`, and
:func:`bounded` for a stream read otherwise, such as a multipart upload), paths matched with or
without a trailing slash (E2B's, SandboxFusion's and SWE-ReX's services accept both; Starlette
would redirect), and ``HttpError``, which each front end renders as the error body its clients
read (``compat.e2b.http.error``; FastAPI's ``{"detail": ...}`` for the SandboxFusion and SWE-ReX
front ends, whose reference servers are FastAPI apps: :func:`detail`, the exception handlers
:func:`http_error`, :func:`status_detail` and :func:`token_refused`, and :func:`serve_http`,
their ASGI entry).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from libdsec.errors import DSecError, Unauthenticated

__all__ = [
    "ASGIApp",
    "ClientDisconnect",
    "HttpError",
    "Message",
    "Receive",
    "Request",
    "Scope",
    "Send",
    "bounded",
    "detail",
    "http_error",
    "read_body",
    "read_json",
    "serve_http",
    "status_detail",
    "token_refused",
    "without_trailing_slash",
]


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
