"""The tracing of the gRPC boundary, in process: a real grpc.aio server built as every
service's is (``service_handler`` behind ``server_interceptors``), called over a real
channel, its spans kept by an in-memory exporter of its own tracer provider (the global one
is left alone). Also the in-sandbox side's traceparent parsing (chronus.tracing) and the
SDK's "off unless configured" (in a fresh interpreter: the provider is process-wide)."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from chronus.tracing import command_span, parse_traceparent
from common import tracer
from common.grpc_server import find_service, service_handler
from common.telemetry import server_interceptors
from dsec.watcher.v1 import watcher_pb2
from libdsec.errors import NotFound, Unavailable

ROOT = Path(__file__).resolve().parents[2]
WATCHER = "dsec.watcher.v1.WatcherService"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Servicer:
    """A watcher whose calls fail on demand: what the boundary makes of each failure."""

    async def GetEdgeHealth(self, request: Any, context: Any) -> Any:
        if request.edge_id == "missing":
            raise NotFound("no such edge", reason="EDGE_NOT_FOUND")
        if request.edge_id == "down":
            raise Unavailable("the store is away", reason="STORE_UNAVAILABLE")
        if request.edge_id == "bug":
            raise RuntimeError("a bug")
        return watcher_pb2.GetEdgeHealthResponse()

    async def WatchCluster(self, request: Any, context: Any) -> AsyncIterator[Any]:
        while True:
            yield watcher_pb2.WatchClusterResponse()
            await asyncio.sleep(0.01)


class Recorded:
    """dsec's provider's spans (common/tracer.py), read as the SDK's in-memory exporter's."""

    def __init__(self) -> None:
        self.spans: list[tracer.RecordedSpan] = []

    def put(self, span: tracer.RecordedSpan) -> None:
        self.spans.append(span)

    def get_finished_spans(self) -> tuple[tracer.RecordedSpan, ...]:
        return tuple(self.spans)

    def clear(self) -> None:
        self.spans.clear()


@pytest.fixture(params=["sdk", "dsec"])
async def traced_watcher(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[grpc.aio.Channel, InMemorySpanExporter]]:
    """Every span recorded, by OpenTelemetry's SDK or by dsec's provider (the services')."""
    provider: trace.TracerProvider
    if request.param == "sdk":
        exporter: Any = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        exporter = Recorded()
        provider = tracer.TracerProvider("watcher", 1.0, exporter)
    server = grpc.aio.server(interceptors=server_interceptors("watcher", provider))
    server.add_generic_rpc_handlers((service_handler(Servicer(), find_service(WATCHER)),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, exporter
    finally:
        await channel.close()
        await server.stop(None)


async def _health(
    channel: grpc.aio.Channel, edge_id: str, metadata: tuple[tuple[str, str], ...] = ()
) -> grpc.StatusCode:
    call = channel.unary_unary(
        f"/{WATCHER}/GetEdgeHealth",
        request_serializer=watcher_pb2.GetEdgeHealthRequest.SerializeToString,
        response_deserializer=watcher_pb2.GetEdgeHealthResponse.FromString,
    )
    try:
        await call(watcher_pb2.GetEdgeHealthRequest(edge_id=edge_id), metadata=metadata, timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def _only(exporter: InMemorySpanExporter) -> ReadableSpan:
    """The one span the call made, once it ended: the server may end it just after the
    client has its answer."""
    for _ in range(500):
        if exporter.get_finished_spans():
            break
        await asyncio.sleep(0.01)
    (span,) = exporter.get_finished_spans()
    exporter.clear()
    return span


@pytest.mark.parametrize(
    ("edge_id", "code", "reason", "error_status"),
    [
        ("missing", grpc.StatusCode.NOT_FOUND, "EDGE_NOT_FOUND", False),  # the caller's error
        ("down", grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE", True),
        ("bug", grpc.StatusCode.INTERNAL, "INTERNAL", True),
    ],
)
async def test_a_failed_call_span_has_its_status_code_and_reason(
    traced_watcher: tuple[grpc.aio.Channel, InMemorySpanExporter],
    edge_id: str,
    code: grpc.StatusCode,
    reason: str,
    error_status: bool,
) -> None:
    channel, exporter = traced_watcher
    assert await _health(channel, edge_id) == code
    span = await _only(exporter)
    assert span.name == f"/{WATCHER}/GetEdgeHealth"
    assert span.attributes is not None
    assert span.attributes["rpc.grpc.status_code"] == code.value[0]
    assert span.attributes["dsec.reason"] == reason
    assert (span.status.status_code == StatusCode.ERROR) is error_status


async def test_a_call_continues_its_callers_trace(
    traced_watcher: tuple[grpc.aio.Channel, InMemorySpanExporter],
) -> None:
    channel, exporter = traced_watcher
    traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
    assert await _health(channel, "e1", (("traceparent", traceparent),)) == grpc.StatusCode.OK
    span = await _only(exporter)
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_ID
    assert span.attributes is not None and span.attributes["rpc.grpc.status_code"] == 0


@pytest.mark.parametrize(
    "traceparent",
    [
        "garbage",
        f"00-{TRACE_ID}-{PARENT_ID}",  # no flags
        f"00-{'0' * 32}-{PARENT_ID}-01",  # all-zero trace id
        f"00-{TRACE_ID[:-1]}x-{PARENT_ID}-01",  # not hex
        "ff-" + "1" * 32 + "-" + "1" * 16 + "-01",  # version ff is invalid
        "00-" + "1" * 3000,  # long
    ],
)
async def test_a_malformed_traceparent_in_metadata_is_ignored(
    traced_watcher: tuple[grpc.aio.Channel, InMemorySpanExporter], traceparent: str
) -> None:
    channel, exporter = traced_watcher
    assert await _health(channel, "e1", (("traceparent", traceparent),)) == grpc.StatusCode.OK
    span = await _only(exporter)
    assert span.parent is None  # a trace of its own, as without the header
    assert span.context.trace_id != 0


async def test_a_cancelled_stream_ends_its_span_and_logs_no_error(
    traced_watcher: tuple[grpc.aio.Channel, InMemorySpanExporter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    channel, exporter = traced_watcher
    stream = channel.unary_stream(
        f"/{WATCHER}/WatchCluster",
        request_serializer=watcher_pb2.WatchClusterRequest.SerializeToString,
        response_deserializer=watcher_pb2.WatchClusterResponse.FromString,
    )
    with caplog.at_level(logging.ERROR):
        call = stream(watcher_pb2.WatchClusterRequest())
        for _ in range(3):
            await call.read()
        call.cancel()

        span = await _only(exporter)  # the server learns of the cancellation a moment later
    assert span.name == f"/{WATCHER}/WatchCluster"
    assert span.attributes is not None
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert span.status.status_code != StatusCode.ERROR
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_health_checks_are_not_traced() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = grpc.aio.server(interceptors=server_interceptors("watcher", provider))
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        assert exporter.get_finished_spans() == ()
    finally:
        await server.stop(None)


# ------------------------------------------------------------------ inside the sandbox


def test_chronus_reads_a_sampled_traceparent() -> None:
    assert parse_traceparent(f"00-{TRACE_ID}-{PARENT_ID}-01") == (
        bytes.fromhex(TRACE_ID),
        bytes.fromhex(PARENT_ID),
    )
    assert parse_traceparent(f"00-{TRACE_ID}-{PARENT_ID}-03") is not None  # other flags too


@pytest.mark.parametrize(
    "value",
    [
        "",
        "garbage",
        f"00-{TRACE_ID}-{PARENT_ID}-00",  # not sampled: the edge records nothing either
        f"01-{TRACE_ID}-{PARENT_ID}-01",  # a version this side does not know
        f"00-{TRACE_ID.upper()}-{PARENT_ID}-01",  # W3C: lowercase hex only
        f"00-{'0' * 32}-{PARENT_ID}-01",
        f"00-{TRACE_ID}-{'0' * 16}-01",
        f"00-{TRACE_ID}-{PARENT_ID}-01-extra",
        f"00-{TRACE_ID}-{PARENT_ID}-zz",
        "00-" + "-" * 50,
    ],
)
def test_chronus_ignores_a_malformed_traceparent(value: str) -> None:
    assert parse_traceparent(value) is None


def test_a_command_span_runs_from_start_to_exit() -> None:
    trace_ids = (bytes.fromhex(TRACE_ID), bytes.fromhex(PARENT_ID))
    span = command_span(trace_ids, 1700000000.25, {"duration_s": 1.5, "exit_code": 0})
    assert span["trace_id"] == trace_ids[0] and span["parent_span_id"] == trace_ids[1]
    assert len(span["span_id"]) == 8
    assert abs(span["start_unix_ns"] - 1_700_000_000_250_000_000) < 1000  # float seconds
    assert span["end_unix_ns"] - span["start_unix_ns"] == 1_500_000_000


# --------------------------------------------------------------------------------- SDK

SDK_CHECK = """
import sys
from libdsec import Client
from libdsec._transport import tracing_interceptors

assert tracing_interceptors() is None
Client("127.0.0.1:1", token="t").close()  # a client made and closed, never called
assert "opentelemetry.trace" not in sys.modules, "the SDK imported OpenTelemetry"

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

assert tracing_interceptors() is None  # imported, but no provider set
trace.set_tracer_provider(TracerProvider())
assert len(tracing_interceptors() or []) == 4
print("ok")
"""


def test_the_sdk_traces_only_once_its_caller_sets_a_tracer_provider() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SDK_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_sync_client_carries_the_callers_context_to_its_loop() -> None:
    """The sync Client runs its calls on a loop thread of its own: the caller's current span
    (contextvars) must be current there, or its calls would start traces of their own."""
    from libdsec.sync import _Loop

    provider = TracerProvider()
    tracer = provider.get_tracer("test")
    loop = _Loop()
    try:

        async def current_trace_id() -> int:
            return trace.get_current_span().get_span_context().trace_id

        with tracer.start_as_current_span("caller") as span:
            assert loop.run(current_trace_id()) == span.get_span_context().trace_id
        token = otel_context.attach(propagate.extract({}))
        try:
            assert loop.run(current_trace_id()) == 0
        finally:
            otel_context.detach(token)
    finally:
        loop.close()
