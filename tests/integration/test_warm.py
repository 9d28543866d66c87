"""Warm sandboxes (edge/backends/warm.py) against real runc: a create claims a started sandbox, which then
behaves as one created cold; the pool refills, discards a broken one, and an edge restart keeps
the claimed sandboxes and replaces the warm ones."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dsec.edge.v1 import edge_pb2, edge_pb2_grpc
from dsecctl.cluster import LocalCluster
from edge.runtime import cgroups
from libdsec import Client
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith, container_edge

pytestmark = pytest.mark.images("busybox")
EDGE = "wrm"
POOL = 2


@pytest.fixture(scope="module")
def container_cluster(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """A cluster of the module's own: an edge keeping a warm pool (tests count its sandboxes)."""
    with cluster_with(EDGE, edge_env={"DSEC_EDGE_WARM_POOL": f"busybox={POOL}"}) as c:
        yield c


def _runc(c: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    root = c.home / "edges" / EDGE / "container" / "runtime" / "runc"
    return subprocess.run(["runc", "--root", str(root), *args], capture_output=True, text=True)


def _warm_ids(c: LocalCluster) -> list[str]:
    out = _runc(c, "list", "-q").stdout.split()
    return sorted(i for i in out if i.startswith("warm-"))


def _full(c: LocalCluster) -> list[str]:
    """Until the pool reports all its warm sandboxes ready; their runtime ids."""
    wait_for(lambda: _pool_status(c).ready == POOL, timeout_s=30)
    return wait_for(lambda: (ids := _warm_ids(c)) and len(ids) == POOL and ids, timeout_s=10)


def _started_warm(c: LocalCluster, sandbox_id: str) -> bool:
    """Whether the edge's log says the sandbox was a claimed warm one (cold starts log the
    runc and aether times instead)."""
    for line in (c.home / "logs" / f"edge-{EDGE}.log").read_text().splitlines():
        if f"sandbox {sandbox_id} started" in line:
            return bool(json.loads(line).get("warm"))
    raise AssertionError(f"no start logged for {sandbox_id}")


def _pool_status(c: LocalCluster) -> edge_pb2.WarmPoolStatus:
    with grpc.insecure_channel(c.process(f"edge-{EDGE}").address) as ch:
        resp = edge_pb2_grpc.EdgeServiceStub(ch).GetNodeStatus(
            edge_pb2.GetNodeStatusRequest(), timeout=10
        )
    return resp.warm["busybox"]


def test_a_create_claims_a_warm_sandbox_with_its_own_settings(
    container_cluster: LocalCluster, client: Client
) -> None:
    before = _full(container_cluster)
    status = _pool_status(container_cluster)
    assert (status.target, status.ready) == (POOL, POOL)
    with client.create(
        image="busybox", cpu=0.5, memory_mb=96, env={"TASK": "t-17"}, workdir="/root"
    ) as sb:
        assert _started_warm(container_cluster, sb.id)
        assert not set(_warm_ids(container_cluster)) >= set(before)  # one of them became sb
        assert _pool_status(container_cluster).claimed == status.claimed + 1
        r = sb.run(
            "echo $TASK; pwd; hostname; cat /etc/hostname;"
            " cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/cpu/cpu.cfs_quota_us"
        )
        assert r.exit_code == 0, r
        assert r.stdout.decode().split() == [
            "t-17",
            "/root",
            sb.id,
            sb.id,
            str(96 * 1024 * 1024),
            "50000",
        ]
        s = sb.session()  # sessions, files and background commands work as on any sandbox
        s.run("cd /etc && export X=7")
        assert s.run("pwd; echo $X").stdout == b"/etc\n7\n"
        sb.files.write("/root/f", b"data")
        assert sb.run("cat f").stdout == b"data"
        p = sb.start("sleep 30")
        p.kill()
        info = p.wait(timeout_s=5)
        assert not info.running and info.exit is not None
        pid1 = json.loads(_runc(container_cluster, "state", sb.id).stdout)["pid"]
        cg = Path(f"/proc/{pid1}/cgroup").read_text()
        assert sb.id in cg and "warm-" not in cg  # every hierarchy, cgroup2 included (it follows)
    # stopped like any sandbox: nothing of it or of its warm name is left
    assert sb.id not in _runc(container_cluster, "list", "-q").stdout
    parent = f"dsec-test-{os.getpid()}-{EDGE}"
    assert not any(n.startswith("sb-") for n in cgroups.children(parent))
    refilled = _full(container_cluster)
    assert sorted(set(cgroups.children(parent))) == refilled  # no strays


def test_a_best_effort_create_claims_a_warm_sandbox_and_runs_under_sched_idle(
    container_cluster: LocalCluster, client: Client
) -> None:
    _full(container_cluster)
    with client.create(image="busybox", cpu=0.5, memory_mb=64, best_effort=True) as sb:
        assert _started_warm(container_cluster, sb.id)
        # Field 41 of stat: 5 = SCHED_IDLE, for aether (pid 1, started before the claim),
        # chronus (forked at the claim) and a command; and the sandbox's cpu cgroup is idle.
        r = sb.run(
            "for p in 1 $PPID self; do cut -d' ' -f41 /proc/$p/stat; done;"
            " cat /sys/fs/cgroup/cpu/cpu.idle"
        )
        assert r.stdout.split() == [b"5", b"5", b"5", b"1"], r
    with client.create(image="busybox", cpu=0.5, memory_mb=64) as ls:
        assert _started_warm(container_cluster, ls.id)
        r = ls.run("cut -d' ' -f41 /proc/1/stat /proc/self/stat; cat /sys/fs/cgroup/cpu/cpu.idle")
        assert r.stdout.split() == [b"0", b"0", b"0"], r


def test_creates_the_pool_cannot_serve_start_cold(
    container_cluster: LocalCluster, client: Client
) -> None:
    _full(container_cluster)
    with client.create(image="busybox", cpu=0.5, memory_mb=64, disk_mb=32) as quota:
        assert not _started_warm(container_cluster, quota.id)  # a disk quota: its own filesystem
        assert quota.run("true").exit_code == 0
    with client.create(image="bookworm", cpu=0.5, memory_mb=128) as other:
        assert not _started_warm(container_cluster, other.id)  # no warm sandboxes of that image
    _full(container_cluster)
    status = _pool_status(container_cluster)
    # more creates at once than the pool holds: one of them starts cold
    many = client.create_many(POOL + 1, image="busybox", cpu=0.2, memory_mb=64)
    try:
        assert all(not isinstance(sb, Exception) for sb in many), many
        warm = [_started_warm(container_cluster, sb.id) for sb in many]  # type: ignore[union-attr]
        assert sorted(warm) == [False] + [True] * POOL, warm
        assert all(sb.run("true").exit_code == 0 for sb in many)  # type: ignore[union-attr]
    finally:
        for sb in many:
            if not isinstance(sb, Exception):
                sb.stop()
    assert _pool_status(container_cluster).missed == status.missed + 1


def test_a_broken_warm_sandbox_is_replaced(container_cluster: LocalCluster, client: Client) -> None:
    victim = _full(container_cluster)[0]
    os.kill(json.loads(_runc(container_cluster, "state", victim).stdout)["pid"], signal.SIGKILL)
    wait_for(
        lambda: (
            victim not in _warm_ids(container_cluster) and len(_warm_ids(container_cluster)) == POOL
        )
    )
    with client.create(image="busybox", cpu=0.5, memory_mb=64) as sb:
        assert sb.run("echo ok").stdout == b"ok\n"


def test_edge_restart_keeps_claimed_sandboxes_and_replaces_warm_ones(
    container_cluster: LocalCluster, client: Client
) -> None:
    _full(container_cluster)
    sb = client.create(image="busybox", cpu=0.5, memory_mb=64, env={"K": "v"})
    try:
        assert _started_warm(container_cluster, sb.id)
        warm_before = set(_warm_ids(container_cluster))
        container_cluster.kill(f"edge-{EDGE}", signal.SIGKILL)
        container_cluster.restart(f"edge-{EDGE}")
        after = set(_full(container_cluster))
        assert not after & warm_before  # the unowned ones were removed as orphans
        r = wait_for(lambda: _ok(client, sb.id), timeout_s=20)
        assert r == b"v\n"
    finally:
        sb.stop()


def _ok(client: Client, sandbox_id: str) -> bytes | None:
    try:
        return client.get(sandbox_id).run("echo $K").stdout
    except Exception:
        return None


def test_placement_sends_creates_to_the_edge_with_warm_sandboxes(
    cluster_with: ClusterWith,
) -> None:
    """Two edges, one keeping warm busybox sandboxes: creates it can serve go there (as long as
    it has some), whatever the load; others are placed by load as always."""
    from dsec.watcher.v1 import watcher_pb2, watcher_pb2_grpc

    edges = [container_edge("plw", {"DSEC_EDGE_WARM_POOL": "busybox=2"}), container_edge("plc")]

    def watcher_sees_warm() -> bool:
        with grpc.insecure_channel(c.process("watcher").address) as ch:
            snap = (
                watcher_pb2_grpc.WatcherServiceStub(ch)
                .GetClusterSnapshot(watcher_pb2.GetClusterSnapshotRequest(), timeout=10)
                .snapshot
            )
        return any(
            e.info.edge_id == "plw" and e.load.warm_ready["busybox"] == 2 for e in snap.edges
        )

    made = []
    with cluster_with("plw", edges=edges) as c, Client(c.apiserver, token=c.token) as client:
        wait_for(watcher_sees_warm, timeout_s=30)
        for _ in range(2):
            sb = client.create(image="busybox", cpu=0.2, memory_mb=64)
            made.append(sb)
            assert sb.info.edge_id == "plw"
            assert sb.run("true").exit_code == 0
        for sb in made:
            sb.stop()


def test_an_edge_stopping_while_its_pool_fills_leaves_no_sandbox(
    cluster_with: ClusterWith,
) -> None:
    """Stopped a moment after its start, while its pool is still filling (a start under way in
    runc's thread), the edge removes every warm sandbox, the one being started included."""
    parent = f"dsec-test-{os.getpid()}-stp"
    with cluster_with("stp", edge_env={"DSEC_EDGE_WARM_POOL": "busybox=40"}) as c:
        root = c.home / "edges" / "stp" / "container" / "runtime" / "runc"
        wait_for(
            lambda: subprocess.run(
                ["runc", "--root", str(root), "list", "-q"], capture_output=True, text=True
            ).stdout.split(),
            timeout_s=30,
        )  # filling has begun
    assert cgroups.children(parent) == set()
    pids = Path("/sys/fs/cgroup/pids") / parent / "cgroup.procs"
    assert not pids.exists() or pids.read_text() == ""
