"""GPUs on a container or microVM create: no backend attaches them yet, so such a create is
refused (UNIMPLEMENTED, BACKEND_CAPABILITY naming the backend and gpus) instead of admitted,
counted against the edge's GPUs and started without any. Through the SDK, on an edge that
says it has GPUs (so placement sends it the create). FnCall's GPU pools are separate."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from dsec.edge.v1 import edge_pb2, edge_pb2_grpc
from dsec.types.v1 import types_pb2
from dsecctl.cluster import LocalCluster
from libdsec import Client
from libdsec.errors import BackendCapabilityMissing
from tests.integration.conftest import ClusterWith

pytestmark = pytest.mark.images("busybox")
EDGE = "gpu0"


@pytest.fixture(scope="module")
def cluster(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """A cluster of the module's own: an edge that says it has GPUs."""
    with cluster_with(EDGE, edge_env={"DSEC_EDGE_GPUS": "2", "DSEC_EDGE_MICROVM": "auto"}) as c:
        yield c


def _node_load(cluster: LocalCluster) -> edge_pb2.GetNodeStatusResponse:
    with grpc.insecure_channel(cluster.process(f"edge-{EDGE}").address) as ch:
        return edge_pb2_grpc.EdgeServiceStub(ch).GetNodeStatus(
            edge_pb2.GetNodeStatusRequest(), timeout=10
        )


def _refused(err: BackendCapabilityMissing, backend: str) -> None:
    assert err.code == grpc.StatusCode.UNIMPLEMENTED, err
    assert err.reason == "BACKEND_CAPABILITY", err
    assert err.metadata == {"backend": backend, "capability": "gpus"}, err.metadata
    assert backend in str(err) and "gpus" in str(err), err


def test_a_create_with_gpus_is_unimplemented_naming_the_backend(cluster: LocalCluster) -> None:
    status = _node_load(cluster)
    offered = [
        types_pb2.Backend.Name(b).removeprefix("BACKEND_").lower() for b in status.info.backends
    ]
    assert "container" in offered, offered
    with Client(cluster.apiserver, token=cluster.token) as c:
        for backend in ("container", "microvm"):
            if backend not in offered:  # no guest boots on this host: container only
                continue
            with pytest.raises(BackendCapabilityMissing) as info:
                c.create(image="busybox", backend=backend, gpus=1, cpu=0.2, memory_mb=256)
            _refused(info.value, backend)
            [out] = c.create_many(1, image="busybox", backend=backend, gpus=1, memory_mb=256)
            assert isinstance(out, BackendCapabilityMissing), out
            _refused(out, backend)
        # nothing was admitted or counted: the edge's GPUs are all free, no sandbox is live
        after = _node_load(cluster)
        assert after.load.gpus_free == status.load.gpus_free == 2, after.load
        assert after.load.sandboxes == status.load.sandboxes == 0, after.load
        # without GPUs the same create works
        sb = c.create(image="busybox", cpu=0.2, memory_mb=64)
        try:
            assert sb.run("echo ok").stdout == b"ok\n"
        finally:
            sb.stop()
