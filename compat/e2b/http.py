"""HTTP for the E2B front end: the shared pieces (``compat.http``) and E2B's error body."""

from __future__ import annotations

from starlette.responses import JSONResponse, Response

from compat.http import HttpError, Request, bounded, decoded, read_body, read_json

__all__ = [
    "INTERNAL",
    "HttpError",
    "Request",
    "bounded",
    "decoded",
    "error",
    "internal_error",
    "read_body",
    "read_json",
]

INTERNAL = "internal error in dsec's E2B front end"


def error(status: int, message: str) -> JSONResponse:
    """E2B's error body ``{"code": status, "message": ...}`` (the SDK reads ``message`` and
    maps ``status`` to its exception classes)."""
    return JSONResponse({"code": status, "message": message}, status)


async def internal_error(request: Request, exc: Exception) -> Response:
    """The 500 of an exception of ours (Starlette re-raises it; ``E2bApp`` logs it)."""
    return error(500, INTERNAL)
