"""The little HTTP the compatibility front ends need on top of raw ASGI (no web framework).

Each front end is a handful of routes (E2B's control API, files and port traffic beside the
connectrpc services; SandboxFusion's ``/run_code``), so a request object, JSON responses and a
streamed body are all that is needed. How an error body looks is each front end's own
(``compat.e2b.http.send_error``, ``compat.sandboxfusion.app``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class HttpError(Exception):
    """An HTTP error status and its message; each front end renders the body its clients read."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ClientDisconnected(Exception):
    """The client went away while its request body was being read."""


@dataclass
class Request:
    scope: Scope
    receive: Receive

    @property
    def method(self) -> str:
        return str(self.scope["method"])

    @property
    def path(self) -> str:
        return str(self.scope["path"])

    @property
    def raw_query(self) -> str:
        return bytes(self.scope.get("query_string", b"")).decode("latin-1")

    def query(self, name: str) -> str | None:
        """The first value of a query parameter (decoded), or None."""
        values = parse_qs(self.raw_query, keep_blank_values=True).get(name)
        return values[0] if values else None

    def query_all(self, name: str) -> list[str]:
        return parse_qs(self.raw_query, keep_blank_values=True).get(name, [])

    def header(self, name: str) -> str:
        """A request header (case-insensitive; the first if repeated), "" if absent."""
        key = name.lower().encode("latin-1")
        for k, v in self.scope.get("headers", ()):
            if k.lower() == key:
                return bytes(v).decode("latin-1")
        return ""

    @property
    def headers(self) -> list[tuple[str, str]]:
        return [
            (bytes(k).decode("latin-1"), bytes(v).decode("latin-1"))
            for k, v in self.scope.get("headers", ())
        ]

    async def stream(self) -> AsyncIterator[bytes]:
        """The body as it arrives (never whole in memory)."""
        while True:
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                raise ClientDisconnected()
            body = msg.get("body", b"")
            if body:
                yield bytes(body)
            if not msg.get("more_body", False):
                return

    async def body(self, limit: int) -> bytes:
        parts: list[bytes] = []
        size = 0
        async for chunk in self.stream():
            size += len(chunk)
            if size > limit:
                raise HttpError(413, f"request body larger than {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def json(self, limit: int) -> dict[str, Any]:
        raw = await self.body(limit)
        if not raw.strip():
            return {}
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise HttpError(400, f"request body is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise HttpError(400, "request body must be a JSON object")
        return value


async def send_bytes(
    send: Send,
    status: int,
    body: bytes = b"",
    *,
    content_type: str = "",
    headers: Iterable[tuple[str, str]] = (),
) -> None:
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    if content_type:
        raw.append((b"content-type", content_type.encode("latin-1")))
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(
    send: Send, status: int, value: Any, *, headers: Iterable[tuple[str, str]] = ()
) -> None:
    body = json.dumps(value, separators=(",", ":")).encode()
    await send_bytes(send, status, body, content_type="application/json", headers=headers)


async def send_empty(send: Send, status: int = 204) -> None:
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
