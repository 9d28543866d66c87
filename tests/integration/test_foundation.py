"""The foundation through real service processes: health, reflection, bad input,
authentication, projects/tokens/quotas, and the sandbox lifecycle on the null
runtime (the control plane without containers)."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

import dsec.apiserver.v1.apiserver_pb2
import dsec.edge.v1.edge_pb2
import dsec.iam.v1.iam_pb2
import dsec.placement.v1.placement_pb2
import dsec.watcher.v1.watcher_pb2  # noqa: F401  (registers descriptors)
from dsecctl.cluster import LocalCluster, health
from libdsec import Client, Quota
from libdsec.errors import (
    AlreadyExists,
    BackendCapabilityMissing,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    SandboxNotFound,
    Unauthenticated,
)
from tests.helpers import wait_for

EXPECTED = {
    "iam": ["dsec.iam.v1.IamService"],
    "watcher": ["dsec.watcher.v1.WatcherService"],
    "placement": ["dsec.placement.v1.PlacementService"],
    "edge-nulla": ["dsec.edge.v1.EdgeService"],
    "apiserver": [
        "dsec.apiserver.v1.SandboxService",
        "dsec.apiserver.v1.ExecService",
        "dsec.apiserver.v1.FileService",
        "dsec.apiserver.v1.DisplayService",
        "dsec.apiserver.v1.EnvironmentService",
        "dsec.apiserver.v1.FunctionService",
        "dsec.apiserver.v1.ProjectService",
    ],
}


def test_every_service_reports_serving(cluster: LocalCluster) -> None:
    for name, services in EXPECTED.items():
        address = cluster.process(name).address
        assert health(address) == "SERVING", name
        for svc in services:
            assert health(address, service=svc) == "SERVING", svc


def test_reflection_lists_every_service_and_method(cluster: LocalCluster) -> None:
    """What `dsec grpc` (and grpcurl) does: list services over reflection, then resolve each method."""
    ours = descriptor_pool.Default()
    for name, services in EXPECTED.items():
        with grpc.insecure_channel(cluster.process(name).address) as ch:
            db = ProtoReflectionDescriptorDatabase(ch)
            listed = set(db.get_services())
            assert (
                set(services)
                | {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
                <= listed
            )
            pool = descriptor_pool.DescriptorPool(db)
            for svc in services:
                remote = pool.FindServiceByName(svc)
                local = ours.FindServiceByName(svc)
                assert [m.name for m in remote.methods] == [m.name for m in local.methods]
                assert len(remote.methods) > 0


MALFORMED = {
    "iam": "/dsec.iam.v1.IamService/CreateProject",
    "watcher": "/dsec.watcher.v1.WatcherService/RegisterEdge",
    "placement": "/dsec.placement.v1.PlacementService/PlaceSandbox",
    "edge-nulla": "/dsec.edge.v1.EdgeService/GetSandbox",
    "apiserver": "/dsec.apiserver.v1.SandboxService/CreateSandbox",
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_request_is_invalid_argument_and_service_keeps_serving(
    cluster: LocalCluster, name: str
) -> None:
    address = cluster.process(name).address
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary(
            MALFORMED[name], request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                call(
                    b"\xff\xff\xff\xff\x0f", timeout=5
                )  # an invalid varint: not a protobuf message
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed" in info.value.details()
    assert health(address) == "SERVING"


def test_missing_and_bad_tokens_are_unauthenticated(cluster: LocalCluster) -> None:
    with Client(cluster.apiserver, token="") as c, pytest.raises(Unauthenticated) as info:
        c.whoami()
    assert info.value.reason == "NO_TOKEN"
    with (
        Client(cluster.apiserver, token="dsec_0000_nope") as c,
        pytest.raises(Unauthenticated) as info,
    ):
        c.list()
    assert info.value.reason == "BAD_TOKEN"
    with Client(cluster.apiserver, token="not-a-token") as c, pytest.raises(Unauthenticated):
        c.create(image="busybox")


def test_bootstrap_token_file_is_private(cluster: LocalCluster) -> None:
    mode = cluster.token_file.stat().st_mode & 0o777
    assert mode == 0o600
    with Client(cluster.apiserver, token=cluster.token) as c:
        me = c.whoami()
    assert me.project_id == "root" and me.role == "ADMIN"


def test_projects_tokens_and_quota(cluster: LocalCluster, request: pytest.FixtureRequest) -> None:
    suffix = str(abs(hash(request.node.nodeid)) % 10**8)
    with Client(cluster.apiserver, token=cluster.token) as admin:
        team = admin.create_project(
            f"team{suffix}", quota=Quota(cpu_millis=2000, memory_mb=1024, sandboxes=2)
        )
        with pytest.raises(PermissionDenied) as info:
            admin.create_project("greedy", parent=team.project_id, quota=Quota(sandboxes=3))
        assert info.value.reason == "QUOTA_GRANT_EXCEEDS_HELD"
        run = admin.create_project("run", parent=team.project_id, quota=Quota(sandboxes=2))
        with pytest.raises(AlreadyExists):
            admin.create_project("run", parent=team.project_id)
        # exist_ok: the project as it is (its quota not changed by the request's)
        again = admin.create_project(
            "run", parent=team.project_id, quota=Quota(sandboxes=1), exist_ok=True
        )
        assert again.project_id == run.project_id and again.quota.sandboxes == 2
        # ... but the right to create it is still needed, and the grant still checked for a new one
        with pytest.raises(PermissionDenied):
            admin.create_project(
                "greedy", parent=team.project_id, quota=Quota(sandboxes=3), exist_ok=True
            )
        agent_token = admin.create_token("agent", project=run.project_id, agent=True)
        sibling_token = admin.create_token("other", project=team.project_id)
        with pytest.raises(InvalidArgument):
            admin.create_project("Bad Name!")

    with Client(cluster.apiserver, token=agent_token.secret) as agent:
        assert agent.whoami().kind == "AGENT"
        a = agent.create(image="busybox", cpu=0.5, memory_mb=256, labels={"k": "v"}, task_id="t1")
        b = agent.create(image="busybox", cpu=0.5, memory_mb=256, task_id="t1")
        with pytest.raises(QuotaExceeded) as info:
            agent.create(image="busybox", cpu=0.5, memory_mb=256)
        assert info.value.metadata["project"] == run.project_id
        # a subproject cannot act on its parent
        with pytest.raises(NotFound):
            agent.create_project("x", parent=team.project_id)
        usage = agent.get_project().usage
        assert usage.sandboxes == 2 and usage.cpu_millis == 1000 and usage.memory_mb == 512

    with Client(cluster.apiserver, token=sibling_token.secret) as member:
        # the parent project's member sees the child's sandboxes only when asking for subprojects
        assert {s.id for s in member.list(include_subprojects=True, task_id="t1")} == {a.id, b.id}
        with pytest.raises(PermissionDenied):
            member.create_project("nope")  # MEMBER role cannot manage projects
        with pytest.raises(PermissionDenied):  # not even to be told that one exists
            member.create_project("run", exist_ok=True)

    with Client(cluster.apiserver, token=cluster.token) as admin:
        # another project's token cannot see it: reported exactly like a missing sandbox
        stranger = admin.create_token(
            "stranger", project=admin.create_project(f"other{suffix}").project_id
        )
    with Client(cluster.apiserver, token=stranger.secret) as s:
        with pytest.raises(SandboxNotFound):
            s.get(a.id)
        with pytest.raises(SandboxNotFound):
            s.get("sb-nulla-ffffffffffff")
        assert s.list() == []

    with Client(cluster.apiserver, token=agent_token.secret) as agent:
        agent.get(a.id).stop()
        agent.get(b.id).stop()
        # quota comes back when sandboxes end (released by the edge)
        wait_for(lambda: agent.get_project().usage.sandboxes == 0)

    with Client(cluster.apiserver, token=cluster.token) as admin:
        admin.revoke_token(agent_token.info.token_id)
        assert any(t.revoked for t in admin.list_tokens(run.project_id, include_revoked=True))


def test_null_runtime_lifecycle_through_the_chain(cluster: LocalCluster) -> None:
    with Client(cluster.apiserver, token=cluster.token) as c:
        sb = c.create(
            image="busybox",
            cpu=0.25,
            memory_mb=64,
            labels={"suite": "foundation"},
            task_id="lifecycle",
        )
        assert sb.info.state == "RUNNING" and sb.info.edge_id == "nulla"
        assert sb.id.startswith("sb-nulla-")
        again = c.get(sb.id)
        assert again.info.labels == {"suite": "foundation"}
        assert [s.id for s in c.list(labels={"suite": "foundation"})] == [sb.id]
        # The null runtime starts nothing and says so: no commands, no pause.
        with pytest.raises(BackendCapabilityMissing) as missing:
            sb.run("true")
        assert missing.value.metadata == {"backend": "null", "capability": "exec"}
        with pytest.raises(BackendCapabilityMissing) as missing:
            sb.pause()
        assert missing.value.metadata["capability"] == "pause"
        assert c.get(sb.id).info.state == "RUNNING"
        stopped = sb.stop()
        assert stopped.state == "TERMINATED" and stopped.termination_reason == "STOPPED"
        with pytest.raises(FailedPrecondition) as info:
            sb.run("true")
        assert info.value.reason == "SANDBOX_TERMINATED"
        assert sb.stop().termination_reason == "STOPPED"  # idempotent


def test_ttl_is_enforced_by_the_edge(cluster: LocalCluster) -> None:
    with Client(cluster.apiserver, token=cluster.token) as c:
        sb = c.create(image="busybox", cpu=0.1, memory_mb=32, ttl_s=1)
        info = wait_for(lambda: (i := c.get(sb.id).info).terminated and i, timeout_s=10)
        assert info.termination_reason == "TTL"


def test_bad_create_requests_are_rejected_precisely(cluster: LocalCluster) -> None:
    with Client(cluster.apiserver, token=cluster.token) as c:
        with pytest.raises(InvalidArgument) as info:
            c.create(image="busybox", memory_mb=10**9)
        assert info.value.reason == "INVALID_RESOURCES"
        with pytest.raises(InvalidArgument):
            c.create(image="busybox", cpu=-1)
        with pytest.raises(InvalidArgument):
            c.create(image="busybox", ttl_s=10**8)
        with pytest.raises(SandboxNotFound):
            c.get("not-a-sandbox-id")


def test_create_many_reports_per_item_and_idempotency_keys_dedupe(cluster: LocalCluster) -> None:
    with Client(cluster.apiserver, token=cluster.token) as c:
        out = c.create_many(
            specs=[
                {"image": "busybox", "cpu": 0.1, "memory_mb": 32, "task_id": "batch"},
                {"image": "busybox", "cpu": 0.1, "memory_mb": 10**9, "task_id": "batch"},
                {
                    "image": "busybox",
                    "cpu": 0.1,
                    "memory_mb": 32,
                    "task_id": "batch",
                    "idempotency_key": "k1",
                },
            ]
        )
        assert isinstance(out[1], InvalidArgument)
        created = [s for s in out if not isinstance(s, Exception)]
        assert len(created) == 2
        first = c.create(
            image="busybox", cpu=0.1, memory_mb=32, task_id="batch", idempotency_key="k2"
        )
        retry = c.create(
            image="busybox", cpu=0.1, memory_mb=32, task_id="batch", idempotency_key="k2"
        )
        assert retry.id == first.id
        stopped = c.stop_all(task_id="batch")
        assert set(stopped) >= {s.id for s in created} | {first.id}
        assert all(s.terminated for s in c.list(task_id="batch"))
