"""Traces leave the services over OTLP when configured, and one call's spans
share a trace across services (the interceptors propagate context).

The receiving end is a real OTLP/gRPC trace service (from opentelemetry-proto)
run by the test; the services under test export to it with their real SDK
exporter."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from dsecctl.cluster import EdgeSpec
from libdsec import Client
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str]] = []  # (service.name, span name, trace id)
        self.lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: object
    ) -> object:
        with self.lock:
            for rs in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in rs.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans.append((service, span.name, span.trace_id.hex()))
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector() -> Iterator[tuple[Collector, str]]:
    c = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(c, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield c, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def test_spans_are_exported_and_share_a_trace_across_services(
    collector: tuple[Collector, str], cluster_with: ClusterWith
) -> None:
    sink, endpoint = collector
    env = {
        f"DSEC_{svc}_OTLP_ENDPOINT": endpoint
        for svc in ("IAM", "APISERVER", "PLACEMENT", "WATCHER", "EDGE")
    }
    env["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # export batches every 100 ms
    with cluster_with(
        "tr", edges=[EdgeSpec(edge_id="tr", runtime="null")], extra_env=env
    ) as cluster:
        with Client(cluster.apiserver, token=cluster.token) as c:
            c.create(image="busybox", cpu=0.1, memory_mb=32).stop()

        def create_trace() -> set[str] | None:
            with sink.lock:
                traces = {
                    t
                    for svc, name, t in sink.spans
                    if name == "apiserver.SandboxService.CreateSandbox"
                }
                for t in traces:
                    services = {svc for svc, _, tid in sink.spans if tid == t}
                    if {"dsec-apiserver", "dsec-iam", "dsec-placement", "dsec-edge"} <= services:
                        return services
            return None

        services = wait_for(create_trace, timeout_s=20)
        assert "dsec-apiserver" in services
