"""The front ends' metrics: HTTP requests by API, route, method and status, with durations.

An ASGI wrapper around each front end's app (E2B, SandboxFusion, SWE-ReX). The route is the
matched route's template as Starlette records it (``/sandboxes/{sandbox_id}``, never the
path with its ids); a request no route matched counts as ``unmatched``. A websocket or a
streamed response counts when it ends, with the status it started with.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from common.metrics import LATENCY_BUCKETS_S, Metrics

AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Methods counted by name; any other counts as OTHER (a client picks the method string).
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class HttpMetrics:
    def __init__(self, metrics: Metrics) -> None:
        m = metrics.meter
        self.requests = m.create_counter(
            "dsec_compat_http_requests",
            description="HTTP requests answered, by API, route, method and status",
        )
        self.duration = m.create_histogram(
            "dsec_compat_http_duration_seconds",
            unit="s",
            description="From request to the end of the response, by API and route",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )

    def wrap(self, api: str, app: AsgiApp) -> AsgiApp:
        """``app`` with each HTTP request counted under ``api`` (e2b, sandboxfusion, ...)."""

        async def counted(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            started = time.perf_counter()
            status = 500  # an app that raises before answering: uvicorn answers 500

            async def send_counted(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                await send(message)

            try:
                await app(scope, receive, send_counted)
            finally:
                route = _route(scope)
                method = scope.get("method", "")
                labels = {
                    "api": api,
                    "route": route,
                    "method": method if method in METHODS else "OTHER",
                    "status": str(status),
                }
                self.requests.add(1, labels)
                self.duration.record(time.perf_counter() - started, {"api": api, "route": route})

        return counted


def _route(scope: Scope) -> str:
    """The template of the route that served the request (Starlette's ``scope["route"]``)."""
    route: Any = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else "unmatched"
