"""dsec's tracer provider (common/tracer.py) against OpenTelemetry's SDK, its reference: the same
spans made through the API by each, exported over OTLP/gRPC to a real receiver (a grpc server
with OpenTelemetry's own protobuf service), arrive equal but for ids and times. Then what is
dsec's own: sampling decisions equal to the SDK's samplers, nothing recorded without an
exporter, and an exporter whose receiver is down drops and counts, logging once."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider as SdkProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from common import tracer

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[str, str, trace_pb2.Span]]:
        """(service.name, scope name, span) of everything received, in order."""
        out = []
        for request in self.requests:
            for rs in request.resource_spans:
                (service,) = [
                    a.value.string_value for a in rs.resource.attributes if a.key == "service.name"
                ]
                for ss in rs.scope_spans:
                    out += [(service, ss.scope.name, span) for span in ss.spans]
        return out


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    rec = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield rec, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def _scenario(provider: trace.TracerProvider) -> None:
    """Spans using everything the API offers that dsec's code and the gRPC instrumentation use."""
    tr = provider.get_tracer(
        "dsec.test", "1.2", schema_url="https://opentelemetry.io/schemas/1.11.0"
    )
    remote = propagate.extract(
        {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01", "tracestate": "rojo=00f067aa0ba902b7"}
    )
    with tr.start_as_current_span(
        "/dsec.apiserver.v1.ExecService/Exec",
        context=remote,
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.grpc.status_code": 0, "negative": -5},
    ) as server_span:
        server_span.set_attribute("dsec.reason", "SANDBOX_NOT_FOUND")
        server_span.set_attribute("ratio", 0.25)
        server_span.set_attribute("ok", True)
        server_span.set_attribute("ids", ["a", "b"])
        server_span.set_attribute("numbers", (1, 2, 3))
        server_span.set_attribute("blob", b"\x00\x01")
        server_span.set_attribute("nested", {"a": 1, "b": ["x", None]})
        server_span.set_attribute("mixed", [1, "a"])
        server_span.set_attribute("unknown", object())  # type: ignore[arg-type]  # kept as None
        server_span.add_event("queued", {"position": 3, "ok": True})  # also a span attribute
        server_span.set_status(Status(StatusCode.ERROR, "UNAVAILABLE: the store is away"))
        with tr.start_as_current_span(
            "/dsec.edge.v1.EdgeService/Exec",
            kind=SpanKind.CLIENT,
            links=[Link(server_span.get_span_context(), {"why": "retry"})],
        ) as client_span:
            client_span.set_status(StatusCode.OK)
            client_span.set_status(StatusCode.ERROR, "too late: OK is final")
        with pytest.raises(ValueError), tr.start_as_current_span("internal.failure"):
            raise ValueError("bad input")
        span = tr.start_span("many attributes")
        for i in range(tracer.MAX_ATTRIBUTES + 5):
            span.set_attribute(f"k{i}", i)
        span.update_name("many attributes, renamed")
        span.end()
        span.set_attribute("after end", 1)  # ignored
        span.end()  # once only
    provider.force_flush()  # type: ignore[attr-defined]


def _normal(
    service: str, scope: str, span: trace_pb2.Span, names: dict[bytes, str]
) -> dict[str, Any]:
    """What must agree: everything but ids (parents by name), times and the stack trace's
    text (which frames it holds depends on the caller)."""
    events = []
    for ev in span.events:
        attrs = {a.key: a.value for a in ev.attributes}
        if "exception.stacktrace" in attrs:
            assert "ValueError: bad input" in attrs.pop("exception.stacktrace").string_value
        events.append(
            (ev.name, sorted(attrs.items(), key=lambda kv: kv[0]), ev.dropped_attributes_count)
        )
    return {
        "service": service,
        "scope": scope,
        "name": span.name,
        "kind": span.kind,
        "parent": names.get(span.parent_span_id, span.parent_span_id.hex()),
        "trace_state": span.trace_state,
        "attributes": [(a.key, a.value.SerializeToString()) for a in span.attributes],
        "dropped_attributes": span.dropped_attributes_count,
        "events": [(n, [(k, v.SerializeToString()) for k, v in a], d) for n, a, d in events],
        "links": [
            (
                names.get(link.span_id),
                [(a.key, a.value.SerializeToString()) for a in link.attributes],
                link.flags,
            )
            for link in span.links
        ],
        "status": (span.status.code, span.status.message),
        "flags": span.flags,
        "ordered": span.start_time_unix_nano <= span.end_time_unix_nano,
    }


def _received(rec: Receiver) -> list[dict[str, Any]]:
    got = rec.spans()
    names = {span.span_id: span.name for _, _, span in got}
    return [_normal(service, scope, span, names) for service, scope, span in got]


def test_the_same_spans_arrive_as_the_sdk_sends_them(receiver: tuple[Receiver, str]) -> None:
    rec, endpoint = receiver
    sdk = SdkProvider(resource=Resource.create({"service.name": "dsec-test"}))
    sdk.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    _scenario(sdk)
    sdk.shutdown()
    from_sdk = _received(rec)
    rec.requests.clear()

    exporter = tracer.OtlpExporter(endpoint)
    ours = tracer.TracerProvider("test", 1.0, exporter)
    _scenario(ours)
    ours.shutdown()
    from_dsec = _received(rec)

    assert len(from_sdk) == 4, from_sdk
    by_name = lambda spans: sorted(spans, key=lambda s: s["name"])  # noqa: E731
    assert by_name(from_dsec) == by_name(from_sdk)
    assert exporter.exported == 4 and exporter.dropped == 0
    # And what they say, read through the protobuf classes: not only equal, but right.
    server = next(s for s in from_dsec if s["name"].endswith("ExecService/Exec"))
    assert server["parent"] == "00f067aa0ba902b7" and server["flags"] == 0x300  # remote parent
    assert server["trace_state"] == "rojo=00f067aa0ba902b7"
    assert server["status"] == (StatusCode.ERROR.value, "UNAVAILABLE: the store is away")
    keys = [k for k, _ in server["attributes"]]
    assert {"nested", "mixed", "unknown", "ids", "blob"} <= set(keys)
    many = next(s for s in from_dsec if s["name"] == "many attributes, renamed")
    assert len(many["attributes"]) == tracer.MAX_ATTRIBUTES and many["dropped_attributes"] == 5
    failure = next(s for s in from_dsec if s["name"] == "internal.failure")
    assert failure["status"] == (StatusCode.ERROR.value, "ValueError: bad input")
    (event,) = failure["events"]
    assert event[0] == "exception"


def test_root_sampling_decides_as_the_sdks_ratio_sampler() -> None:
    rng = random.Random(7)
    for ratio in (0.0, 0.01, 0.3, 1.0):
        ours = tracer.TracerProvider("test", ratio, tracer_sink := _Sink())
        sdk = ParentBased(TraceIdRatioBased(ratio))
        for _ in range(300):
            trace_id = rng.getrandbits(128)
            expected = sdk.should_sample(None, trace_id, "x").decision.is_sampled()
            assert ((trace_id & (2**64 - 1)) < ours.root_bound) is expected, (ratio, trace_id)
        spans = [ours.get_tracer("t").start_span("root") for _ in range(200)]
        recorded = sum(s.is_recording() for s in spans)
        assert recorded == sum(s.get_span_context().trace_flags.sampled for s in spans)
        if ratio in (0.0, 1.0):
            assert recorded == 200 * ratio
        for s in spans:
            s.end()
        assert len(tracer_sink.spans) == recorded


class _Sink:
    def __init__(self) -> None:
        self.spans: list[tracer.RecordedSpan] = []

    def put(self, span: tracer.RecordedSpan) -> None:
        self.spans.append(span)


@pytest.mark.parametrize("sampled", [True, False])
def test_a_callers_decision_is_kept_and_only_an_exporting_process_records(sampled: bool) -> None:
    flags = "01" if sampled else "00"
    remote = propagate.extract({"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-{flags}"})
    sink = _Sink()
    recording = tracer.TracerProvider("test", 0.0, sink).get_tracer("t")
    silent = tracer.TracerProvider("test", 1.0, None).get_tracer("t")
    for tr, records in ((recording, sampled), (silent, False)):
        span = tr.start_span("child", context=remote)
        ctx = span.get_span_context()
        assert format(ctx.trace_id, "032x") == TRACE_ID  # the trace goes on either way
        assert ctx.trace_flags.sampled is sampled  # and so does the caller's decision
        assert span.is_recording() is records
        span.end()
    assert len(sink.spans) == (1 if sampled else 0)
    # Without a parent and without an exporter: a valid context (logs, propagation), no record.
    root = silent.start_span("root")
    assert root.get_span_context().is_valid and not root.is_recording()


def test_an_unreachable_receiver_drops_counts_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket_nobody_listens_on() as endpoint:
        exporter = tracer.OtlpExporter(endpoint)
        tr = tracer.TracerProvider("test", 1.0, exporter).get_tracer("t")
        with caplog.at_level(logging.WARNING, logger="common.tracer"):
            for _ in range(2):
                for _ in range(3):
                    tr.start_span("lost").end()
                assert exporter.flush(5.0) is False
        exporter.shutdown()
    assert exporter.dropped == 6 and exporter.exported == 0
    warnings = [r for r in caplog.records if "spans are dropped" in r.getMessage()]
    assert len(warnings) == 1, caplog.text


def test_a_full_queue_drops_and_counts(
    monkeypatch: pytest.MonkeyPatch, receiver: tuple[Receiver, str]
) -> None:
    rec, endpoint = receiver
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "10")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")  # no export but the flush below
    exporter = tracer.OtlpExporter(endpoint)
    tr = tracer.TracerProvider("test", 1.0, exporter).get_tracer("t")
    for _ in range(15):
        tr.start_span("burst").end()
    assert exporter.flush(5.0)
    exporter.shutdown()
    assert (exporter.exported, exporter.dropped) == (10, 5)
    assert len(rec.spans()) == 10


def test_spans_are_sent_after_the_schedule_delay_without_a_flush(
    monkeypatch: pytest.MonkeyPatch, receiver: tuple[Receiver, str]
) -> None:
    import time

    rec, endpoint = receiver
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    exporter = tracer.OtlpExporter(endpoint)
    tracer.TracerProvider("test", 1.0, exporter).get_tracer("t").start_span("soon").end()
    deadline = time.monotonic() + 5
    while not rec.spans() and time.monotonic() < deadline:
        time.sleep(0.02)
    exporter.shutdown()
    assert [span.name for _, _, span in rec.spans()] == ["soon"]


class socket_nobody_listens_on:
    """A loopback port that was bound and closed: connections to it are refused."""

    def __enter__(self) -> str:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return f"127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        return None
