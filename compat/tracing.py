"""Traces through the compatibility front ends: an HTTP request continues its caller's trace.

:func:`traced` wraps a front end's ASGI app: a request's W3C ``traceparent`` (and
``tracestate``) header, if any, is the parent of a SERVER span for the request, current while
the app runs, so the libdsec calls it makes on the caller's behalf carry the same trace to the
API server (libdsec adds OpenTelemetry's gRPC interceptors once a tracer provider is set:
``compat/server.py`` sets one). A request without the header starts a trace (sampled by
``DSEC_COMPAT_TRACE_SAMPLE_RATIO``); a malformed header is ignored, as if absent, never an error.
``/health`` (probes, the virtual IP's route agent) is not traced.
"""

from __future__ import annotations

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from compat.http import ASGIApp, Message, Receive, Scope, Send

_PROPAGATED = (b"traceparent", b"tracestate")


def traced(app: ASGIApp, front_end: str) -> ASGIApp:
    """``app`` with a span per HTTP request, named ``<front_end> <METHOD>``."""
    tracer = trace.get_tracer("dsec.compat")

    async def with_span(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "").rstrip("/") == "/health":
            await app(scope, receive, send)
            return
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope.get("headers", ())
            if name in _PROPAGATED
        }
        parent = propagate.extract(carrier) if carrier else None
        method = scope.get("method", "")
        with tracer.start_as_current_span(
            f"{front_end} {method}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": scope.get("path", "")},
            record_exception=True,
            set_status_on_exception=True,
        ) as span:

            async def send_and_note(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
                await send(message)

            await app(scope, receive, send_and_note)

    return with_span
