"""HTTP for the compatibility front ends: Starlette's routing, requests and responses, plus
the little both front ends add to them.

Each front end is a Starlette application (``compat.e2b``'s control API and envd,
``compat.sandboxfusion``); what they add here is a bounded body read (a body over its limit
is an ``HttpError`` 413, never read whole), paths matched with or without a trailing slash
(E2B's and SandboxFusion's services accept both; Starlette would redirect), and
``HttpError``, which each front end renders as the error body its clients read
(``compat.e2b.http.error``; FastAPI's ``{"detail": ...}`` for the SandboxFusion and SWE-ReX
front ends, whose reference servers are FastAPI apps: :func:`detail` and the exception
handlers :func:`status_detail` and :func:`token_refused`).
"""

from __future__ import annotations

import json
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
    "detail",
    "read_body",
    "read_json",
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


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it grows past `limit` bytes."""
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"request body larger than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


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


def detail(status: int, value: Any) -> JSONResponse:
    """FastAPI's error body (``{"detail": ...}``), which FastAPI servers' clients read."""
    return JSONResponse({"detail": value}, status)


async def status_detail(request: Request, exc: Exception) -> Response:
    """Starlette's own HTTP errors (404, 405) as FastAPI's error body."""
    assert isinstance(exc, HTTPException)
    return detail(exc.status_code, exc.detail)


async def token_refused(request: Request, exc: Exception) -> Response:
    """dsec's refusal of the caller's token: 401 (unknown) or 403 (not allowed)."""
    assert isinstance(exc, DSecError)
    status = 401 if isinstance(exc, Unauthenticated) else 403
    return detail(status, f"dsec refused the token: {exc.message}")
