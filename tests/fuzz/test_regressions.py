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

from dsec.edge.v1 import edge_pb2
from dsec.iam.v1 import iam_pb2
from dsec.placement.v1 import placement_pb2
from dsecctl.cluster import LocalCluster
from libdsec.errors import from_rpc_error, item_error

pytestmark = pytest.mark.integration

#: (process, method path, request type, the failing request as text format, the field named)
CASES = [
    # proto3 enums are open: Backend.Name(-1) raised ValueError in placement/servicer.py
    (
        "placement",
        "/dsec.placement.v1.PlacementService/PlaceSandbox",
        placement_pb2.PlaceSandboxRequest,
        "item { spec { backend: -1 } }",
        "spec.backend",
    ),
    # SandboxState.Name(-1) in edge/servicer.py _state_names
    (
        "edge-fz",
        "/dsec.edge.v1.EdgeService/WatchSandboxes",
        edge_pb2.WatchSandboxesRequest,
        "states: -1",
        "states",
    ),
    (
        "edge-fz",
        "/dsec.edge.v1.EdgeService/ListSandboxes",
        edge_pb2.ListSandboxesRequest,
        "states: 2147483647",
        "states",
    ),
    # Backend.Name in iam/servicer.py ReserveQuota and ReserveQuotas (same pattern)
    (
        "iam",
        "/dsec.iam.v1.IamService/ReserveQuota",
        iam_pb2.ReserveQuotaRequest,
        'project_id: "p" sandbox_id: "sb-x" backend: 999',
        "backend",
    ),
    (
        "iam",
        "/dsec.iam.v1.IamService/ReserveQuotas",
        iam_pb2.ReserveQuotasRequest,
        'items { project_id: "p" sandbox_id: "sb-x" backend: -5 }',
        "items.backend",
    ),
]


@pytest.mark.parametrize(
    ("process", "path", "cls", "text", "field"), CASES, ids=[c[1] for c in CASES]
)
def test_fuzz_finding_is_invalid_argument(
    fuzz_cluster: LocalCluster, process: str, path: str, cls: type[Message], text: str, field: str
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
        assert err.reason == "UNKNOWN_ENUM_VALUE"
        assert err.metadata["field"] == field
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
