"""Creates that wait their turn (``wait_s``): the create queue, end to end.

The module's cluster has one small container node (1280 MiB at memory overcommit 1: two
sandboxes of 512 MiB) and two API servers; every test fills the node itself and leaves it
empty. What is checked: fair share between two projects as room frees one sandbox at a
time, a pause that gives memory back placing a queued create at once, the deadline
(QUEUE_TIMEOUT naming what it waited for), a cancel while queued, bad input, a create no
edge could ever hold, and an API server SIGKILLed while a burst waits (each create placed
exactly once afterwards).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError, ThreadPoolExecutor

import grpc
import pytest

from dsec.iam.v1 import iam_pb2, iam_pb2_grpc
from dsec.types.v1 import types_pb2
from dsecctl.cluster import LocalCluster
from libdsec import Client, Quota, Sandbox
from libdsec.errors import (
    Cancelled,
    DSecError,
    ExceedsEveryEdge,
    InvalidArgument,
    QueueTimeout,
    ResourceExhausted,
)
from libdsec.types import SandboxInfo
from tests.helpers import dsec_status, wait_for
from tests.integration.conftest import ClusterWith, container_edge

NODE_MEMORY_MB = 1280
BIG = 512  # two fit


@pytest.fixture(scope="module")
def qc(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    edge = container_edge("q0", {"DSEC_EDGE_MEMORY_OVERCOMMIT": "1"}, memory_mb=NODE_MEMORY_MB)
    # A reservation no edge holds is released 20 s after it was made (default 30 s): longer
    # than an API server waits for a key's create in progress elsewhere (IDEMPOTENT_WAIT_S).
    grace = {"DSEC_WATCHER_RECONCILE_GRACE_S": "20"}
    with cluster_with("q0", edges=[edge], apiservers=2, extra_env=grace) as c:
        yield c


def project(c: LocalCluster, name: str, weight: float = 0.0) -> str:
    with Client(c.apiserver, token=c.token) as admin:
        p = admin.create_project(name, quota=Quota(share_weight=weight))
        return admin.create_token(f"{name}-agent", project=p.project_id, agent=True).secret


@pytest.fixture
def clean(qc: LocalCluster) -> Iterator[None]:
    """After a test: every waiting create cancelled, every sandbox stopped, the node empty."""
    try:
        yield
    finally:
        with Client(qc.apiserver, token=qc.token) as admin:
            for e in admin.queue(include_entries=True).entries:
                with contextlib.suppress(DSecError):
                    admin.get(e.id).stop(grace_s=0)
            for s in admin.list(include_subprojects=True):
                if not s.terminated:
                    with contextlib.suppress(DSecError):
                        admin.get(s.id).stop(grace_s=0)
            wait_for(lambda: admin.queue().waiting == 0, 20)
            wait_for(lambda: not live(admin, subprojects=True), 60)
        time.sleep(1.2)  # placement's view of the node (probed every 0.5 s) has them gone


@pytest.fixture
def pool(clean: None) -> Iterator[ThreadPoolExecutor]:
    """Threads for creates that wait; a failed test does not wait for them (``clean``, torn
    down after this, cancels what still waits, which ends them)."""
    ex = ThreadPoolExecutor(2)
    yield ex
    ex.shutdown(wait=False)


def placed(c: Client) -> list[SandboxInfo]:
    """Every sandbox of the caller's project, whatever its state (queue entries aside)."""
    return [s for s in c.list() if not s.id.startswith("sb-queued-")]


def live(c: Client, subprojects: bool = False) -> list[SandboxInfo]:
    return [
        s
        for s in c.list(include_subprojects=subprojects)
        if not s.terminated and not s.id.startswith("sb-queued-")
    ]


def fill(c: Client, n: int = 2, memory_mb: int = BIG) -> list[Sandbox]:
    return [c.create(image="busybox", cpu=0.1, memory_mb=memory_mb) for _ in range(n)]


def test_two_projects_are_placed_alternately_as_room_frees(
    qc: LocalCluster, pool: ThreadPoolExecutor
) -> None:
    ta, tb, th = project(qc, "qa"), project(qc, "qb"), project(qc, "qh")
    with (
        Client(qc.apiserver, token=ta) as a,
        Client(qc.process("apiserver1").address, token=tb) as b,
        Client(qc.apiserver, token=th) as h,
    ):
        holders = fill(h)
        with pytest.raises(ResourceExhausted):  # full, and no wait_s: refused at once, as before
            a.create(image="busybox", cpu=0.1, memory_mb=BIG)
        # A's six arrive before B's six: fair share, not arrival order, decides.
        fa = pool.submit(a.create_many, 6, image="busybox", cpu=0.1, memory_mb=BIG, wait_s=180)
        wait_for(lambda: a.queue().waiting == 6, 15)
        fb = pool.submit(b.create_many, 6, image="busybox", cpu=0.1, memory_mb=BIG, wait_s=180)
        wait_for(lambda: b.queue().waiting == 6, 15)
        q = a.queue(include_entries=True)
        assert [(g.task_id, g.waiting) for g in q.groups] == [("", 6)] and q.dispatcher
        first = q.entries[0]
        assert first.state == "PENDING" and first.id.startswith("sb-queued-")
        assert first.queue is not None and first.queue.position >= 1
        why = first.queue.reason  # the last refusal: placement's, or the edge's
        assert "not enough free capacity" in why or "is full" in why, why
        assert a.get(first.id).info.state == "PENDING"  # get by the queue id
        assert any(s.id == first.id for s in a.list(states=["PENDING"]))
        assert h.queue().waiting == 0  # nothing of another project
        victims: list[Sandbox] = list(holders)
        for step in range(1, 13):
            victims.pop(0).stop(grace_s=0)
            wait_for(lambda n=step: len(placed(a)) + len(placed(b)) >= n, 30)
            na, nb = len(placed(a)), len(placed(b))
            # Each freed place went to one of them, and the counts stay within one of each other.
            assert na + nb == step and abs(na - nb) <= 1, (step, na, nb)
            if not victims:
                victims = [
                    c.get(s.id)
                    for c in (a, b)
                    for s in sorted(live(c), key=lambda s: str(s.created_at))
                ]
        created = fa.result(60) + fb.result(60)
        assert all(isinstance(s, Sandbox) for s in created), created
        assert len({s.id for s in created if isinstance(s, Sandbox)}) == 12


def test_a_pause_that_gives_memory_back_places_a_queued_create_at_once(
    qc: LocalCluster, pool: ThreadPoolExecutor
) -> None:
    with Client(qc.apiserver, token=qc.token) as c:
        holders = fill(c)
        waiting = pool.submit(c.create, image="busybox", cpu=0.1, memory_mb=BIG, wait_s=60)
        wait_for(lambda: c.queue().waiting == 1, 15)
        holders[0].pause()
        paused = time.monotonic()
        sb = waiting.result(30)
        took = time.monotonic() - paused
        assert sb.info.state == "RUNNING" and sb.info.queue is not None
        assert sb.info.queue.placed_sandbox_id == sb.id
        assert took < 1.5, f"placed {took:.2f} s after the pause"
        assert sb.run("echo placed").text == "placed\n"


def test_a_big_create_at_the_head_does_not_hold_a_small_one_behind_it(
    qc: LocalCluster, pool: ThreadPoolExecutor
) -> None:
    tx, ty = project(qc, "qx"), project(qc, "qy")
    with Client(qc.apiserver, token=tx) as x, Client(qc.apiserver, token=ty) as y:
        (holder,) = fill(x, 1)  # 768 MiB left
        big = pool.submit(x.create, image="busybox", cpu=0.1, memory_mb=1024, wait_s=60)
        wait_for(lambda: x.queue().waiting == 1, 15)
        t0 = time.monotonic()
        small = y.create(image="busybox", cpu=0.1, memory_mb=256, wait_s=30)
        assert time.monotonic() - t0 < 5 and small.info.state == "RUNNING"
        assert not big.done() and x.queue().waiting == 1  # the big one still waits its turn
        holder.stop(grace_s=0)
        assert big.result(30).info.state == "RUNNING"


def test_the_deadline_ends_a_queued_create_and_a_stop_cancels_one(
    qc: LocalCluster, pool: ThreadPoolExecutor
) -> None:
    with Client(qc.apiserver, token=qc.token) as c:
        fill(c)
        t0 = time.monotonic()
        with pytest.raises(QueueTimeout) as info:
            c.create(image="busybox", cpu=0.1, memory_mb=BIG, wait_s=2)
        took = time.monotonic() - t0
        err = info.value
        assert 2 <= took < 6, took
        assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.reason == "QUEUE_TIMEOUT"
        assert "waited 2 s" in str(err) and "not enough free capacity" in str(err), str(err)
        ended = c.get(err.metadata["queue_id"]).info
        assert ended.state == "TERMINATED" and ended.termination_reason == "QUEUE_TIMEOUT"
        # A stop while queued cancels: the waiting call ends with the reason, nothing is placed.
        changes = c.watch(task_id="qw", timeout=30)
        waiting = pool.submit(
            c.create, image="busybox", cpu=0.1, memory_mb=BIG, wait_s=60, task_id="qw"
        )
        wait_for(lambda: c.queue().waiting == 1, 15)
        qid = c.queue(include_entries=True).entries[0].id
        # The operator's view: `dsec queue` and `dsec status`.
        shown = subprocess.run(
            [sys.executable, "-m", "dsecctl", "queue", "--entries"],
            env={**os.environ, "DSEC_HOME": str(qc.home)},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert "1 creates waiting" in shown and qid in shown and "root " in shown, shown
        assert "create queue: 1 creates waiting" in dsec_status(qc.home)
        c.get(qid).stop()
        with pytest.raises(Cancelled, match="cancelled"):
            waiting.result(15)
        gone = c.get(qid).info
        assert gone.state == "TERMINATED" and gone.termination_reason == "STOPPED"
        # The watch saw it join the queue and end there.
        seen = []
        with changes:
            for info in changes:
                seen.append((info.id, info.state, info.termination_reason))
                if info.terminated:
                    break
        assert seen == [(qid, "PENDING", None), (qid, "TERMINATED", "STOPPED")], seen
        assert c.queue().waiting == 0 and len(live(c)) == 2


def test_a_caller_that_goes_away_while_queued_still_gets_its_sandbox_on_retry(
    qc: LocalCluster, pool: ThreadPoolExecutor
) -> None:
    key = f"gone-{secrets.token_hex(4)}"
    with Client(qc.apiserver, token=qc.token) as c:
        holders = fill(c)
        gone = Client(qc.apiserver, token=qc.token)
        call = pool.submit(
            gone.create,
            image="busybox",
            cpu=0.1,
            memory_mb=BIG,
            wait_s=60,
            idempotency_key=key,
        )
        wait_for(lambda: c.queue().waiting == 1, 15)
        gone.close()  # the caller disconnects mid-wait (its process died, say)
        with contextlib.suppress(DSecError, CancelledError):  # closing a client ends its calls
            call.result(15)
        assert c.queue().waiting == 1  # its entry waits on, with nobody attached
        holders[0].stop(grace_s=0)
        wait_for(lambda: c.queue().waiting == 0, 15)  # placed in its turn, nobody waiting
        # The caller's retry (same key) gets that sandbox: nothing is created twice.
        again = c.create(image="busybox", cpu=0.1, memory_mb=BIG, wait_s=60, idempotency_key=key)
        assert again.info.state == "RUNNING"
        assert {s.id for s in live(c)} == {holders[1].id, again.id}


def test_bad_input_and_a_create_no_edge_could_hold_are_refused_at_once(
    qc: LocalCluster, pool: ThreadPoolExecutor
) -> None:
    with Client(qc.apiserver, token=qc.token) as c:
        for bad in (-1.0, 86_401.0, float("nan")):
            with pytest.raises(InvalidArgument, match="wait_s"):
                c.create(image="busybox", wait_s=bad)
        with pytest.raises(InvalidArgument, match="priority"):
            c.create(image="busybox", wait_s=5, priority=5000)
        with pytest.raises(InvalidArgument, match="share_weight"):
            c.create_project("qbad", quota=Quota(share_weight=-2))
        t0 = time.monotonic()
        with pytest.raises(ExceedsEveryEdge) as info:  # more memory than the node has
            c.create(image="busybox", memory_mb=4096, wait_s=600)
        assert time.monotonic() - t0 < 5 and "1280 MB" in str(info.value)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert c.queue().waiting == 0
        with pytest.raises(DSecError) as other:  # a backend no edge offers: at once, too
            c.create(backend="vm", wait_s=600)
        assert other.value.reason == "BACKEND_NOT_OFFERED"


def test_a_queued_create_whose_key_a_dead_dispatcher_reserved_waits_and_is_placed_once(
    qc: LocalCluster, pool: ThreadPoolExecutor
) -> None:
    """The queue's dispatcher reserved an entry's sandbox (the entry's idempotency key now
    names it) and died before its edge got it. The next dispatcher finds the key's create in
    progress: the entry keeps waiting and says why (it neither fails nor holds up the round)
    until reconciliation releases the dead reservation, then takes the key over. A create of
    the burst that came back CREATE_IN_PROGRESS is sent again by the SDK: the burst gets its
    sandbox, and the project holds exactly that one."""
    token = project(qc, "qorphan")
    key = "qorphan-" + secrets.token_hex(4)
    with Client(qc.apiserver, token=token) as c:
        holders = fill(c)
        burst = pool.submit(
            c.create_many,
            specs=[{"image": "busybox", "cpu": 0.1, "memory_mb": BIG, "idempotency_key": key}],
            wait_s=120,
            wait=False,
        )
        wait_for(lambda: c.queue().waiting == 1, 15)
        (entry,) = c.queue(include_entries=True).entries
        orphan = "sb-q0-" + secrets.token_hex(8)
        with grpc.insecure_channel(qc.process("iam").address) as ch:
            iam_pb2_grpc.IamServiceStub(ch).ReserveQuota(
                iam_pb2.ReserveQuotaRequest(
                    project_id=entry.project_id,
                    sandbox_id=orphan,
                    backend=types_pb2.BACKEND_CONTAINER,
                    cpu_millis=100,
                    memory_mb=64,
                    edge_id="q0",
                    idempotency_key=key,
                ),
                timeout=5,
            )
        holders[0].stop(grace_s=0)  # room for it: the dispatcher tries it every round
        why = wait_for(
            lambda: next((e.queue.reason for e in c.queue(include_entries=True).entries
                          if e.queue and "in progress" in e.queue.reason), None),
            15,
        )  # fmt: skip
        assert orphan in why
        (sb,) = burst.result(90)
        assert isinstance(sb, Sandbox), sb
        assert sb.id != orphan and sb.info.state in ("STARTING", "RUNNING")
        assert c.queue().waiting == 0
        ids = {s.id for s in placed(c)} - {h.id for h in holders}
        assert ids == {sb.id}  # nothing placed twice
        sb.stop(grace_s=0)


def test_an_api_server_killed_while_a_burst_waits_places_each_create_once(
    qc: LocalCluster, pool: ThreadPoolExecutor
) -> None:
    """100 creates wait behind a big sandbox; the API server they came through (and that
    may serve the queue) is SIGKILLed and restarted. The SDK's retry (same idempotency keys)
    finds their entries; the other API server takes the queue over; every create gets one
    sandbox, and the project holds exactly 100."""
    token = project(qc, "qburst")
    with Client(qc.apiserver, token=token) as c:
        (big,) = fill(c, 1, memory_mb=1024)
        burst = pool.submit(
            c.create_many,
            100,
            image="busybox",
            cpu=0.05,
            memory_mb=64,
            ttl_s=4,
            wait_s=300,
            wait=False,
        )
        wait_for(lambda: c.queue().waiting >= 90, 30)
        qc.kill("apiserver")
        time.sleep(1.0)
        qc.restart("apiserver")
        big.stop(grace_s=0)
        results = burst.result(240)
        sandboxes = [r for r in results if isinstance(r, Sandbox)]
        assert len(sandboxes) == 100, [r for r in results if not isinstance(r, Sandbox)][:3]
        assert len({s.id for s in sandboxes}) == 100
        wait_for(lambda: c.queue().waiting == 0, 10)
        ids = {s.id for s in placed(c)} - {big.id}
        assert ids == {s.id for s in sandboxes}  # nothing placed twice, nothing extra
