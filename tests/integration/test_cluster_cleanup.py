"""A cluster that stops after one of its edges died (a lost node in the multi-node tests, a
benchmark that never brings it back) still leaves no sandbox behind: the processes left in the
dead edge's cgroups are killed and the cgroups removed (``LocalCluster.release_cgroups``)."""

from __future__ import annotations

import os
import signal

import pytest

from edge.runtime import cgroups
from libdsec import Client
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith

pytestmark = [pytest.mark.integration, pytest.mark.images("busybox")]


def test_stopping_a_cluster_whose_edge_died_ends_its_sandboxes(cluster_with: ClusterWith) -> None:
    with cluster_with("orphans") as c:
        edge = c.process("edge-orphans")
        parent = edge.env["DSEC_EDGE_CGROUP_PARENT"]
        with Client(c.apiserver, token=c.token) as client:
            sbs = [client.create(image="busybox", memory_mb=64) for _ in range(2)]
            assert all(s.run("true").exit_code == 0 for s in sbs)
        os.kill(edge.pid, signal.SIGKILL)
        edge.proc.wait(timeout=10)  # type: ignore[union-attr]
        dirs = cgroups.existing_dirs(parent)
        pids = [
            pid
            for d in dirs
            for sub in d.rglob("cgroup.procs")
            for pid in cgroups.procs(sub.parent)
        ]
        assert len(cgroups.children(parent)) == 2 and pids  # the sandboxes outlived their edge
    assert cgroups.existing_dirs(parent) == []
    # SIGKILL is delivered asynchronously: gone within moments, not left running.
    wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids), timeout_s=10)
