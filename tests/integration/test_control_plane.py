"""The control plane at scale, through real service processes: several API
servers and null-runtime edges, IAM on SQLite (and on PostgreSQL at the end).

Covers: any API server serves any sandbox; durable idempotency keys shared by
all API servers; bursts with per-item results; bad input and failures (no or
bad token, another project's sandbox, quota naming the limiting project, no
eligible edge, edge capacity); exact quota under racing clients; watcher
counts per edge, principal and task; the watcher's restart (placement degrades,
keeps placing, recovers); quota reconciliation (leaked reservations, a
restarted edge, an edge killed during a burst).
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from dsec.iam.v1 import iam_pb2, iam_pb2_grpc
from dsec.placement.v1 import placement_pb2, placement_pb2_grpc
from dsec.types.v1 import types_pb2
from dsec.watcher.v1 import watcher_pb2, watcher_pb2_grpc
from dsecctl.cluster import EdgeSpec, LocalCluster, health
from libdsec import Client, Quota
from libdsec.errors import (
    EdgeCapacity,
    NoEligibleEdge,
    QuotaExceeded,
    SandboxNotFound,
    SandboxTerminated,
    Unauthenticated,
)
from tests.conftest import print_log_tails
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith
from tests.pgserver import PostgresServer

#: Fast reconciliation so the tests see it within seconds.
FAST_RECONCILE = {
    "DSEC_WATCHER_RECONCILE_INTERVAL_S": "1",
    "DSEC_WATCHER_RECONCILE_GRACE_S": "1",
    "DSEC_WATCHER_RELEASE_GONE_AFTER_S": "3",
}
BIG = {"cpu_millis": 64_000, "memory_mb": 1_000_000}
VIEW_HEALTH = "dsec.placement.v1.ClusterView"


@pytest.fixture(scope="module")
def cp(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """Two API servers, three null edges (one small, labelled zone=z)."""
    with cluster_with(
        "cp",
        edges=[
            EdgeSpec(edge_id="cpa", runtime="null", **BIG),  # type: ignore[arg-type]
            EdgeSpec(edge_id="cpb", runtime="null", **BIG),  # type: ignore[arg-type]
            EdgeSpec(edge_id="cpc", runtime="null", labels={"zone": "z"}, max_sandboxes=2, **BIG),  # type: ignore[arg-type]
        ],
        apiservers=2,
        extra_env=FAST_RECONCILE,
    ) as c:
        yield c


def apis(c: LocalCluster) -> list[str]:
    return [p.address for p in c.processes if p.name.startswith("apiserver")]


def project_with_token(
    c: LocalCluster, name: str, quota: Quota | None = None, parent: str = ""
) -> tuple[str, str]:
    with Client(c.apiserver, token=c.token) as admin:
        p = admin.create_project(name, parent=parent, quota=quota or Quota())
        t = admin.create_token(f"{name}-agent", project=p.project_id, agent=True)
    return p.project_id, t.secret


def usage(c: LocalCluster, project_id: str) -> int:
    with Client(c.apiserver, token=c.token) as admin:
        return admin.get_project(project_id).usage.sandboxes


def snapshot(c: LocalCluster) -> watcher_pb2.ClusterSnapshot:
    with grpc.insecure_channel(c.process("watcher").address) as ch:
        return (
            watcher_pb2_grpc.WatcherServiceStub(ch)
            .GetClusterSnapshot(watcher_pb2.GetClusterSnapshotRequest(), timeout=5)
            .snapshot
        )


def placement_status(c: LocalCluster) -> placement_pb2.GetPlacementStatusResponse:
    with grpc.insecure_channel(c.process("placement").address) as ch:
        return placement_pb2_grpc.PlacementServiceStub(ch).GetPlacementStatus(
            placement_pb2.GetPlacementStatusRequest(), timeout=5
        )


def live(c: LocalCluster, token: str, task: str = "") -> list[str]:
    with Client(c.apiserver, token=token) as cl:
        return [s.id for s in cl.list(task_id=task) if not s.terminated]


# ----------------------------------------------------------------- routing


def test_any_api_server_serves_any_sandbox(cp: LocalCluster) -> None:
    a, b = apis(cp)
    _, token = project_with_token(cp, "routing")
    with Client(a, token=token) as ca, Client(b, token=token) as cb:
        assert ca.whoami().project_id == cb.whoami().project_id
        made = ca.create_many(6, image="busybox", cpu=0.1, memory_mb=32, task_id="route")
        try:
            ids = {s.id for s in made if not isinstance(s, Exception)}
            assert len(ids) == 6
            # Created through A, read through B at once: B learns the edges it has not heard
            # of yet (each one of them, not only the one a snapshot happened to show).
            for one in sorted(ids):
                assert cb.get(one).info.state == "RUNNING"
            assert set(live(cp, token, "route")) == ids
            assert set(cb.stop_all(task_id="route")) == ids  # bulk stop by task, every edge
            assert live(cp, token, "route") == []
            assert ca.get(one).info.termination_reason == "STOPPED"
        finally:  # the small edge cpc must be empty for the tests after this one
            ca.stop_all(task_id="route")


def test_idempotency_keys_are_durable_across_api_servers(cp: LocalCluster) -> None:
    a, b = apis(cp)
    project, token = project_with_token(cp, "idem")
    with Client(a, token=token) as ca, Client(b, token=token) as cb:
        first = ca.create(image="busybox", cpu=0.1, memory_mb=32, idempotency_key="job-1")
        again = cb.create(image="busybox", cpu=0.1, memory_mb=32, idempotency_key="job-1")
        assert again.id == first.id
        # Racing retries of one create through both API servers make one sandbox.
        with ThreadPoolExecutor(8) as pool:
            racers = [
                pool.submit(
                    (ca if i % 2 else cb).create,
                    image="busybox",
                    cpu=0.1,
                    memory_mb=32,
                    idempotency_key="job-2",
                )
                for i in range(8)
            ]
            assert len({f.result().id for f in racers}) == 1
        # Keys inside a burst: a duplicate key returns the same sandbox.
        out = cb.create_many(
            specs=[
                {"image": "busybox", "cpu": 0.1, "memory_mb": 32, "idempotency_key": "b-1"},
                {"image": "busybox", "cpu": 0.1, "memory_mb": 32, "idempotency_key": "b-1"},
                {"image": "busybox", "cpu": 0.1, "memory_mb": 32, "idempotency_key": "job-1"},
            ]
        )
        assert not any(isinstance(o, Exception) for o in out)
        assert out[0].id == out[1].id and out[2].id == first.id  # type: ignore[union-attr]
        # A stopped sandbox's key still returns it (no second create): the SDK
        # reports the ended sandbox as such.
        first.stop()
        with pytest.raises(SandboxTerminated) as info:
            ca.create(image="busybox", idempotency_key="job-1")
        assert info.value.metadata["sandbox_id"] == first.id
        # Keys are per project.
    _, other = project_with_token(cp, "idem2")
    with Client(a, token=other) as co:
        elsewhere = co.create(image="busybox", cpu=0.1, idempotency_key="job-1")
        assert elsewhere.id != first.id
        elsewhere.stop()
    assert usage(cp, project) == 2  # job-2 and b-1 are running; job-1 stopped
    with Client(a, token=token) as ca:
        for sb in ca.list():
            ca.get(sb.id).stop()


# --------------------------------------------------------- bad input, failures


def test_bad_tokens_and_other_projects(cp: LocalCluster) -> None:
    for target in apis(cp):
        with Client(target, token="") as c, pytest.raises(Unauthenticated) as info:
            c.create(image="busybox")
        assert info.value.reason == "NO_TOKEN"
        with Client(target, token="dsec_abc_def") as c, pytest.raises(Unauthenticated):
            c.create_many(2, image="busybox")
    _, mine = project_with_token(cp, "mine")
    _, theirs = project_with_token(cp, "theirs")
    with Client(apis(cp)[0], token=mine) as m:
        sb = m.create(image="busybox", cpu=0.1, memory_mb=32)
        for target in apis(cp):
            with Client(target, token=theirs) as t:
                with pytest.raises(SandboxNotFound):
                    t.get(sb.id)
                with pytest.raises(SandboxNotFound):
                    t.get(sb.id[:-4] + "0000")  # a missing one looks the same
                assert sb.id not in {s.id for s in t.list(include_subprojects=True)}
        sb.stop()


def test_quota_exceeded_names_the_limiting_project(cp: LocalCluster) -> None:
    team, _ = project_with_token(cp, "qteam", Quota(sandboxes=4, cpu_millis=10_000))
    run1, t1 = project_with_token(cp, "run1", Quota(sandboxes=3), parent=team)
    _, t2 = project_with_token(cp, "run2", Quota(sandboxes=3), parent=team)
    with Client(apis(cp)[0], token=t1) as c1, Client(apis(cp)[1], token=t2) as c2:
        first = c1.create_many(4, image="busybox", cpu=0.1, memory_mb=32)
        assert isinstance(first[3], QuotaExceeded) and first[3].metadata["project"] == run1
        second = c2.create_many(3, image="busybox", cpu=0.1, memory_mb=32)
        errors = [o for o in second if isinstance(o, Exception)]
        assert len(errors) == 2 and all(isinstance(e, QuotaExceeded) for e in errors)
        assert errors[0].metadata["project"] == team  # the parent binds, not run2
        with pytest.raises(QuotaExceeded) as info:
            c2.create(image="busybox", cpu=0.1, memory_mb=32)
        assert info.value.metadata["project"] == team
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        for s in first + second:
            if not isinstance(s, Exception):
                s.stop()
    wait_for(lambda: usage(cp, team) == 0)


def test_no_eligible_edge_and_edge_capacity(cp: LocalCluster) -> None:
    _, token = project_with_token(cp, "fit")
    with Client(apis(cp)[0], token=token) as c:
        with pytest.raises(NoEligibleEdge) as info:
            c.create(image="busybox", gpus=1)
        assert (
            "3 edges" in str(info.value) and info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        with pytest.raises(NoEligibleEdge, match="labels do not match"):
            c.create(image="busybox", node_selector={"zone": "nowhere"})
        # Only cpc matches zone=z and admits 2: the edge has the final say, placement
        # cannot know its sandbox limit, and the third item fails with the edge's reason.
        out = c.create_many(3, image="busybox", cpu=0.1, memory_mb=32, node_selector={"zone": "z"})
        made = [o for o in out if not isinstance(o, Exception)]
        refused = [o for o in out if isinstance(o, Exception)]
        assert 1 <= len(made) <= 2 and {s.info.edge_id for s in made} == {"cpc"}
        assert len(refused) == 3 - len(made)
        assert all(isinstance(e, EdgeCapacity) for e in refused), refused
        assert "cpc is full" in str(refused[0])
        for s in made:
            s.stop()


def test_quota_is_exact_when_clients_race_in_sibling_projects(cp: LocalCluster) -> None:
    """16 clients (over both API servers) race in 4 sibling subprojects of a
    project with 40 sandboxes; each subproject holds 15. Exactly 40 are created
    and every refusal names the project that bound."""
    parent, _ = project_with_token(cp, "race", Quota(sandboxes=40))
    tokens = [project_with_token(cp, f"s{i}", Quota(sandboxes=15), parent=parent) for i in range(4)]
    created: list[str] = []
    refusals: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        _, token = tokens[i % 4]
        with Client(apis(cp)[i % 2], token=token) as c:
            for j in range(6):
                if j % 3 == 2:
                    results = c.create_many(3, image="busybox", cpu=0.1, memory_mb=16)
                else:
                    try:
                        results = [c.create(image="busybox", cpu=0.1, memory_mb=16)]
                    except QuotaExceeded as err:
                        results = [err]
                with lock:
                    for r in results:
                        if isinstance(r, QuotaExceeded):
                            refusals.append(r.metadata["project"])
                        else:
                            assert not isinstance(r, Exception), r
                            created.append(r.id)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(client, range(16)))
    assert len(created) == len(set(created)) == 40
    assert usage(cp, parent) == 40
    assert all(usage(cp, p) <= 15 for p, _ in tokens)
    assert set(refusals) <= {parent} | {p for p, _ in tokens} and refusals
    with Client(cp.apiserver, token=cp.token) as admin:
        for sid in created:
            admin.get(sid).stop()
    wait_for(lambda: usage(cp, parent) == 0)


# -------------------------------------------------------------------- watcher


def test_watcher_counts_per_edge_principal_and_task(cp: LocalCluster) -> None:
    _, t1 = project_with_token(cp, "count1")
    _, t2 = project_with_token(cp, "count2")
    with Client(cp.apiserver, token=t1) as c1, Client(cp.apiserver, token=t2) as c2:
        p1 = c1.whoami().principal_id
        p2 = c2.whoami().principal_id
        a = c1.create_many(5, image="busybox", cpu=0.1, memory_mb=16, task_id="count-task")
        b = c2.create_many(3, image="busybox", cpu=0.1, memory_mb=16, task_id="count-task")

        def counted() -> watcher_pb2.ClusterSnapshot | None:
            snap = snapshot(cp)
            ok = (
                snap.sandboxes_by_principal.get(p1) == 5
                and snap.sandboxes_by_principal.get(p2) == 3
                and snap.sandboxes_by_task.get("count-task") == 8
            )
            return snap if ok else None

        snap = wait_for(counted, timeout_s=10)
        per_edge = {e.info.edge_id: e.sandboxes_by_task.get("count-task", 0) for e in snap.edges}
        assert sum(per_edge.values()) == 8
        assert sum(e.sandboxes_by_principal.get(p1, 0) for e in snap.edges) == 5
        assert all(e.health == watcher_pb2.EDGE_HEALTH_HEALTHY for e in snap.edges)
        for s in a + b:
            s.stop()  # type: ignore[union-attr]
        wait_for(lambda: snapshot(cp).sandboxes_by_task.get("count-task", 0) == 0)


def test_reconciliation_releases_what_no_edge_holds(cp: LocalCluster) -> None:
    """A reservation whose sandbox never reached its edge (an API server that
    died mid-create) is released once older than the grace period."""
    project, token = project_with_token(cp, "leak")
    with grpc.insecure_channel(cp.process("iam").address) as ch:
        iam = iam_pb2_grpc.IamServiceStub(ch)
        for i in range(3):
            iam.ReserveQuota(
                iam_pb2.ReserveQuotaRequest(
                    project_id=project,
                    sandbox_id=f"sb-cpa-dead{i:04d}beef",
                    backend=types_pb2.BACKEND_CONTAINER,
                    cpu_millis=100,
                    memory_mb=16,
                    edge_id="cpa",
                ),
                timeout=5,
            )
    with Client(cp.apiserver, token=token) as c:
        kept = c.create(image="busybox", cpu=0.1, memory_mb=16)
        assert usage(cp, project) == 4
        wait_for(lambda: usage(cp, project) == 1, timeout_s=15)
        kept.stop()


def test_edge_restart_releases_the_quota_of_sandboxes_it_lost(cp: LocalCluster) -> None:
    """A null edge killed and restarted has lost its sandboxes (nothing to
    re-adopt): reconciliation releases their quota."""
    project, token = project_with_token(cp, "restart")
    with Client(cp.apiserver, token=token) as c:
        out = c.create_many(10, image="busybox", cpu=0.1, memory_mb=16, task_id="rs")
        on_b = [s.id for s in out if not isinstance(s, Exception) and s.info.edge_id == "cpb"]
        assert on_b and usage(cp, project) == 10
        cp.kill("edge-cpb")
        cp.restart("edge-cpb")
        wait_for(lambda: usage(cp, project) == 10 - len(on_b), timeout_s=20)
        for s in out:
            if not isinstance(s, Exception) and s.id not in on_b:
                s.stop()
    wait_for(lambda: usage(cp, project) == 0)


def test_watcher_down_placement_degrades_then_the_view_is_rebuilt(cp: LocalCluster) -> None:
    _, token = project_with_token(cp, "wdown")
    placement = cp.process("placement").address
    assert health(placement, service=VIEW_HEALTH) == "SERVING"
    assert placement_status(cp).view_state == placement_pb2.VIEW_STATE_FRESH
    with Client(cp.apiserver, token=token) as c:
        c.create_many(4, image="busybox", cpu=0.1, memory_mb=16, task_id="wd")
    cp.kill("watcher")
    try:
        wait_for(lambda: health(placement, service=VIEW_HEALTH) == "NOT_SERVING", timeout_s=10)
        st = placement_status(cp)
        assert st.view_state == placement_pb2.VIEW_STATE_DEGRADED and not st.watcher_connected
        assert st.edges == 3 and st.view_age_s >= 0
        assert health(placement) == "SERVING"  # still placing, on its last snapshot
        with Client(cp.apiserver, token=token) as c:
            during = c.create_many(4, image="busybox", cpu=0.1, memory_mb=16, task_id="wd")
            assert not any(isinstance(s, Exception) for s in during)
    finally:
        started = time.monotonic()
        cp.restart("watcher")
    # Rebuilt from re-registrations (every 2 s) and probes: edges and counts.
    snap = wait_for(
        lambda: (s := snapshot(cp)).sandboxes_by_task.get("wd") == 8 and len(s.edges) == 3 and s,
        timeout_s=10,
    )
    assert time.monotonic() - started < 10
    assert {e.info.edge_id for e in snap.edges} == {"cpa", "cpb", "cpc"}
    wait_for(lambda: health(placement, service=VIEW_HEALTH) == "SERVING", timeout_s=10)
    with Client(cp.apiserver, token=token) as c:
        c.stop_all(task_id="wd")


def test_an_edge_back_before_it_was_judged_unhealthy_stays_healthy(
    cluster_with: ClusterWith,
) -> None:
    """An edge killed and started again within the watcher's ``unhealthy_after`` probes (3, at
    0.5 s). The probes that failed while it was down were of its previous process: its new
    incarnation starts the count again, and the watcher connects to it afresh (its channel to
    the dead process may be backing off). Before, the edge could turn UNHEALTHY just after it
    was back, and creates found no eligible edge (a CI failure)."""
    with cluster_with("ra", edges=[EdgeSpec(edge_id="ra", runtime="null")]) as c:
        for down_s in (0.5, 0.7, 0.9, 1.1):  # where the old process's failures fall varies
            before = snapshot(c).edges[0].info.incarnation
            assert before
            seen = _health_while(c, functools.partial(_restart_after, c, "edge-ra", down_s))
            new = [(at, h) for at, h, inc in seen if inc != before]
            assert new, seen
            # It may be UNHEALTHY when it registers (down longer than unhealthy_after probes,
            # as under load): HEALTHY from the probe its registration triggers, and from then
            # on (before, a probe of the new process could still fail on the old channel).
            first = next((i for i, (_, h) in enumerate(new) if h == "HEALTHY"), None)
            assert first is not None and new[first][0] - new[0][0] < 1.0, (down_s, seen)
            assert {h for _, h in new[first:]} == {"HEALTHY"}, (down_s, seen)


def _restart_after(c: LocalCluster, name: str, down_s: float) -> None:
    c.kill(name)
    time.sleep(down_s)
    c.restart(name)
    time.sleep(2.0)  # past unhealthy_after probes


def _health_while(c: LocalCluster, action: Callable[[], None]) -> list[tuple[float, str, str]]:
    """The first edge's (time, health, incarnation) as the watcher saw it every 50 ms while
    ``action`` ran."""
    seen: list[tuple[float, str, str]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            e = snapshot(c).edges[0]
            name = watcher_pb2.EdgeHealth.Name(e.health).removeprefix("EDGE_HEALTH_")
            seen.append((time.monotonic(), name, e.info.incarnation))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        action()
    finally:
        stop.set()
        sampler.join()
    return seen


# ------------------------------------------------------------- edge killed


def test_edge_killed_during_a_burst_leaks_no_quota(cluster_with: ClusterWith) -> None:
    """An edge frozen (SIGSTOP) and then killed (SIGKILL) while a burst is being
    created on it: its share is retried on the other edges, every item is created,
    and IAM's usage comes back to exactly the number of live sandboxes (the
    killed edge's admitted sandboxes and unknown-outcome reservations are
    released once it is gone)."""
    with cluster_with(
        "burst",
        edges=[EdgeSpec(edge_id=f"k{i}", runtime="null", **BIG) for i in range(4)],  # type: ignore[arg-type]
        extra_env=FAST_RECONCILE,
    ) as c:
        try:
            project, token = project_with_token(c, "burst")
            with Client(c.apiserver, token=token) as cl:
                before = cl.create_many(200, image="busybox", cpu=0.1, memory_mb=16, task_id="kb")
                assert not any(isinstance(s, Exception) for s in before)
                on_victim = sum(1 for s in before if s.info.edge_id == "k3")  # type: ignore[union-attr]
                assert on_victim > 0
                victim = c.process("edge-k3")
                os.kill(victim.pid, signal.SIGSTOP)  # placement still sees it healthy for ~1.5 s
                killer = threading.Timer(0.5, lambda: c.kill("edge-k3"))
                killer.start()
                try:
                    out = cl.create_many(2000, image="busybox", cpu=0.1, memory_mb=16, task_id="kb")
                finally:
                    killer.join()
                failed = [o for o in out if isinstance(o, Exception)]
                assert not failed, failed[:3]
                assert all(s.info.edge_id != "k3" for s in out)  # type: ignore[union-attr]
                expected = 2200 - on_victim
                wait_for(lambda: usage(c, project) == expected, timeout_s=30)
                assert len(live(c, token, "kb")) == expected
                time.sleep(2)  # and it stays exact (nothing released twice)
                assert usage(c, project) == expected
                cl.stop_all(task_id="kb")
            wait_for(lambda: usage(c, project) == 0, timeout_s=15)
        except BaseException:
            print_log_tails(c, "edge killed during a burst")
            raise


# ------------------------------------------------------------- PostgreSQL


def test_cluster_with_iam_on_postgresql(
    postgres: PostgresServer, cluster_with: ClusterWith
) -> None:
    """The same control plane with IAM on a real PostgreSQL server: projects,
    tokens, quotas, bursts, durable idempotency keys across API servers, quota
    release on stop, and exactness under racing clients."""
    with cluster_with(
        "pg",
        edges=[EdgeSpec(edge_id=f"pg{i}", runtime="null", **BIG) for i in range(2)],  # type: ignore[arg-type]
        apiservers=2,
        extra_env=FAST_RECONCILE,
        iam_database=postgres.create_database("cluster"),
    ) as c:
        try:
            a, b = apis(c)
            team, _ = project_with_token(c, "team", Quota(sandboxes=30))
            subs = [
                project_with_token(c, f"r{i}", Quota(sandboxes=20), parent=team) for i in range(2)
            ]
            with Client(a, token=subs[0][1]) as ca, Client(b, token=subs[0][1]) as cb:
                assert ca.whoami().project_id == subs[0][0]
                x = ca.create(image="busybox", cpu=0.1, memory_mb=16, idempotency_key="pg-1")
                assert (
                    cb.create(image="busybox", cpu=0.1, memory_mb=16, idempotency_key="pg-1").id
                    == x.id
                )
                x.stop()
            wait_for(lambda: usage(c, team) == 0)

            created: list[str] = []
            lock = threading.Lock()

            def racer(i: int) -> None:
                _, token = subs[i % 2]
                with Client(apis(c)[i % 2], token=token) as cl:
                    out = cl.create_many(8, image="busybox", cpu=0.1, memory_mb=16, task_id="pgr")
                    with lock:
                        created.extend(s.id for s in out if not isinstance(s, Exception))
                        assert all(
                            isinstance(s, QuotaExceeded) for s in out if isinstance(s, Exception)
                        )

            with ThreadPoolExecutor(8) as pool:
                list(pool.map(racer, range(8)))
            assert len(created) == 30 and usage(c, team) == 30
            assert all(usage(c, p) <= 20 for p, _ in subs)
            with Client(a, token=c.token) as admin:
                admin.stop_all(task_id="pgr")
            wait_for(lambda: usage(c, team) == 0)
        except BaseException:
            print_log_tails(c, "cluster on PostgreSQL")
            print(postgres.log_tail())
            raise


def test_fork_reserves_quota_for_every_child_first_and_gives_it_back_when_refused(
    cp: LocalCluster,
) -> None:
    """ForkSandbox through the API servers (the null backend cannot fork: the edge answers
    UNIMPLEMENTED after the quota was reserved, which must come back)."""
    from libdsec.aio import AsyncSandbox
    from libdsec.errors import BackendCapabilityMissing, InvalidArgument
    from libdsec.sync import Sandbox

    _, tok = project_with_token(cp, "forkq", Quota(sandboxes=4))
    _, other = project_with_token(cp, "forkq-other")
    with Client(apis(cp)[0], token=tok) as c:
        sb = c.create(image="busybox", cpu=0.1, memory_mb=32)
        for bad in (0, 65):
            with pytest.raises(InvalidArgument) as info:
                sb.fork(bad)
            assert info.value.reason == "FORK_COUNT" and info.value.metadata["field"] == "count"
        with pytest.raises(QuotaExceeded) as quota:
            sb.fork(4)  # 1 + 4 > 4: refused whole, before any edge is asked
        assert quota.value.metadata["children"] == "4"
        with pytest.raises(BackendCapabilityMissing) as unimpl:
            sb.fork(3)  # fits the quota; the null backend cannot fork
        assert unimpl.value.metadata["capability"] == "fork"
        # Nothing of either refusal is held: the project's whole quota is still free.
        rest = c.create_many(3, image="busybox", cpu=0.1, memory_mb=32)
        made = [r for r in rest if not isinstance(r, Exception)]
        assert len(made) == 3, rest
        for r in made:
            r.stop()
        with Client(apis(cp)[1], token=other) as t, pytest.raises(SandboxNotFound):
            # A handle to another project's sandbox: it is not found, not forked.
            Sandbox(t, AsyncSandbox(t._async, sb.info)).fork(1)
        sb.stop()
        with pytest.raises(SandboxTerminated):
            sb.fork(1)
