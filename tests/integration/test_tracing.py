"""Traces end to end, exported over OTLP to a real receiver run by the test.

The receiving end is a real OTLP/gRPC trace service (from opentelemetry-proto); every service
of one container cluster (and the compat front end) exports to it with its real SDK exporter.
Checked here:

- an SDK program that sets a tracer provider makes one trace from its own span through the
  API server and the edge to the command inside the sandbox (chronus's span, exported by the
  edge on its behalf), every span's parent in the trace;
- one call's spans share a trace across the control plane (API server, IAM, placement, edge);
- a failed call's server span carries its gRPC status code and dsec's reason;
- a malformed ``traceparent`` (gRPC metadata, HTTP header) is answered as if absent;
- an idle cluster exports nothing: probes, heartbeats and registrations make no traces.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from dsec.apiserver.v1 import apiserver_pb2, apiserver_pb2_grpc
from dsecctl.cluster import LocalCluster
from libdsec import Client
from libdsec.errors import SandboxNotFound
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith, container_edge

ROOT = Path(__file__).resolve().parents[2]
MALFORMED = "00-not-a-trace-context-01"


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    status_code: int  # 0 unset, 1 ok, 2 error
    attributes: dict[str, Any] = field(default_factory=dict)
    start_ns: int = 0
    end_ns: int = 0


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: object
    ) -> object:
        with self.lock:
            for rs in request.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            Span(
                                service=resource.get("service.name", ""),
                                name=s.name,
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_span_id=s.parent_span_id.hex(),
                                kind=s.kind,
                                status_code=s.status.code,
                                attributes={a.key: _value(a.value) for a in s.attributes},
                                start_ns=s.start_time_unix_nano,
                                end_ns=s.end_time_unix_nano,
                            )
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)


@dataclass
class Traced:
    cluster: LocalCluster
    sink: Collector
    endpoint: str


@pytest.fixture(scope="module")
def traced(cluster_with: ClusterWith) -> Iterator[Traced]:
    """A container cluster whose every service (and the compat front end) exports spans to a
    receiver of this module's, every 100 ms."""
    sink = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    endpoint = f"127.0.0.1:{port}"
    env = {
        f"DSEC_{svc}_OTLP_ENDPOINT": endpoint
        for svc in ("IAM", "APISERVER", "PLACEMENT", "WATCHER", "EDGE", "COMPAT")
    }
    env["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    try:
        with cluster_with("tr", edges=[container_edge("tr")], extra_env=env) as cluster:
            yield Traced(cluster, sink, endpoint)
    finally:
        server.stop(None)


# An SDK user's program: its own tracer provider, exporting to the receiver; one span of its
# own around a sandbox's run. Prints the trace id. A program of its own: the provider is
# process-wide, and the test process's other clients must not trace.
SDK_PROGRAM = textwrap.dedent(
    """
    import sys
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from libdsec import Client

    target, token, endpoint = sys.argv[1:4]
    provider = TracerProvider(resource=Resource.create({"service.name": "rollout"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    trace.set_tracer_provider(provider)
    with Client(target, token=token) as dsec:
        sb = dsec.create(image="busybox", cpu=0.1, memory_mb=64)
        try:
            with trace.get_tracer("rollout").start_as_current_span("rollout.step") as step:
                result = sb.run("true")
                assert result.exit_code == 0, result
                events = list(sb.stream("echo streamed"))  # ExecStream: across pauses
                assert events[-1].status.exit_code == 0, events
            print(format(step.get_span_context().trace_id, "032x"))
        finally:
            sb.stop()
    provider.shutdown()
    """
)


def test_an_sdk_run_is_one_trace_down_to_the_command_in_the_sandbox(traced: Traced) -> None:
    c = traced.cluster
    out = subprocess.run(
        [sys.executable, "-c", SDK_PROGRAM, c.apiserver, c.token, traced.endpoint],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    trace_id = out.stdout.split()[-1]

    def in_trace() -> dict[str, Span]:
        return {s.span_id: s for s in traced.sink.snapshot() if s.trace_id == trace_id}

    def command_spans() -> list[Span] | None:  # the run's and the stream's
        spans = [s for s in in_trace().values() if s.service == "dsec-chronus"]
        return spans if len(spans) == 2 else None

    edge_calls = set()
    for chronus in wait_for(command_spans, timeout_s=20):
        assert chronus.name == "chronus.exec"
        assert chronus.attributes["process.exit.code"] == 0
        assert chronus.attributes["dsec.sandbox_id"].startswith("sb-")
        path = wait_for(lambda chronus=chronus: chain(chronus, in_trace()), timeout_s=20)
        services = [s.service for s in path]
        assert path[-1].name == "rollout.step" and path[-1].service == "rollout", services
        # The command's parent is the edge's server span of the call (a run's: through the
        # edge's step of the call into the sandbox, common/steps.py); above it the API
        # server's client and server spans, and the SDK's client span under the program's.
        edge = path[1]
        if edge.name == "edge.aether.exec":  # a run (unary Exec)
            assert edge.kind == 1, services  # INTERNAL
            edge = path[2]
        assert (edge.service, edge.kind) == ("dsec-edge", 2), services  # SERVER
        edge_calls.add(edge.name)
        assert services.index("dsec-edge") < services.index("dsec-apiserver"), services
        assert services[-2:] == ["rollout", "rollout"], services  # the SDK's client span
    assert edge_calls == {
        "/dsec.edge.v1.EdgeService/Exec",
        "/dsec.edge.v1.EdgeService/ExecStream",
    }


def chain(chronus: Span, spans: dict[str, Span]) -> list[Span] | None:
    """chronus's span, its parent, ... up to the program's root span, once all exported."""
    path = [chronus]
    while path[-1].parent_span_id:
        parent = spans.get(path[-1].parent_span_id)
        if parent is None:
            return None  # not exported yet (or a broken link: the wait fails)
        path.append(parent)
    return path


def test_one_create_shares_a_trace_across_the_control_plane(traced: Traced) -> None:
    c = traced.cluster
    with Client(c.apiserver, token=c.token) as dsec:  # no tracer here: the API server starts it
        dsec.create(image="busybox", cpu=0.1, memory_mb=32).stop()

    def create_trace() -> set[str] | None:
        spans = traced.sink.snapshot()
        for t in {s.trace_id for s in spans if s.name.endswith("SandboxService/CreateSandbox")}:
            services = {s.service for s in spans if s.trace_id == t}
            if {"dsec-apiserver", "dsec-iam", "dsec-placement", "dsec-edge"} <= services:
                return services
        return None

    wait_for(create_trace, timeout_s=20)


def test_a_create_trace_shows_where_the_edge_spends_its_time(traced: Traced) -> None:
    """Issue 43: the edge's steps of a create are spans (common/steps.py) under its server
    span, in the order they run, each inside its parent; the runtime's steps under the launch
    (bench/bench_create_profile.py reads them into a table)."""
    c = traced.cluster
    with Client(c.apiserver, token=c.token) as dsec:
        dsec.create(image="busybox", cpu=0.1, memory_mb=32).stop()

    def create_steps() -> dict[str, Span] | None:
        spans = traced.sink.snapshot()
        for t in {s.trace_id for s in spans if s.name == "edge.runc.run"}:
            mine = {s.name: s for s in spans if s.trace_id == t and s.service == "dsec-edge"}
            if "edge.aether.hello" in mine:
                return mine
        return None

    steps = wait_for(create_steps, timeout_s=20)
    server = steps["/dsec.edge.v1.EdgeService/CreateSandboxes"]
    top = [
        "edge.admission.checks",
        "edge.container.resolve_image",
        "edge.container.prepare",
        "edge.container.launch",
        "edge.container.qos",
        "edge.container.started",
        "edge.aether.hello",
    ]
    runtime = [
        "edge.runc.layers",
        "edge.runc.writable_layer",
        "edge.runc.overlay",
        "edge.runc.bundle",
        "edge.runc.run",
    ]
    for names, parent in ((top, server), (runtime, steps["edge.container.launch"])):
        for name in names:
            span = steps[name]
            assert span.parent_span_id == parent.span_id, name
            assert parent.start_ns <= span.start_ns <= span.end_ns <= parent.end_ns, name
        starts = [steps[n].start_ns for n in names]
        assert starts == sorted(starts), names


def test_a_failed_call_span_carries_its_status_code_and_reason(traced: Traced) -> None:
    c = traced.cluster
    missing = "sb-tr-0000000000000000"
    with Client(c.apiserver, token=c.token) as dsec, pytest.raises(SandboxNotFound):
        dsec.get(missing)

    def failed_span() -> Span | None:
        return next(
            (
                s
                for s in traced.sink.snapshot()
                if s.service == "dsec-apiserver"
                and s.name == "/dsec.apiserver.v1.SandboxService/GetSandbox"
                and s.attributes.get("dsec.reason") == SandboxNotFound.default_reason
            ),
            None,
        )

    span = wait_for(failed_span, timeout_s=20)
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert span.status_code != 2  # NOT_FOUND is the caller's error, not the server's failure


def test_a_malformed_traceparent_is_answered_as_if_absent(traced: Traced) -> None:
    c = traced.cluster
    with grpc.insecure_channel(c.apiserver) as channel:
        stub = apiserver_pb2_grpc.SandboxServiceStub(channel)
        answer = stub.ListSandboxes(
            apiserver_pb2.ListSandboxesRequest(label_selector={"probe": "malformed-traceparent"}),
            metadata=(("authorization", f"Bearer {c.token}"), ("traceparent", MALFORMED)),
            timeout=10,
        )
    assert list(answer.sandboxes) == []

    request = urllib.request.Request(
        f"{c.compat_url}/sandboxes",
        headers={"X-API-Key": c.token, "traceparent": MALFORMED},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        assert response.read().startswith(b"[")

    # Each front door started a trace of its own instead (a root span: no parent).
    def roots() -> set[str] | None:
        spans = traced.sink.snapshot()
        found = {
            s.service
            for s in spans
            if not s.parent_span_id
            and (
                s.name == "/dsec.apiserver.v1.SandboxService/ListSandboxes"
                or (s.service == "dsec-compat" and s.attributes.get("url.path") == "/sandboxes")
            )
        }
        return found if found == {"dsec-apiserver", "dsec-compat"} else None

    wait_for(roots, timeout_s=20)


def test_an_idle_cluster_exports_no_spans(traced: Traced) -> None:
    """The watcher probes every edge each second and polls their sandboxes every 2 s, edges
    re-register every 5 s, the watcher reconciles with IAM every 5 s: none of it is traced."""
    sink = traced.sink

    def settled() -> int | None:  # what earlier tests caused has been exported
        before = len(sink.snapshot())
        time.sleep(0.5)
        after = len(sink.snapshot())
        return after if after == before else None

    try:
        count = wait_for(settled, timeout_s=20, interval_s=0)
    except AssertionError:  # spans keep coming: the assertion below names them
        count = len(sink.snapshot())
    time.sleep(6)  # a window for the background loops above, each of which runs in it
    new = sink.snapshot()[count:]
    assert not new, sorted({(s.service, s.name) for s in new})
