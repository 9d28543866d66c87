"""dsec's own gRPC tracing interceptors, as they were before OpenTelemetry's instrumentation.

Kept so that ``bench/bench_tracing.py`` can measure both in one run: a service uses these
instead of OpenTelemetry's when ``DSEC_TRACE_INTERCEPTORS=handwritten`` (see
:mod:`common.telemetry`). They propagate W3C context in call metadata and open a span per
call, named ``<svc>.<Service>.<Method>``; they record neither the status code nor dsec's reason.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode


def _span_name(service: str, method: str) -> str:
    # "/dsec.iam.v1.IamService/CreateProject" -> "iam.project.create"-like names
    # would need a table; "<svc>.<Service>.<Method>" is stable and greppable.
    _, _, tail = method.rpartition("/")
    svc = method.strip("/").split("/")[0].rsplit(".", 1)[-1]
    return f"{service}.{svc}.{tail}"


class _MetadataGetter:
    def get(self, carrier: Any, key: str) -> list[str] | None:
        for item in carrier or ():
            k, v = item
            if k == key:
                return [v]
        return None

    def keys(self, carrier: Any) -> list[str]:
        return [k for k, _ in carrier or ()]


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """Opens a SERVER span per call, continuing the caller's trace."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.tracer = trace.get_tracer(f"dsec.{service}")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        name = _span_name(self.service, details.method)
        parent = propagate.extract(details.invocation_metadata, getter=_MetadataGetter())  # type: ignore[arg-type]
        tracer = self.tracer

        def wrap_unary(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with tracer.start_as_current_span(
                    name, context=parent, kind=SpanKind.SERVER
                ) as span:
                    try:
                        return await fn(request, context)
                    except BaseException as exc:
                        _record(span, exc)
                        raise

            return call

        def wrap_stream(fn: Callable[..., Any]) -> Callable[..., Any]:
            # The span is current only while the handler runs (each step of its generator),
            # never across a `yield`: a stream the client cancels is closed at its yield, by
            # grpc, from another context, where detaching a context attached in this one
            # fails (OpenTelemetry logged "Failed to detach context" as an ERROR: found by
            # tests/fuzz cancelling watches).
            async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER)
                items = fn(request, context)
                try:
                    while True:
                        with trace.use_span(span, end_on_exit=False):
                            try:
                                item = await items.__anext__()
                            except StopAsyncIteration:
                                break
                        yield item
                except BaseException as exc:
                    _record(span, exc)
                    raise
                finally:
                    try:
                        await items.aclose()
                    finally:
                        span.end()

            return call

        replace: dict[str, Any] = {}
        for attr in ("unary_unary", "stream_unary"):
            fn = getattr(handler, attr)
            if fn is not None:
                replace[attr] = wrap_unary(fn)
        for attr in ("unary_stream", "stream_stream"):
            fn = getattr(handler, attr)
            if fn is not None:
                replace[attr] = wrap_stream(fn)
        return handler._replace(**replace)  # type: ignore[attr-defined,no-any-return]


def _record(span: trace.Span, exc: BaseException) -> None:
    code = getattr(exc, "code", None)
    span.set_attribute("rpc.error", type(exc).__name__)
    if callable(code):
        return
    span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))


class _ClientTracing:
    def __init__(self, service: str) -> None:
        self.service = service
        self.tracer = trace.get_tracer(f"dsec.{service}.client")

    def _start(self, details: grpc.aio.ClientCallDetails) -> tuple[Any, grpc.aio.ClientCallDetails]:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        span = self.tracer.start_span(
            _span_name(self.service, method) + ".call", kind=SpanKind.CLIENT
        )
        ctx = trace.set_span_in_context(span)
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=ctx)
        metadata = list(details.metadata or []) + list(carrier.items())
        new = grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=details.timeout,
            metadata=grpc.aio.Metadata(*metadata),
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )
        return span, new


class TracingUnaryUnary(_ClientTracing, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        span, details = self._start(details)
        start = time.perf_counter()
        try:
            call = await continuation(details, request)
            await call  # surfaces the status so the span can record it
            return call
        except grpc.aio.AioRpcError as exc:
            span.set_status(Status(StatusCode.ERROR, exc.code().name))
            raise
        finally:
            span.set_attribute("rpc.duration_ms", (time.perf_counter() - start) * 1000)
            span.end()


class TracingUnaryStream(_ClientTracing, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        span, details = self._start(details)
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            call = await continuation(details, request)
            call.add_done_callback(lambda _c: span.end())
            return call
        finally:
            otel_context.detach(token)


class TracingStreamUnary(_ClientTracing, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        span, details = self._start(details)
        call = await continuation(details, request_iterator)
        call.add_done_callback(lambda _c: span.end())
        return call


class TracingStreamStream(_ClientTracing, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        span, details = self._start(details)
        call = await continuation(details, request_iterator)
        call.add_done_callback(lambda _c: span.end())
        return call


def client_interceptors(service: str) -> list[grpc.aio.ClientInterceptor]:
    return [
        TracingUnaryUnary(service),
        TracingUnaryStream(service),
        TracingStreamUnary(service),
        TracingStreamStream(service),
    ]
