"""What the fuzz suite found, kept as the exact failing requests (tests/fuzz/test_rpc_fuzz.py).

Each of these answered INTERNAL (an unhandled exception in the servicer) before its fix; now
each must answer INVALID_ARGUMENT with the reason and field the fix gave it (a batch-shaped
call, PlaceSandbox, as that item's status), and the service keeps serving.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import text_format
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsec.apiserver.v1 import apiserver_pb2
from dsec.edge.v1 import edge_pb2
from dsec.iam.v1 import iam_pb2
from dsec.placement.v1 import placement_pb2
from dsecctl.cluster import LocalCluster
from libdsec.errors import from_rpc_error, item_error

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
