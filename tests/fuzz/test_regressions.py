"""What the fuzz suite found, kept as the exact failing requests (tests/fuzz/test_rpc_fuzz.py).

Each of these answered INTERNAL (an unhandled exception in the servicer) before its fix; now
each must answer INVALID_ARGUMENT with the reason and field the fix gave it (a batch-shaped
call, PlaceSandbox, as that item's status), and the service keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import text_format
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from common.telemetry import server_interceptors
from dsec.apiserver.v1 import apiserver_pb2
from dsec.edge.v1 import edge_pb2
from dsec.iam.v1 import iam_pb2
from dsec.placement.v1 import placement_pb2
from dsec.types.v1 import types_pb2
from dsecctl.cluster import LocalCluster
from libdsec.errors import DSecError, from_rpc_error, item_error
from libdsec.sync import Client, Sandbox
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

#: (process, method path, request type, the failing request as text format, the reason and
#: the field the answer names)
CASES = [
    # proto3 enums are open: Backend.Name(-1) raised ValueError in placement/servicer.py
    (
        "placement",
        "/dsec.placement.v1.PlacementService/PlaceSandbox",
        placement_pb2.PlaceSandboxRequest,
        "item { spec { backend: -1 } }",
        "UNKNOWN_ENUM_VALUE",
        "spec.backend",
    ),
    # SandboxState.Name(-1) in edge/servicer.py _state_names
    (
        "edge-fz",
        "/dsec.edge.v1.EdgeService/WatchSandboxes",
        edge_pb2.WatchSandboxesRequest,
        "states: -1",
        "UNKNOWN_ENUM_VALUE",
        "states",
    ),
    (
        "edge-fz",
        "/dsec.edge.v1.EdgeService/ListSandboxes",
        edge_pb2.ListSandboxesRequest,
        "states: 2147483647",
        "UNKNOWN_ENUM_VALUE",
        "states",
    ),
    # Backend.Name in iam/servicer.py ReserveQuota and ReserveQuotas (same pattern)
    (
        "iam",
        "/dsec.iam.v1.IamService/ReserveQuota",
        iam_pb2.ReserveQuotaRequest,
        'project_id: "p" sandbox_id: "sb-x" backend: 999',
        "UNKNOWN_ENUM_VALUE",
        "backend",
    ),
    (
        "iam",
        "/dsec.iam.v1.IamService/ReserveQuotas",
        iam_pb2.ReserveQuotasRequest,
        'items { project_id: "p" sandbox_id: "sb-x" backend: -5 }',
        "UNKNOWN_ENUM_VALUE",
        "items.backend",
    ),
    # The API server made a job's limits its deadline before the edge checked them: NaN
    # raised in asyncio.timeout (INTERNAL), a negative one expired at once (DEADLINE_EXCEEDED).
    (
        "apiserver",
        "/dsec.apiserver.v1.FunctionService/RunFunction",
        apiserver_pb2.RunFunctionRequest,
        "job { compile_time_limit_s: nan }",
        "INVALID_LIMITS",
        None,
    ),
    (
        "apiserver",
        "/dsec.apiserver.v1.FunctionService/RunFunction",
        apiserver_pb2.RunFunctionRequest,
        "job { time_limit_s: -150 }",
        "INVALID_LIMITS",
        None,
    ),
    # A stop's grace became the deadline of the call to the edges: NaN or huge expired at
    # once, the edges "did not answer" and the task's stop went on unreported.
    (
        "apiserver",
        "/dsec.apiserver.v1.SandboxService/StopTask",
        apiserver_pb2.StopTaskRequest,
        'task_id: "t" grace_s: nan',
        "INVALID_GRACE",
        "grace_s",
    ),
    (
        "apiserver",
        "/dsec.apiserver.v1.SandboxService/StopSandbox",
        apiserver_pb2.StopSandboxRequest,
        'sandbox_id: "sb-fz-0" grace_s: inf',
        "INVALID_GRACE",
        "grace_s",
    ),
    (
        "edge-fz",
        "/dsec.edge.v1.EdgeService/StopSandbox",
        edge_pb2.StopSandboxRequest,
        'sandbox_id: "sb-fz-0" grace_s: -1',
        "INVALID_GRACE",
        "grace_s",
    ),
]


@pytest.mark.parametrize(
    ("process", "path", "cls", "text", "reason", "field"),
    CASES,
    ids=[f"{c[1].rsplit('/', 1)[1]}:{c[3]}" for c in CASES],
)
def test_fuzz_finding_is_invalid_argument(
    fuzz_cluster: LocalCluster,
    process: str,
    path: str,
    cls: type[Message],
    text: str,
    reason: str,
    field: str | None,
) -> None:
    request = text_format.Parse(text, cls())
    address = fuzz_cluster.process(process).address
    with grpc.insecure_channel(address) as ch:
        md = (("authorization", f"Bearer {fuzz_cluster.token}"),)
        call = ch.unary_stream if path.endswith("WatchSandboxes") else ch.unary_unary
        if path.endswith("PlaceSandbox"):
            raw = call(path)(request.SerializeToString(), timeout=5, metadata=md)
            status = placement_pb2.PlaceSandboxResponse.FromString(raw).placement.error
            err = item_error(status)
            assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        else:
            with pytest.raises(grpc.RpcError) as info:
                result = call(path)(request.SerializeToString(), timeout=5, metadata=md)
                if path.endswith("WatchSandboxes"):
                    next(iter(result))  # type: ignore[call-overload]
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            err = from_rpc_error(info.value)
        assert err.reason == reason, err
        if field is not None:
            assert err.metadata["field"] == field
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    "text",
    [
        # chronus's os.access raised ValueError on the NUL (the shell was 64 KiB of them)
        'shell: "/bin/sh\\000"',
        'env { key: "A" value: "x\\000y" }',
        'cwd: "/tmp\\000"',
    ],
)
def test_session_with_a_nul_is_invalid_argument(fuzz_cluster: LocalCluster, text: str) -> None:
    """CreateSession reaches chronus inside a container sandbox: a NUL in the shell, cwd or
    environment answered INTERNAL."""
    with grpc.insecure_channel(fuzz_cluster.process("edge-fzc").address) as ch:
        undrain = edge_pb2.SetDrainingRequest(draining=False).SerializeToString()
        ch.unary_unary("/dsec.edge.v1.EdgeService/SetDraining")(undrain, timeout=5)
    with Client(fuzz_cluster.apiserver, token=fuzz_cluster.token, timeout=30) as cl:
        sb = wait_for(
            lambda: _create_container(cl), timeout_s=20, interval_s=0.3
        )  # placement sees an undrain with the edge's next registration
        try:
            request = text_format.Parse(text, types_pb2.CreateSessionRequest(sandbox_id=sb.id))
            with grpc.insecure_channel(fuzz_cluster.apiserver) as ch:
                md = (("authorization", f"Bearer {fuzz_cluster.token}"),)
                with pytest.raises(grpc.RpcError) as info:
                    ch.unary_unary("/dsec.apiserver.v1.ExecService/CreateSession")(
                        request.SerializeToString(), timeout=10, metadata=md
                    )
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value  # type: ignore[attr-defined]
            assert "NUL" in from_rpc_error(info.value).message
        finally:
            sb.stop()


def _create_container(cl: Client) -> Sandbox | None:
    try:
        return cl.create(
            image="busybox", cpu=0.1, memory_mb=64, ttl_s=600, node_selector={"fuzz": "container"}
        )
    except DSecError:
        return None


@pytest.mark.parametrize(
    ("front", "path", "body", "status"),
    [
        # json.loads raised RecursionError (not ValueError): 500
        ("e2b", "/sandboxes", b"[" * 5000, 400),
        ("e2b", "/v2/sandboxes", b"[" * 5000, 400),
        # Python's parser takes Infinity and NaN; strict JSON does not
        ("e2b", "/sandboxes", b'{"templateID": "base", "timeout": Infinity}', 400),
        # the 422 echoed the input: Infinity could not be rendered, a 500
        ("fusion", "/run_code", b'{"template_id": Infinity}', 422),
        ("fusion", "/run_code_batch", b'{"template_id": Infinity}', 422),
    ],
)
def test_http_finding_is_a_client_error(
    fuzz_cluster: LocalCluster, front: str, path: str, body: bytes, status: int
) -> None:
    token = fuzz_cluster.token
    if front == "e2b":
        url, headers = fuzz_cluster.compat_url + path, {"x-api-key": token}
    else:
        url, headers = fuzz_cluster.sandbox_fusion_url + f"/t/{token}" + path, {}
    headers["content-type"] = "application/json"
    r = httpx.post(url, content=body, headers=headers, timeout=10)
    assert r.status_code == status, r.text
    r.json()  # a body its clients can read


def test_a_key_repeated_in_a_burst_shares_its_first_items_outcome_at_once(
    fuzz_cluster: LocalCluster,
) -> None:
    """CreateSandboxes with one idempotency key on many items, whose first create the edge
    refuses (drained a moment ago, before placement hears of it): the repeats waited for the
    first's sandbox for IDEMPOTENT_WAIT_S (15 s) inside the call. Now they share its outcome."""
    edge = fuzz_cluster.process("edge-fz").address
    drain = "/dsec.edge.v1.EdgeService/SetDraining"
    request = apiserver_pb2.CreateSandboxesRequest()
    for _ in range(30):
        request.items.add(idempotency_key="fuzz-dup").spec.node_selector["fuzz"] = "null"
    with grpc.insecure_channel(edge) as ech, grpc.insecure_channel(fuzz_cluster.apiserver) as ch:
        ech.unary_unary(drain)(edge_pb2.SetDrainingRequest(draining=True).SerializeToString())
        try:
            t0 = time.monotonic()
            raw = ch.unary_unary("/dsec.apiserver.v1.SandboxService/CreateSandboxes")(
                request.SerializeToString(),
                timeout=10,
                metadata=(("authorization", f"Bearer {fuzz_cluster.token}"),),
            )
            elapsed = time.monotonic() - t0
        finally:
            undrain = edge_pb2.SetDrainingRequest(draining=False).SerializeToString()
            ech.unary_unary(drain)(undrain, timeout=5)
    results = apiserver_pb2.CreateSandboxesResponse.FromString(raw).results
    assert elapsed < 5, f"{elapsed:.1f} s"
    outcomes = {(r.sandbox.id, r.error.reason) for r in results}
    assert len(results) == 30 and len(outcomes) == 1, outcomes


async def test_a_stream_closed_from_another_context_logs_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server stream the client cancels is closed at its yield from another context (the
    watcher's WatchCluster, cancelled by the fuzz): the tracing interceptor held its span's
    context across the yield and OpenTelemetry logged "Failed to detach context" as an ERROR.
    Now the span is current only while the handler runs."""
    seen: list[str] = []

    async def watch(request: Any, context: Any) -> AsyncIterator[bytes]:
        seen.append(format(trace.get_current_span().get_span_context().span_id, "x"))
        yield b"one"
        yield b"two"

    handler = grpc.unary_stream_rpc_method_handler(watch)

    async def continuation(details: Any) -> Any:
        return handler

    details = SimpleNamespace(
        method="/dsec.watcher.v1.WatcherService/WatchCluster", invocation_metadata=()
    )
    (interceptor,) = server_interceptors("watcher")
    wrapped = await interceptor.intercept_service(continuation, details)  # type: ignore[arg-type]
    context = SimpleNamespace(invocation_metadata=lambda: (), peer=lambda: "ipv4:127.0.0.1:1")
    stream = wrapped.unary_stream(b"", context)
    assert await stream.__anext__() == b"one"
    with caplog.at_level(logging.ERROR):
        # closed from a task of its own: a copy of the context, as grpc's cancellation is
        await asyncio.create_task(stream.aclose())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert len(seen) == 1
