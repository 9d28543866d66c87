"""HTTP for the E2B front end: the shared pieces (``compat.http``) and E2B's error body."""

from __future__ import annotations

from compat.http import (
    ClientDisconnected,
    HttpError,
    Message,
    Receive,
    Request,
    Scope,
    Send,
    send_bytes,
    send_empty,
    send_json,
)

__all__ = [
    "ClientDisconnected",
    "HttpError",
    "Message",
    "Receive",
    "Request",
    "Scope",
    "Send",
    "send_bytes",
    "send_empty",
    "send_error",
    "send_json",
]


async def send_error(send: Send, status: int, message: str) -> None:
    """E2B's error body ``{"code": status, "message": ...}`` (the SDK reads ``message`` and
    maps ``status`` to its exception classes)."""
    await send_json(send, status, {"code": status, "message": message})
