"""examples/rl_rollout.py at small scale, as a user runs it: two driver processes against a
real container cluster (two edges, busybox), the first preempted after a few turns.

Between the runs every sandbox of the task is PAUSED (none lost); the second run reattaches by
task id, resumes them, finishes every episode with every turn accounted for, and stops them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsecctl.cluster import LocalCluster
from libdsec import Client
from tests.integration.conftest import ClusterWith, container_edge

ROOT = Path(__file__).resolve().parents[2]
EPISODES, TURNS, PREEMPT_AFTER = 4, 6, 3
pytestmark = pytest.mark.images("busybox")


@pytest.fixture(scope="module")
def rc(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """A cluster of the module's own: two edges (a preempted episode resumes on either)."""
    with cluster_with("rollout", edges=[container_edge("ra"), container_edge("rb")]) as c:
        yield c


def driver(rc: LocalCluster, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DSEC_TARGET=rc.apiserver, DSEC_TOKEN=rc.token, DSEC_HOME=str(home))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rl_rollout.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_rollout_driver_survives_a_preemption(rc: LocalCluster, tmp_path: Path) -> None:
    task = "rl-rollout-test"
    common = ["--task", task, "--episodes", str(EPISODES), "--turns", str(TURNS)]
    with Client(rc.apiserver, token=rc.token) as c:
        try:
            first = driver(
                rc, tmp_path, *common, "--preempt-after", str(PREEMPT_AFTER),
                "--report", str(tmp_path / "first.json"),
            )  # fmt: skip
            assert first.returncode == 0, first.stdout + first.stderr
            before = json.loads((tmp_path / "first.json").read_text())
            assert before["phase"] == "preempted", first.stdout
            progress = {int(i): e["turns"] for i, e in before["episodes"].items()}
            assert set(progress) == set(range(EPISODES))
            # The first episode at K turns preempted the job; the others ended their turn.
            assert max(progress.values()) == PREEMPT_AFTER, progress
            assert all(1 <= n <= PREEMPT_AFTER for n in progress.values()), progress

            # Between the runs: the driver is gone, every sandbox of the task PAUSED.
            sandboxes = {e["sandbox"] for e in before["episodes"].values()}
            assert sorted(sandboxes) == before["paused"]
            listed = c.list(task_id=task)
            assert {s.id: s.state for s in listed} == dict.fromkeys(sandboxes, "PAUSED")
            assert len({s.edge_id for s in listed}) == 2, listed  # the job spans both edges

            second = driver(
                rc, tmp_path, *common, "--resume", "--report", str(tmp_path / "second.json")
            )
            assert second.returncode == 0, second.stdout + second.stderr
            after = json.loads((tmp_path / "second.json").read_text())
            assert after["phase"] == "finished" and after["problems"] == [], second.stdout
            for i, e in after["episodes"].items():
                assert e["sandbox"] == before["episodes"][i]["sandbox"]  # reattached, not new
                assert e["resumed_at"] == progress[int(i)]  # picked up where it was
                assert e["turns"] == TURNS
            assert "every turn accounted for" in second.stdout
            assert f"resume_task resumed {EPISODES} sandboxes in one call" in second.stdout

            ended = {s.id: (s.state, s.termination_reason) for s in c.list(task_id=task)}
            assert ended == dict.fromkeys(sandboxes, ("TERMINATED", "STOPPED"))
        finally:
            c.stop_task(task, grace_s=0.5)
