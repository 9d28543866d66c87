"""Structured logs and OpenTelemetry tracing for the services.

Logs: one JSON object per line on stderr (``ts``, ``level``, ``logger``,
``msg``, the active ``trace_id``, and any ``extra=`` fields).

Traces (see docs/observe-traces.md): gRPC spans come from OpenTelemetry's own gRPC
instrumentation (``opentelemetry-instrumentation-grpc``), which propagates W3C trace context
in call metadata and records ``rpc.grpc.status_code``; the boundary (common/grpc_server.py)
adds dsec's reason (:func:`record_error`). Two things are ours:

- Server streams: the library keeps a stream's span current across its ``yield``; a stream
  the client cancels is closed at the yield by grpc from another context, where detaching
  fails ("Failed to detach context", an ERROR found by tests/fuzz). Here a stream's span is
  current only while the handler runs (each step of its generator).
- Who starts a trace: only the front doors (the API server, the compatibility front ends,
  and the SDK when its caller configures a tracer). Internal services continue traces but
  never start one, and no service's client call opens a span outside a trace: background
  probes, heartbeats and registrations make no traces (:func:`setup_tracing`).

What records and exports the spans is dsec's tracer provider (common/tracer.py: the API's
calls answered at a fraction of the SDK's cost per span). Without an OTLP endpoint nothing is
recorded (context is still propagated, so trace ids appear in logs).

A span recorded inside a sandbox, where no OpenTelemetry runs (memory), comes back to the
edge in the frames and is exported here on the sandbox's behalf
(:func:`record_in_sandbox_span`).

``DSEC_TRACE_INTERCEPTORS=handwritten`` selects dsec's former interceptors
(common/tracing_handwritten.py) instead of the library's, ``DSEC_TRACE_PROVIDER=sdk`` the
OpenTelemetry SDK's provider instead of dsec's: bench/bench_tracing.py compares them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors
from opentelemetry.instrumentation.grpc._aio_server import (
    OpenTelemetryAioServerInterceptor,
    _OpenTelemetryAioServicerContext,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from common import tracer

_STD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            out["trace_id"] = f"{ctx.trace_id:032x}"
            out["span_id"] = f"{ctx.span_id:016x}"
        for key, value in record.__dict__.items():
            if key not in _STD_ATTRS and not key.startswith("_"):
                out[key] = (
                    value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
                )
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))


def setup_logging(service: str, level: str = "INFO", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


# ------------------------------------------------------------------------------- tracing

#: Selects the gRPC interceptors: "otel" (default, OpenTelemetry's) or "handwritten".
INTERCEPTORS_ENV = "DSEC_TRACE_INTERCEPTORS"

#: gRPC status codes that are the server's failure, not the caller's (OpenTelemetry's
#: semantic conventions for RPC server spans): only these make a server span's status ERROR.
SERVER_FAILURES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)

#: Calls never traced: health checks (supervisord, `dsec status`, the watcher's probes) and
#: reflection (`dsec grpc`) would be one root span each.
_UNTRACED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")

#: Selects the tracer provider: "dsec" (default, common/tracer.py) or "sdk" (OpenTelemetry's).
PROVIDER_ENV = "DSEC_TRACE_PROVIDER"

#: What exports spans recorded elsewhere (inside sandboxes); set by setup_tracing when this
#: process exports.
_exporting: tracer.TracerProvider | SpanProcessor | None = None


def setup_tracing(
    service: str,
    otlp_endpoint: str = "",
    *,
    starts_traces: bool = False,
    sample_ratio: float = 1.0,
) -> trace.TracerProvider:
    """Installs the global tracer provider; exports over OTLP only when asked.

    ``starts_traces``: a call that arrives without a trace context starts one, kept with
    probability ``sample_ratio`` (the front doors: API server, compatibility front ends).
    Otherwise the service only continues its callers' traces (their sampling decision is
    kept), so that background calls between services (probes, heartbeats, registrations) and
    an operator's direct calls leave no trace.

    Without an exporter nothing is recorded: context, trace ids in logs and propagation to
    other services still work, but nothing is kept that nobody would read.
    """
    global _exporting
    ratio = (
        (1.0 if sample_ratio >= 1.0 else sample_ratio) if starts_traces and otlp_endpoint else 0.0
    )
    if os.environ.get(PROVIDER_ENV, "dsec") == "sdk":
        provider: trace.TracerProvider = _sdk_provider(service, otlp_endpoint, ratio)
    else:
        exporter = tracer.OtlpExporter(otlp_endpoint) if otlp_endpoint else None
        provider = tracer.TracerProvider(service, ratio, exporter)
        _exporting = provider if exporter else None
    trace.set_tracer_provider(provider)
    return provider


def _sdk_provider(service: str, otlp_endpoint: str, ratio: float) -> trace.TracerProvider:
    """OpenTelemetry's SDK provider, batch processor and OTLP exporter, as before
    common/tracer.py (``DSEC_TRACE_PROVIDER=sdk``: what bench/bench_tracing.py compares)."""
    global _exporting
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, TraceIdRatioBased

    root = ALWAYS_OFF if ratio <= 0 else ALWAYS_ON if ratio >= 1 else TraceIdRatioBased(ratio)
    provider = TracerProvider(
        resource=Resource.create({"service.name": f"dsec-{service}"}),
        sampler=ParentBased(root),
    )
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        _exporting = BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True))
        provider.add_span_processor(_exporting)
    return provider


def _handwritten() -> bool:
    return os.environ.get(INTERCEPTORS_ENV, "otel") == "handwritten"


def _traced_call(details: Any) -> bool:
    method = details.method
    if isinstance(method, bytes):  # a client call's details (grpc issue 31092)
        method = method.decode()
    return not method.startswith(_UNTRACED_PREFIXES)


def _in_a_trace(details: Any) -> bool:
    """A service's outgoing call opens a span only inside a trace: a call from a background
    loop (a probe, a heartbeat) neither starts one nor carries a context."""
    return trace.get_current_span().get_span_context().is_valid and _traced_call(details)


def server_interceptors(
    service: str, tracer_provider: trace.TracerProvider | None = None
) -> list[grpc.aio.ServerInterceptor]:
    """The tracing interceptor of a service's gRPC server (``tracer_provider``: the global
    one by default)."""
    if _handwritten():
        from common.tracing_handwritten import TracingServerInterceptor

        return [TracingServerInterceptor(service)]
    tracer = trace.get_tracer("opentelemetry.instrumentation.grpc", tracer_provider=tracer_provider)
    return [_ServerInterceptor(tracer, filter_=_traced_call)]


def client_interceptors(service: str) -> list[grpc.aio.ClientInterceptor]:
    """The tracing interceptors of a service's outgoing channels."""
    if _handwritten():
        from common.tracing_handwritten import client_interceptors as handwritten

        return handwritten(service)
    return aio_client_interceptors(filter_=_in_a_trace)  # type: ignore[no-any-return]


class _ServerInterceptor(OpenTelemetryAioServerInterceptor):  # type: ignore[misc]
    """OpenTelemetry's server interceptor, with three changes. Its server streams do not keep
    their span current across a ``yield`` (see the module's docstring). And two savings that
    bench/bench_tracing.py priced (the library's interceptor cost ~40 us more CPU per call than
    dsec's former one, most of it in these): a span carries the ``rpc.*`` attributes only, not
    the peer's address and user agent parsed from the call for every call (a cluster's peers
    are its own services, on Unix sockets in a local cluster); and a call without trace
    context attaches none (the library extracts and attaches an empty one)."""

    @contextlib.contextmanager
    def _set_remote_context(self, servicer_context: Any) -> Iterator[None]:
        metadata = servicer_context.invocation_metadata() or ()
        carrier = {md.key: md.value for md in metadata if md.key in _PROPAGATED_KEYS}
        if not carrier:
            yield
            return
        token = otel_context.attach(propagate.extract(carrier))
        try:
            yield
        finally:
            otel_context.detach(token)

    def _start_span(
        self, handler_call_details: Any, context: Any, set_status_on_exception: bool = False
    ) -> Any:
        return self._tracer.start_as_current_span(
            name=handler_call_details.method,
            kind=SpanKind.SERVER,
            attributes=_rpc_attributes(handler_call_details.method),
            set_status_on_exception=set_status_on_exception,
        )

    def _intercept_aio_server_stream(
        self, behavior: Callable[..., AsyncGenerator[Any]], details: grpc.HandlerCallDetails
    ) -> Callable[..., AsyncIterator[Any]]:
        tracer = self._tracer
        attributes = _rpc_attributes(details.method)

        async def stream(request_or_iterator: Any, context: Any) -> AsyncIterator[Any]:
            metadata = context.invocation_metadata() or ()
            carrier = {md.key: md.value for md in metadata if md.key in _PROPAGATED_KEYS}
            parent = propagate.extract(carrier) if carrier else None
            span = tracer.start_span(
                details.method, context=parent, kind=SpanKind.SERVER, attributes=attributes
            )
            items = behavior(request_or_iterator, _OpenTelemetryAioServicerContext(context, span))
            try:
                while True:
                    with trace.use_span(span, end_on_exit=False, record_exception=False):
                        try:
                            item = await items.__anext__()
                        except StopAsyncIteration:
                            break
                    yield item
            except (GeneratorExit, asyncio.CancelledError):
                span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.CANCELLED.value[0])
                raise
            except grpc.aio.AbortError:
                raise  # recorded by the servicer context's abort
            except BaseException as exc:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                raise
            finally:
                try:
                    await items.aclose()
                finally:
                    span.end()

        return stream


#: The metadata keys of W3C trace context (what the global propagator reads).
_PROPAGATED_KEYS = frozenset({"traceparent", "tracestate", "baggage"})


@functools.lru_cache(maxsize=1024)
def _rpc_attributes(full_method: str) -> Mapping[str, str | int]:
    """A server span's attributes at its start (OpenTelemetry's RPC conventions); the status
    code is the call's until it fails (the servicer context's abort, :func:`record_error`)."""
    service, _, method = full_method.lstrip("/").partition("/")
    return MappingProxyType(
        {
            "rpc.system": "grpc",
            "rpc.service": service,
            "rpc.method": method,
            "rpc.grpc.status_code": grpc.StatusCode.OK.value[0],
        }
    )


def record_error(code: grpc.StatusCode, reason: str) -> None:
    """Marks the current server span with a failed call's status code and dsec's reason
    (``dsec.reason``); its status is ERROR for a server-side failure (:data:`SERVER_FAILURES`),
    not for the caller's own error (NOT_FOUND, INVALID_ARGUMENT, ...)."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    span.set_attribute("dsec.reason", reason)
    if code in SERVER_FAILURES:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {reason}"))


def traceparent_for_sandbox() -> str:
    """The W3C ``traceparent`` of the current span for a call into a sandbox: "" unless the
    span is recorded and this process exports what the sandbox will send back."""
    if _exporting is None:
        return ""
    ctx = trace.get_current_span().get_span_context()
    if not (ctx.is_valid and ctx.trace_flags.sampled):
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"


_SCOPE = InstrumentationScope("dsec.insandbox")
_resources: dict[str, Resource] = {}


def record_in_sandbox_span(
    service: str,
    name: str,
    *,
    trace_id: bytes,
    parent_span_id: bytes,
    span_id: bytes,
    start_unix_ns: int,
    end_unix_ns: int,
    attributes: Mapping[str, str | int | bool],
    error: str = "",
) -> None:
    """Exports a span recorded inside a sandbox (by ``service``, e.g. chronus, which runs no
    OpenTelemetry) as that service's: its resource's service.name is ``dsec-<service>``.
    Ids that are not 16/8/8 bytes (a misbehaving sandbox) drop the span."""
    if _exporting is None or len(trace_id) != 16 or len(parent_span_id) != 8:
        return
    if len(span_id) != 8 or not any(span_id) or end_unix_ns < start_unix_ns:
        return
    tid = int.from_bytes(trace_id, "big")
    sampled = TraceFlags(TraceFlags.SAMPLED)
    context = SpanContext(tid, int.from_bytes(span_id, "big"), False, sampled)
    parent = SpanContext(tid, int.from_bytes(parent_span_id, "big"), False, sampled)
    status = Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET)
    if isinstance(_exporting, tracer.TracerProvider):
        _exporting.record(
            service, name, context, parent, start_unix_ns, end_unix_ns, attributes, status
        )
        return
    resource = _resources.get(service)
    if resource is None:
        resource = _resources[service] = Resource.create({"service.name": f"dsec-{service}"})
    span = ReadableSpan(
        name,
        # A span recorded elsewhere is handed over whole: ReadableSpan is what the SDK's span
        # processors take (the SDK's Tracer would give it an id and times of its own).
        context=context,
        parent=parent,
        resource=resource,
        attributes=dict(attributes),
        kind=SpanKind.INTERNAL,
        status=status,
        start_time=start_unix_ns,
        end_time=end_unix_ns,
        instrumentation_scope=_SCOPE,
    )
    _exporting.on_end(span)
