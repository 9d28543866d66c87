"""Task-level operations (PauseTask, ResumeTask, StopTask) through real service processes.

Fan-out and results on three null-runtime edges: every sandbox of a task on every edge in one
call, one result per sandbox (the null runtime cannot pause: each live sandbox's pause is its
own BACKEND_CAPABILITY error, an ended one's SANDBOX_TERMINATED), PREEMPTED seen by get() and
watch, label selectors, projects, an edge that does not answer, the `dsec task` CLI. End to
end on two container edges (busybox): a paused task resumes and its sandboxes answer commands
with their files intact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client, Sandbox, TaskResult, TaskSandboxResult
from libdsec.errors import (
    BackendCapabilityMissing,
    InvalidArgument,
    SandboxTerminated,
    Unauthenticated,
)
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith, container_edge
from tests.integration.test_control_plane import project_with_token

ROOT = Path(__file__).resolve().parents[2]
NODES = ("ta", "tb", "tc")
SPEC = {"image": "busybox", "cpu": 0.1, "memory_mb": 32}


@pytest.fixture(scope="module")
def tc(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """Three null edges, each labelled node=<its id> (sandboxes go where a test puts them)."""
    with cluster_with(
        "tasks",
        edges=[EdgeSpec(edge_id=e, runtime="null", labels={"node": e}) for e in NODES],
    ) as c:
        yield c


def spread(c: Client, task_id: str, per_edge: int = 2, **labels: str) -> list[Sandbox]:
    """``per_edge`` sandboxes of the task on each edge, labelled episode=0, 1, ..."""
    made = []
    for node in NODES:
        for _ in range(per_edge):
            episode = {"episode": str(len(made)), **labels}
            made.append(
                c.create(task_id=task_id, labels=episode, node_selector={"node": node}, **SPEC)
            )
    return made


def by_id(r: TaskResult) -> dict[str, TaskSandboxResult]:
    return {x.sandbox_id: x for x in r.results}


# ------------------------------------------------------------------ fan-out


def test_stop_task_preempted_ends_every_sandbox_on_every_edge_as_preempted(
    tc: LocalCluster,
) -> None:
    _, token = project_with_token(tc, "t-preempt")
    with Client(tc.apiserver, token=token) as c:
        task = spread(c, "job-p")
        bystander = c.create(task_id="job-other", **SPEC)
        with c.watch(task_id="job-p", timeout=30) as changes:
            r = c.stop_task("job-p", preempted=True, grace_s=0.5)
            assert r.ok and not r.edge_errors
            assert {x.sandbox_id for x in r} == {s.id for s in task}
            assert {x.edge_id for x in r} == set(NODES)  # one call per edge, all answered
            for x in r:
                assert x.info is not None and x.error is None
                assert (x.info.state, x.info.termination_reason) == ("TERMINATED", "PREEMPTED")
                assert x.info.termination_message == "preempted: its job was preempted"
            ended = {}
            for info in changes:  # the watch reports each end with the reason
                if info.terminated:
                    ended[info.id] = info.termination_reason
                if len(ended) == len(task):
                    break
        assert ended == {s.id: "PREEMPTED" for s in task}
        for s in task:
            info = c.get(s.id).info
            assert (info.state, info.termination_reason) == ("TERMINATED", "PREEMPTED")
        assert c.get(bystander.id).info.state == "RUNNING"  # another task: untouched
        again = c.stop_task("job-p")  # ended already: answered as they ended
        assert [x.info.termination_reason for x in again if x.info] == ["PREEMPTED"] * 6
        done = c.stop_task("job-other", message="trajectory done")
        assert done.sandboxes[0].termination_reason == "STOPPED"
        assert done.sandboxes[0].termination_message == "trajectory done"


def test_pause_and_resume_report_each_sandbox_running_or_ended(tc: LocalCluster) -> None:
    _, token = project_with_token(tc, "t-mixed")
    with Client(tc.apiserver, token=token) as c:
        task = spread(c, "job-m")
        ended = {task[0].id, task[3].id}  # one on ta, one on tb
        for s in task:
            if s.id in ended:
                s.stop()
        for op in (c.pause_task, c.resume_task):
            r = op("job-m")
            assert not r.ok and not r.edge_errors and len(r) == len(task)
            results = by_id(r)
            for s in task:
                x = results[s.id]
                assert x.info is None
                err = x.error
                if s.id in ended:  # FAILED_PRECONDITION naming the state
                    assert isinstance(err, SandboxTerminated)
                    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
                    assert err.metadata["state"] == "TERMINATED"
                    assert err.metadata["termination_reason"] == "STOPPED"
                else:  # the null runtime cannot pause: each one says so, none fails the call
                    assert isinstance(err, BackendCapabilityMissing)
                    assert err.metadata["state"] == "RUNNING"
        r = c.stop_task("job-m")
        assert r.ok and len(r) == len(task)
        reasons = {x.sandbox_id: x.info.termination_reason for x in r if x.info}
        assert reasons == {s.id: "STOPPED" for s in task}


def test_a_task_without_sandboxes_is_an_empty_result_and_no_selector_is_refused(
    tc: LocalCluster,
) -> None:
    _, token = project_with_token(tc, "t-empty")
    with Client(tc.apiserver, token=token) as c:
        for op in (c.pause_task, c.resume_task, c.stop_task):
            r = op("no-such-task")
            assert r.ok and len(r) == 0 and r.edge_errors == []
            with pytest.raises(InvalidArgument, match="refusing to act on every sandbox"):
                op("")
        with pytest.raises(InvalidArgument, match="grace_s"):
            c.stop_task("no-such-task", grace_s=-1)
        assert c.stop_all(task_id="no-such-task") == []


def test_the_label_selector_narrows_the_task(tc: LocalCluster) -> None:
    _, token = project_with_token(tc, "t-labels")
    with Client(tc.apiserver, token=token) as c:
        task = spread(c, "job-l", stage="rollout")
        r = c.stop_task("job-l", labels={"episode": "4"})
        assert [x.sandbox_id for x in r] == [task[4].id]
        r = c.stop_task("", labels={"stage": "rollout", "episode": "2"})  # labels alone
        assert [x.sandbox_id for x in r] == [task[2].id]
        assert c.stop_task("job-l", labels={"stage": "eval"}).results == []
        live = {s.id for s in c.list(task_id="job-l") if not s.terminated}
        assert live == {s.id for s in task} - {task[2].id, task[4].id}
        assert set(c.stop_all(task_id="job-l")) == live  # StopSandboxes: the live ones


def test_other_projects_see_nothing_and_a_parent_acts_on_its_subprojects(
    tc: LocalCluster,
) -> None:
    parent, parent_token = project_with_token(tc, "t-parent")
    _, child_token = project_with_token(tc, "t-child", parent=parent)
    _, other_token = project_with_token(tc, "t-other")
    with (
        Client(tc.apiserver, token=child_token) as child,
        Client(tc.apiserver, token=other_token) as other,
        Client(tc.apiserver, token=parent_token) as par,
        Client(tc.apiserver, token="not-a-token") as nobody,
    ):
        mine = spread(child, "job-shared", per_edge=1)
        theirs = other.create(task_id="job-shared", **SPEC)
        with pytest.raises(Unauthenticated):
            nobody.stop_task("job-shared")
        # Another project's caller acts on its own sandbox of the same task id only.
        r = other.stop_task("job-shared")
        assert [x.sandbox_id for x in r] == [theirs.id]
        assert all(child.get(s.id).info.state == "RUNNING" for s in mine)
        assert child.pause_task("job-shared").edge_errors == []
        # The parent project's token reaches its subproject's sandboxes.
        r = par.stop_task("job-shared", preempted=True)
        assert {x.sandbox_id for x in r} == {s.id for s in mine}
        assert all(x.info and x.info.termination_reason == "PREEMPTED" for x in r)
        assert other.get(theirs.id).info.termination_reason == "STOPPED"


def test_an_edge_that_does_not_answer_is_one_error_entry(tc: LocalCluster) -> None:
    _, token = project_with_token(tc, "t-edge-down")
    with Client(tc.apiserver, token=token) as c:
        task = spread(c, "job-d", per_edge=1)
        tc.kill("edge-tc")
        try:
            r = c.stop_task("job-d", grace_s=0)
            assert [e.edge_id for e in r.edge_errors] == ["tc"]
            assert r.edge_errors[0].error.code == grpc.StatusCode.UNAVAILABLE
            assert not r.ok and r.failed == []  # the other edges' results stand
            assert {x.sandbox_id for x in r} == {s.id for s in task if s.info.edge_id != "tc"}
        finally:
            tc.restart("edge-tc")  # a null edge comes back empty
        wait_for(lambda: c.stop_task("job-d").edge_errors == [], 30)


# ---------------------------------------------------------------------- CLI


def dsec(tc: LocalCluster, token: str, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`dsec ARGS` against the cluster with ``token`` ($DSEC_HOME empty: nothing else)."""
    env = dict(os.environ, DSEC_TARGET=tc.apiserver, DSEC_TOKEN=token, DSEC_HOME=str(home))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "dsecctl", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dsec_task_prints_a_line_per_sandbox_and_fails_if_one_failed(
    tc: LocalCluster, tmp_path: Path
) -> None:
    _, token = project_with_token(tc, "t-cli")
    with Client(tc.apiserver, token=token) as c:
        task = spread(c, "job-cli", per_edge=1)
        task[0].stop()
        # pause on the null runtime: every sandbox fails, each with its reason; exit 1
        r = dsec(tc, token, tmp_path, "task", "pause", "job-cli")
        assert r.returncode == 1, r.stdout + r.stderr
        lines = dict(line.split("  ", 1) for line in r.stdout.splitlines())
        assert set(lines) == {s.id for s in task}
        assert lines[task[0].id].startswith("error SANDBOX_TERMINATED: ")
        assert lines[task[1].id].startswith("error BACKEND_CAPABILITY: ")
        assert "paused 0 of 3 sandboxes of task job-cli; 3 failed" in r.stderr
        # stop --preempted: every sandbox answers; exit 0
        r = dsec(
            tc,
            token,
            tmp_path,
            "task",
            "stop",
            "job-cli",
            "--preempted",
            "--grace-s",
            "0",
            "--json",
        )
        assert r.returncode == 0, r.stdout + r.stderr
        rows = [json.loads(line) for line in r.stdout.splitlines()]
        assert {row["id"] for row in rows} == {s.id for s in task}
        by = {row["id"]: row for row in rows}
        assert by[task[0].id]["reason"] == "STOPPED"  # it had ended before
        for s in task[1:]:
            row = by[s.id]
            assert (row["state"], row["reason"], row["error"]) == ("TERMINATED", "PREEMPTED", None)
        r = dsec(tc, token, tmp_path, "task", "resume", "job-cli", "--json")
        assert r.returncode == 1
        errors = [json.loads(line)["error"] for line in r.stdout.splitlines()]
        assert {(e["code"], e["reason"], e["metadata"]["state"]) for e in errors} == {
            ("FAILED_PRECONDITION", "SANDBOX_TERMINATED", "TERMINATED")
        }
    r = dsec(tc, token, tmp_path, "task", "stop", "no-such-task")
    assert (r.returncode, r.stdout) == (0, ""), r.stderr
    assert "stopped 0 of 0 sandboxes" in r.stderr
    r = dsec(tc, token, tmp_path, "task", "stop", "")
    assert r.returncode == 2 and "InvalidArgument" in r.stderr, r.stderr


# ------------------------------------------------------ containers, end to end


@pytest.fixture(scope="module")
def cc(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """Two container edges (ca, cb), labelled node=<id>."""
    edges = [container_edge(e, labels={"node": e}) for e in ("ca", "cb")]
    with cluster_with("ctasks", edges=edges) as c:
        yield c


def test_a_paused_task_resumes_and_its_sandboxes_answer_with_their_files(
    cc: LocalCluster,
) -> None:
    with Client(cc.apiserver, token=cc.token) as c:
        made: list[Sandbox] = []
        try:
            for i in range(4):
                node = ("ca", "cb")[i % 2]
                made.append(
                    c.create(
                        task_id="job-e2e",
                        labels={"episode": str(i)},
                        node_selector={"node": node},
                        image="busybox",
                        cpu=0.25,
                        memory_mb=64,
                    )
                )
            for i, sb in enumerate(made):
                assert sb.run(f"echo turn-{i} > /tmp/state").exit_code == 0
            made[3].stop(grace_s=0.5)  # one of the task's sandboxes ended already

            r = c.pause_task("job-e2e")
            assert {x.edge_id for x in r} == {"ca", "cb"} and not r.edge_errors
            states = {x.sandbox_id: x.state for x in r}
            assert states == {s.id: "PAUSED" for s in made[:3]} | {made[3].id: None}
            [failed] = r.failed
            assert isinstance(failed.error, SandboxTerminated)
            assert failed.error.metadata["state"] == "TERMINATED"
            listed = {s.id: s.state for s in c.list(task_id="job-e2e")}
            assert listed == {s.id: "PAUSED" for s in made[:3]} | {made[3].id: "TERMINATED"}
            again = c.pause_task("job-e2e")  # pausing again: they stay PAUSED
            assert {x.sandbox_id: x.state for x in again} == states

            r = c.resume_task("job-e2e")
            assert {x.sandbox_id: x.state for x in r if x.ok} == {s.id: "RUNNING" for s in made[:3]}
            for i, sb in enumerate(made[:3]):
                out = sb.run("cat /tmp/state; echo more >> /tmp/state; wc -l < /tmp/state")
                assert out.exit_code == 0 and out.text.split() == [f"turn-{i}", "2"]

            r = c.stop_task("job-e2e", preempted=True, grace_s=0.5)
            assert r.ok
            reasons = {x.sandbox_id: x.info.termination_reason for x in r if x.info}
            assert reasons == {s.id: "PREEMPTED" for s in made[:3]} | {made[3].id: "STOPPED"}
        finally:
            c.stop_task("job-e2e", grace_s=0.5)
