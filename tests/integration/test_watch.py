"""SandboxService/WatchSandboxes through real service processes (null-runtime edges,
container specs): the API server fans in every edge's stream.

Covers: create and stop seen with their states and reason; project isolation (another
project sees nothing, a parent sees its subprojects); task and label filters; keepalives;
two edges reaching one watcher; an edge that appears after the watch started; an edge
killed and restarted (its stream is reopened); bad input.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from dsec.apiserver.v1 import apiserver_pb2, apiserver_pb2_grpc
from dsec.types.v1 import types_pb2
from dsec.watcher.v1 import watcher_pb2
from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client, Quota, Sandbox
from libdsec.errors import (
    InvalidArgument,
    NoEligibleEdge,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)
from tests.helpers import sandbox_factory, wait_for
from tests.integration.conftest import ClusterWith
from tests.integration.test_control_plane import project_with_token, snapshot

STATES = types_pb2.SandboxState
LIFECYCLE = ["PENDING", "STARTING", "RUNNING", "STOPPING", "TERMINATED"]


@pytest.fixture(scope="module")
def wc(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """Two null edges, labelled zone=a and zone=b."""
    with cluster_with(
        "watch",
        edges=[
            EdgeSpec(edge_id="wa", runtime="null", labels={"zone": "a"}),
            EdgeSpec(edge_id="wb", runtime="null", labels={"zone": "b"}),
        ],
    ) as c:
        yield c


class Watch:
    """A WatchSandboxes call, read on a thread of its own; every message kept in order."""

    def __init__(self, target: str, token: str, **request: object) -> None:
        self.channel = grpc.insecure_channel(target)
        stub = apiserver_pb2_grpc.SandboxServiceStub(self.channel)
        self.call = stub.WatchSandboxes(
            apiserver_pb2.WatchSandboxesRequest(**request),  # type: ignore[arg-type]
            metadata=[("authorization", f"Bearer {token}")],
        )
        self.messages: list[apiserver_pb2.WatchSandboxesResponse] = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                self.messages.append(msg)
        except grpc.RpcError as exc:
            self.error = exc

    def keepalives(self) -> int:
        return sum(1 for m in list(self.messages) if m.HasField("keepalive"))

    def established(self) -> None:
        """Until the first keepalive: every edge known at the start is followed."""
        wait_for(lambda: self.keepalives() or self.error, timeout_s=15)
        assert self.error is None, self.error

    def changes(self, sandbox_id: str | None = None) -> list[types_pb2.Sandbox]:
        return [
            m.changed
            for m in list(self.messages)
            if m.HasField("changed") and (sandbox_id is None or m.changed.id == sandbox_id)
        ]

    def states(self, sandbox_id: str) -> list[str]:
        """The states seen for one sandbox, repeats folded (changes are at least once)."""
        out: list[str] = []
        for sb in self.changes(sandbox_id):
            name = STATES.Name(sb.state).removeprefix("SANDBOX_STATE_")
            if not out or out[-1] != name:
                out.append(name)
        return out

    def ids(self) -> set[str]:
        return {sb.id for sb in self.changes()}

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(timeout=10)
        self.channel.close()


@contextmanager
def watching(target: str, token: str, **request: object) -> Iterator[Watch]:
    w = Watch(target, token, **request)
    try:
        w.established()
        yield w
    finally:
        w.close()


def ended(w: Watch, sandbox_id: str) -> bool:
    return "TERMINATED" in w.states(sandbox_id)


def test_create_and_stop_are_seen_with_states_and_reason(
    wc: LocalCluster, request: pytest.FixtureRequest
) -> None:
    _, token = project_with_token(wc, "w-life")
    with (
        Client(wc.apiserver, token=token) as c,
        sandbox_factory(c, request.node.nodeid) as make,
        watching(wc.apiserver, token) as w,
    ):
        sb = make(cpu=0.1, memory_mb=32)
        wait_for(lambda: "RUNNING" in w.states(sb.id))
        sb.stop()
        wait_for(lambda: ended(w, sb.id))
        assert w.states(sb.id) == LIFECYCLE
        last = w.changes(sb.id)[-1]
        assert last.termination.reason == types_pb2.TERMINATION_REASON_STOPPED
        assert last.HasField("termination") and last.termination.HasField("at")
        assert last.project_id == c.whoami().project_id and last.spec.labels["test"]
        assert last.spec.backend == types_pb2.BACKEND_CONTAINER
        assert w.error is None


def test_another_project_sees_nothing_and_a_parent_sees_its_subprojects(
    wc: LocalCluster, request: pytest.FixtureRequest
) -> None:
    parent, parent_token = project_with_token(wc, "w-parent", Quota())
    _, child_token = project_with_token(wc, "w-child", Quota(), parent=parent)
    _, other_token = project_with_token(wc, "w-other")
    with (
        Client(wc.apiserver, token=child_token) as child,
        Client(wc.apiserver, token=other_token) as other,
        sandbox_factory(child, request.node.nodeid) as make_child,
        sandbox_factory(other, request.node.nodeid + "-o") as make_other,
        watching(wc.apiserver, other_token) as w_other,
        watching(wc.apiserver, parent_token) as w_parent,
        watching(wc.apiserver, child_token) as w_child,
    ):
        mine = [make_child(cpu=0.1, memory_mb=32) for _ in range(3)]
        for sb in mine:
            sb.stop()
        theirs = make_other(cpu=0.1, memory_mb=32)  # the positive control of w_other
        wait_for(lambda: all(ended(w_parent, sb.id) and ended(w_child, sb.id) for sb in mine))
        wait_for(lambda: "RUNNING" in w_other.states(theirs.id))
        assert w_other.ids() == {theirs.id}
        assert theirs.id not in w_parent.ids() | w_child.ids()
        assert w_parent.ids() == w_child.ids() == {sb.id for sb in mine}


def test_task_and_label_filters(wc: LocalCluster, request: pytest.FixtureRequest) -> None:
    _, token = project_with_token(wc, "w-filter")
    with (
        Client(wc.apiserver, token=token) as c,
        sandbox_factory(c, request.node.nodeid) as make,
        watching(wc.apiserver, token, task_id="t-1") as by_task,
        watching(wc.apiserver, token, label_selector={"role": "judge"}) as by_label,
        watching(wc.apiserver, token, task_id="t-1", label_selector={"role": "judge"}) as both,
        watching(wc.apiserver, token) as everything,
    ):
        t1_judge = make(cpu=0.1, memory_mb=32, task_id="t-1", labels={"role": "judge"})
        t1 = make(cpu=0.1, memory_mb=32, task_id="t-1", labels={"role": "actor"})
        t2_judge = make(cpu=0.1, memory_mb=32, task_id="t-2", labels={"role": "judge"})
        plain = make(cpu=0.1, memory_mb=32)
        wait_for(lambda: len(everything.ids()) == 4)
        wait_for(lambda: "RUNNING" in everything.states(plain.id))
        wait_for(lambda: by_task.ids() == {t1_judge.id, t1.id})
        wait_for(lambda: by_label.ids() == {t1_judge.id, t2_judge.id})
        assert both.ids() == {t1_judge.id}
        t1.stop()
        wait_for(lambda: ended(by_task, t1.id))
        assert by_task.ids() == {t1_judge.id, t1.id}
        assert by_label.ids() == {t1_judge.id, t2_judge.id}


def test_keepalives_arrive_on_the_interval(wc: LocalCluster) -> None:
    _, token = project_with_token(wc, "w-keep")
    with watching(wc.apiserver, token, keepalive_interval_ms=200) as w:
        start = time.monotonic()
        wait_for(lambda: w.keepalives() >= 5, timeout_s=5)
        assert time.monotonic() - start < 3
        assert all(m.keepalive.at.seconds > 0 for m in w.messages if m.HasField("keepalive"))


def test_two_edges_reach_one_watcher(wc: LocalCluster, request: pytest.FixtureRequest) -> None:
    _, token = project_with_token(wc, "w-two")
    with (
        Client(wc.apiserver, token=token) as c,
        sandbox_factory(c, request.node.nodeid) as make,
        watching(wc.apiserver, token) as w,
    ):
        on_a = make(cpu=0.1, memory_mb=32, node_selector={"zone": "a"})
        on_b = make(cpu=0.1, memory_mb=32, node_selector={"zone": "b"})
        wait_for(lambda: "RUNNING" in w.states(on_a.id) and "RUNNING" in w.states(on_b.id))
        assert {sb.edge_id for sb in w.changes()} == {"wa", "wb"}


def add_edge(c: LocalCluster, spec: EdgeSpec) -> None:
    """Starts one more edge in a running (unix-socket) cluster; stopped with the cluster."""
    planned = LocalCluster(c.home, transport="unix", edges=[*c.edges, spec]).plan()
    proc = next(p for p in planned if p.name == f"edge-{spec.edge_id}")
    c.edges.append(spec)
    c.processes.append(proc)
    c._spawn(proc)
    c.wait_serving([proc], 60)


def test_an_edge_that_appears_later_and_an_edge_that_restarts(
    wc: LocalCluster, request: pytest.FixtureRequest
) -> None:
    _, token = project_with_token(wc, "w-late")
    with (
        Client(wc.apiserver, token=token) as c,
        sandbox_factory(c, request.node.nodeid) as make,
        watching(wc.apiserver, token) as w,
    ):
        add_edge(wc, EdgeSpec(edge_id="wlate", runtime="null", labels={"zone": "late"}))
        wait_for(
            lambda: any(
                e.info.edge_id == "wlate" and e.health == watcher_pb2.EDGE_HEALTH_HEALTHY
                for e in snapshot(wc).edges
            )
        )
        late = make(cpu=0.1, memory_mb=32, node_selector={"zone": "late"})
        wait_for(lambda: "RUNNING" in w.states(late.id))
        assert w.changes(late.id)[-1].edge_id == "wlate"
        # Killed and restarted: its stream breaks and is reopened (the null edge comes back
        # empty); what it does next is seen by the same watch.
        wc.kill("edge-wb")
        wc.restart("edge-wb")

        def create_on_b() -> Sandbox | None:
            try:  # until the watcher has it healthy and the API server's channel reconnected
                return make(cpu=0.1, memory_mb=32, node_selector={"zone": "b"})
            except (NoEligibleEdge, Unavailable):
                return None

        again = wait_for(create_on_b, timeout_s=30, interval_s=0.5)
        again.stop()
        wait_for(lambda: ended(w, again.id), timeout_s=20)
        # Every change if the stream was back in time, or (made during the gap) the
        # sandbox as it is now, from the replay of the reopened stream.
        states = w.states(again.id)
        assert states == LIFECYCLE[-len(states) :], states
        assert w.changes(again.id)[-1].termination.reason == types_pb2.TERMINATION_REASON_STOPPED
        assert w.error is None


def test_bad_input(wc: LocalCluster) -> None:
    _, token = project_with_token(wc, "w-bad")
    for bad in (1, 99, 600_001):
        w = Watch(wc.apiserver, token, keepalive_interval_ms=bad)
        try:
            wait_for(lambda: w.error, timeout_s=10)  # noqa: B023
            err = from_rpc_error(w.error)  # type: ignore[arg-type]
            assert isinstance(err, InvalidArgument) and err.reason == "INVALID_KEEPALIVE"
            assert "keepalive_interval_ms" in str(err)
        finally:
            w.close()
    for bad_token in ("", "dsec_abc_def"):
        w = Watch(wc.apiserver, bad_token)
        try:
            wait_for(lambda: w.error, timeout_s=10)  # noqa: B023
            assert isinstance(from_rpc_error(w.error), Unauthenticated)  # type: ignore[arg-type]
        finally:
            w.close()
