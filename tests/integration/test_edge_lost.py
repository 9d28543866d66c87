"""TERMINATION_REASON_EDGE_LOST through real service processes: null edges the test kills
(SIGKILL) or freezes (SIGSTOP) by PID, with the watcher's gone rule shortened by env config.

Once the watcher declares an edge lost, the sandboxes it last reported are TERMINATED with
reason EDGE_LOST in GetSandbox, ListSandboxes and WatchSandboxes, for their project only; a
lost edge that comes back has what it still runs stopped with that reason.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import grpc
import pytest

from dsec.types.v1 import types_pb2
from dsec.watcher.v1 import watcher_pb2, watcher_pb2_grpc
from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client
from libdsec.errors import SandboxNotFound, SandboxTerminated, Unavailable
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith
from tests.integration.test_control_plane import project_with_token, usage
from tests.integration.test_watch import watching

GONE_FAST = {
    "DSEC_WATCHER_PROBE_TIMEOUT_S": "0.5",
    "DSEC_WATCHER_RECONCILE_INTERVAL_S": "1",
    "DSEC_WATCHER_RECONCILE_GRACE_S": "1",
    "DSEC_WATCHER_RELEASE_GONE_AFTER_S": "3",
    "DSEC_WATCHER_SANDBOX_POLL_INTERVAL_S": "0.3",
}
SPEC = {"cpu": 0.1, "memory_mb": 32, "task_id": "lost-task"}


@pytest.fixture(scope="module")
def lc(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """Three null edges: lx (to be killed), lz (to be frozen) and ly (stays)."""
    edges = [EdgeSpec(edge_id=e, runtime="null", labels={"node": e}) for e in ("lx", "ly", "lz")]
    with cluster_with("lost", edges=edges, extra_env=GONE_FAST) as c:
        try:
            yield c
        finally:
            for p in c.processes:  # a frozen edge cannot take its SIGTERM
                if p.pid and p.proc is not None and p.proc.poll() is None:
                    os.kill(p.pid, signal.SIGCONT)


def reported(c: LocalCluster, edge_id: str) -> int:
    """How many live sandboxes the watcher's last poll of the edge returned."""
    with grpc.insecure_channel(c.process("watcher").address) as ch:
        return int(
            watcher_pb2_grpc.WatcherServiceStub(ch)
            .GetEdgeHealth(watcher_pb2.GetEdgeHealthRequest(edge_id=edge_id), timeout=5)
            .status.sandboxes_reported
        )


def lost_reason(c: Client, sandbox_id: str) -> str | None:
    try:
        info = c.get(sandbox_id).info
    except Unavailable:  # the edge is unreachable and not declared lost yet
        return None
    return info.termination_reason if info.state == "TERMINATED" else None


def test_a_killed_edge_s_sandboxes_end_with_edge_lost_in_every_view(lc: LocalCluster) -> None:
    project, token = project_with_token(lc, "lost-kill")
    _, other_token = project_with_token(lc, "lost-other")
    with (
        Client(lc.apiserver, token=token) as c,
        Client(lc.apiserver, token=other_token) as other,
        watching(lc.apiserver, token, task_id="lost-task") as w,
        watching(lc.apiserver, other_token) as w_other,
    ):
        doomed = [c.create(node_selector={"node": "lx"}, **SPEC) for _ in range(3)]
        kept = c.create(node_selector={"node": "ly"}, **SPEC)
        try:
            wait_for(lambda: reported(lc, "lx") == 3)
            assert usage(lc, project) == 4
            lc.kill("edge-lx")  # SIGKILL, by the PID the cluster started

            # GetSandbox: TERMINATED (EDGE_LOST), no longer UNAVAILABLE.
            wait_for(lambda: all(lost_reason(c, s.id) == "EDGE_LOST" for s in doomed), 30)
            info = c.get(doomed[0].id).info
            assert info.edge_id == "lx" and info.task_id == "lost-task"
            assert "lx" in info.termination_message
            assert c.get(kept.id).info.state == "RUNNING"
            # A call into one ends as for a sandbox that ended on a live edge; a stop answers
            # it ended.
            with pytest.raises(SandboxTerminated) as ended_info:
                doomed[0].run("true")
            assert ended_info.value.metadata["termination_reason"] == "EDGE_LOST"
            with pytest.raises(SandboxTerminated):
                doomed[0].files.read("/etc/hostname")
            stopped = doomed[1].stop()
            assert (stopped.state, stopped.termination_reason) == ("TERMINATED", "EDGE_LOST")
            # ListSandboxes: included so, filtered as the rest.
            listed = {s.id: s for s in c.list(task_id="lost-task")}
            assert set(listed) == {s.id for s in doomed} | {kept.id}
            assert all(
                listed[s.id].state == "TERMINATED"
                and listed[s.id].termination_reason == "EDGE_LOST"
                for s in doomed
            )
            assert {s.id for s in c.list(states=["RUNNING"])} == {kept.id}
            assert c.list(task_id="another-task") == []
            # A task operation answers them from the watcher, ended as for a live edge.
            paused = {r.sandbox_id: r for r in c.pause_task("lost-task")}
            assert set(paused) == {s.id for s in doomed} | {kept.id}
            for s in doomed:
                err = paused[s.id].error
                assert isinstance(err, SandboxTerminated)
                assert err.metadata["termination_reason"] == "EDGE_LOST"
            assert paused[kept.id].error.reason == "BACKEND_CAPABILITY"  # type: ignore[union-attr]
            assert other.pause_task("lost-task").results == []
            # WatchSandboxes: one terminated event with EDGE_LOST for each.
            wait_for(lambda: all("TERMINATED" in w.states(s.id) for s in doomed), 15)
            for s in doomed:
                last = w.changes(s.id)[-1]
                assert last.termination.reason == types_pb2.TERMINATION_REASON_EDGE_LOST
                ended = [
                    sb for sb in w.changes(s.id) if sb.state == types_pb2.SANDBOX_STATE_TERMINATED
                ]
                assert len(ended) == 1
            # Another project sees none of it.
            for s in doomed:
                with pytest.raises(SandboxNotFound):
                    other.get(s.id)
            assert other.list(include_subprojects=True) == []
            assert w_other.ids() == set()
            # IAM released their quota (the same gone rule).
            wait_for(lambda: usage(lc, project) == 1, 15)

            # The killed (null) edge restarts empty: the lost sandboxes stay lost.
            lc.restart("edge-lx")
            wait_for(lambda: reported(lc, "lx") == 0 and lc_healthy(lc, "lx"), 15)
            assert all(lost_reason(c, s.id) == "EDGE_LOST" for s in doomed)
            stopped_task = {r.sandbox_id: r.info for r in c.stop_task("lost-task")}
            assert {sid: i.termination_reason for sid, i in stopped_task.items() if i} == {
                **{s.id: "EDGE_LOST" for s in doomed},
                kept.id: "STOPPED",
            }
        finally:
            kept.stop()


def lc_healthy(c: LocalCluster, edge_id: str) -> bool:
    with grpc.insecure_channel(c.process("watcher").address) as ch:
        st = (
            watcher_pb2_grpc.WatcherServiceStub(ch)
            .GetEdgeHealth(watcher_pb2.GetEdgeHealthRequest(edge_id=edge_id), timeout=5)
            .status
        )
    return st.health == watcher_pb2.EDGE_HEALTH_HEALTHY


def test_a_lost_edge_that_comes_back_has_its_survivors_stopped_as_edge_lost(
    lc: LocalCluster,
) -> None:
    project, token = project_with_token(lc, "lost-frozen")
    with (
        Client(lc.apiserver, token=token) as c,
        watching(lc.apiserver, token) as w,
    ):
        frozen = [c.create(node_selector={"node": "lz"}, **SPEC) for _ in range(2)]
        wait_for(lambda: reported(lc, "lz") == 2)
        edge = lc.process("edge-lz")
        os.kill(edge.pid, signal.SIGSTOP)  # a partition, as the watcher sees it
        try:
            wait_for(lambda: all("TERMINATED" in w.states(s.id) for s in frozen), 30)
            assert all(
                w.changes(s.id)[-1].termination.reason == types_pb2.TERMINATION_REASON_EDGE_LOST
                for s in frozen
            )
            wait_for(lambda: usage(lc, project) == 0, 15)  # released as gone
        finally:
            os.kill(edge.pid, signal.SIGCONT)
        # Back, still holding them: the watcher stops them with the reason callers were told,
        # and the edge itself now answers so.
        wait_for(
            lambda: all(
                (i := c.get(s.id).info).state == "TERMINATED"
                and i.termination_reason == "EDGE_LOST"
                and reported(lc, "lz") == 0
                for s in frozen
            ),
            30,
        )
        assert usage(lc, project) == 0
        # Reported once by the watch, not again when the edge stopped them.
        for s in frozen:
            assert (
                sum(sb.state == types_pb2.SANDBOX_STATE_TERMINATED for sb in w.changes(s.id)) == 1
            )
        again = c.create(node_selector={"node": "lz"}, **SPEC)  # the edge serves again
        assert again.info.state == "RUNNING"
        again.stop()
