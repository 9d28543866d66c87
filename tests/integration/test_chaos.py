"""Restarts lose nothing: a supervised cluster (as `dsec up` runs it) under concurrent
rollouts, with IAM, the API server, placement, the watcher and the edge killed with SIGKILL in
turn (supervisord starts each again), and aether killed inside one sandbox. Afterwards: every
sandbox not told to stop is running and answering, the one whose aether died ended with its
reason, every background command finished with its whole output, the project's quota usage is
exactly what runs, and no call hung past its deadline.

And a rolling upgrade of the edge: with live sandboxes and a background command, the edge is
stopped gracefully and started again with a changed configuration; it re-adopts every sandbox
and the command's output is complete.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsecctl.cluster import LocalCluster
from libdsec import Client, Quota
from libdsec.errors import DSecError
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith, container_edge
from tests.rollouts import BACKGROUND, COUNT, Rollouts

pytestmark = [pytest.mark.timeout(900), pytest.mark.images("busybox")]

EDGE = "chaos"
#: Killed in this order, each once, while the rollouts run.
VICTIMS = ["iam", "apiserver", "placement", "watcher", f"edge-{EDGE}"]


@pytest.fixture(scope="module")
def supervised(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """A cluster of the module's own, under supervisord (its services are killed)."""
    edge = container_edge(EDGE, {"DSEC_EDGE_PAUSE_SWAP_MB": "256"})
    with cluster_with("chaos", edges=[edge], compat=False, supervised=True, timeout_s=120) as c:
        yield c
    assert str(c.home) not in Path("/proc/self/mountinfo").read_text()


def _project(c: LocalCluster, name: str) -> tuple[str, str]:
    """A project of its own (its usage is the test's alone) and a token in it."""
    with Client(c.apiserver, token=c.token) as admin:
        project = admin.create_project(
            name, quota=Quota(cpu_millis=20_000, memory_mb=20_000, sandboxes=200)
        )
        token = admin.create_token(name, project=project.project_id).secret
    return project.project_id, token


def _answers(c: Client, sandbox_id: str) -> bool:
    try:
        sb = c.get(sandbox_id)
        return sb.info.state == "RUNNING" and sb.run("true").exit_code == 0
    except DSecError:
        return False


def _output(c: Client, sandbox_id: str, exec_id: str) -> list[str]:
    proc = c.get(sandbox_id).process(exec_id)
    return b"".join(getattr(e, "data", b"") for e in proc.attach()).decode().split()


def _aether_pid(c: LocalCluster, sandbox_id: str) -> int:
    """The sandbox's init, aether: first in its pids cgroup."""
    parent = c.process(f"edge-{EDGE}").env["DSEC_EDGE_CGROUP_PARENT"]
    procs = Path("/sys/fs/cgroup/pids") / parent / sandbox_id / "cgroup.procs"
    return int(procs.read_text().split()[0])


def _pid(c: LocalCluster, name: str) -> int:
    return c.supervised_processes()[name].pid


def _serving_again(c: LocalCluster, name: str, old_pid: int) -> bool:
    pid = _pid(c, name)
    return pid not in (0, old_pid) and c.status()[name] == "SERVING"


def test_every_service_killed_in_turn_under_rollouts_loses_nothing(
    supervised: LocalCluster,
) -> None:
    c = supervised
    project_id, token = _project(c, "chaos")
    rollouts = Rollouts(c.apiserver, token, workers=3, max_rounds=12)
    with Client(c.apiserver, token=token) as client:
        victim = client.create(image="busybox", cpu=0.1, memory_mb=32)
        try:
            rollouts.start()
            wait_for(lambda: len(rollouts.created) >= 3, timeout_s=90)
            for name in VICTIMS:
                old = _pid(c, name)
                os.kill(old, signal.SIGKILL)
                wait_for(lambda n=name, o=old: _serving_again(c, n, o), timeout_s=90)
                if name.startswith("edge-"):
                    c.wait_edges_registered(60)
                time.sleep(1.5)  # the rollouts go on through the restarted service
            os.kill(_aether_pid(c, victim.id), signal.SIGKILL)
            time.sleep(2)
            rollouts.stop()
            print(
                f"\n{len(rollouts.calls)} calls, {len(rollouts.created)} sandboxes, "
                f"{len(rollouts.failed())} failed calls:"
            )
            for call in rollouts.failed():
                print(f"  {call.what}: {call.error}")

            # supervisord restarted each service once
            restarts = c.supervisor.restarts()
            assert all(restarts[n]["restarts"] == 1 for n in VICTIMS), restarts
            # no call hung past its deadline
            assert not rollouts.hung(), rollouts.hung()
            # the rollouts did make progress through all of it
            assert len(rollouts.created) >= 6 and rollouts.backgrounds

            # the sandbox whose aether died ended, with its reason
            ended = wait_for(lambda: _terminated(client, victim.id), timeout_s=60)
            assert ended.termination_reason == "CHANNEL_CLOSED", ended
            assert ended.termination_message

            # every other sandbox not told to stop runs and answers
            keep = set(rollouts.created) - rollouts.stopped
            for sid in keep:
                wait_for(lambda s=sid: _answers(client, s), timeout_s=60)
            listed = {
                s.id: s.state for s in client.list(labels=rollouts.labels, states=["RUNNING"])
            }
            # a create that failed on the client's side did not leave a sandbox behind
            # that nobody knows of (the SDK's idempotency key made its retry the same create)
            assert set(listed) == keep, (set(listed) - keep, keep - set(listed))

            # every background command finished with its whole output
            for bg in rollouts.backgrounds:
                if bg.sandbox_id in rollouts.stopped:
                    continue
                info = client.get(bg.sandbox_id).process(bg.exec_id).wait(timeout_s=60)
                assert info.exit is not None and info.exit.exit_code == 0, info
                assert _output(client, bg.sandbox_id, bg.exec_id) == [
                    str(i) for i in range(1, COUNT + 1)
                ]

            # quota usage is exactly what runs: the live sandboxes, nothing leaked or doubled
            def usage_matches() -> bool:
                usage = client.get_project(project_id).usage
                return usage.sandboxes == len(keep) and usage.memory_mb == 32 * len(keep)

            wait_for(usage_matches, timeout_s=60)
        finally:
            rollouts.stop()
            with Client(c.apiserver, token=token) as cleanup:
                cleanup.stop_all(labels=rollouts.labels)
                cleanup.get(victim.id).stop()


def _terminated(client: Client, sandbox_id: str) -> object:
    info = client.get(sandbox_id).info
    return info if info.state == "TERMINATED" else None


def test_rolling_edge_upgrade_readopts_sandboxes_with_complete_output(
    supervised: LocalCluster,
) -> None:
    c = supervised
    _, token = _project(c, "upgrade")
    name = f"edge-{EDGE}"
    env_file = c.supervisor.dir / "env" / f"{name}.json"
    before = env_file.read_text()
    with Client(c.apiserver, token=token) as client:
        sandboxes = [client.create(image="busybox", cpu=0.1, memory_mb=32) for _ in range(3)]
        try:
            for i, sb in enumerate(sandboxes):
                sb.files.write("/work/mark", f"sandbox {i}")
            bg = sandboxes[0].start(BACKGROUND)
            # the new version: a changed configuration (a label the watcher will show)
            spec = json.loads(before)
            spec["env"]["DSEC_EDGE_LABELS"] = "release=next"
            env_file.write_text(json.dumps(spec))
            old = _pid(c, name)
            c.restart(name)  # graceful: SIGTERM, then the new one
            c.wait_edges_registered(60)
            assert _pid(c, name) != old
            assert _edge_labels(c).get("release") == "next"
            for i, sb in enumerate(sandboxes):
                wait_for(lambda s=sb.id: _answers(client, s), timeout_s=60)
                assert client.get(sb.id).files.read("/work/mark") == f"sandbox {i}".encode()
            info = sandboxes[0].process(bg.exec_id).wait(timeout_s=60)
            assert info.exit is not None and info.exit.exit_code == 0
            assert _output(client, sandboxes[0].id, bg.exec_id) == [
                str(i) for i in range(1, COUNT + 1)
            ]
            assert c.supervisor.restarts().get(name, {}).get("restarts", 0) in (0, 1)
        finally:
            env_file.write_text(before)
            for sb in sandboxes:
                sb.stop()


def _edge_labels(c: LocalCluster) -> dict[str, str]:
    import grpc

    from dsec.edge.v1 import edge_pb2, edge_pb2_grpc

    with grpc.insecure_channel(c.process(f"edge-{EDGE}").address) as ch:
        status = edge_pb2_grpc.EdgeServiceStub(ch).GetNodeStatus(
            edge_pb2.GetNodeStatusRequest(), timeout=10
        )
    return dict(status.info.labels)
