"""Node disk safety against real runc: a sandbox that writes without stopping cannot take the
node down, and a node whose disk is full still stops, reaps and shuts down everything.

The edge's state and writable layers live on a small loop-mounted ext4 filesystem this test
makes (and removes):
nothing here writes unbounded to the machine's own disk. It is smaller than the default
writable-layer limit, as an overcommitted node's disk is smaller than the sum of its sandboxes'
limits.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsecctl.cluster import LocalCluster
from libdsec import Client, Sandbox
from libdsec.errors import DSecError, InvalidArgument, NodeDiskLow, SandboxNotFound
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith

pytestmark = pytest.mark.images("busybox")

FS_MB = 448  # the node's "disk"
RESERVE_MB = 64


def _fill(disk: Path) -> Path:
    """Fill the node's "disk" to the last block from the host (bounded by its size)."""
    filler = disk / "filler"
    with open(filler, "wb") as fh, contextlib.suppress(OSError):
        for _ in range(FS_MB):
            fh.write(b"\0" * (1 << 20))
    assert _free_mb(disk) == 0
    return filler


def _free_mb(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_bavail * st.f_frsize) >> 20


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A loop-mounted ext4 filesystem of FS_MB (its image file is bounded by that size)."""
    base = tmp_path_factory.mktemp("nodefs")
    image, mnt = base / "disk.img", base / "mnt"
    mnt.mkdir()
    with open(image, "wb") as fh:
        fh.truncate(FS_MB << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", image], check=True)
    subprocess.run(["mount", "-o", "loop", image, mnt], check=True)
    try:
        yield mnt
    finally:
        # The cluster's teardown has stopped every sandbox by now; unmount what is left.
        for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
            point = line.split()[4]
            if point.startswith(str(mnt) + "/"):
                subprocess.run(["umount", "-l", point], check=False)
        subprocess.run(["umount", "-l", mnt], check=False)
        image.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def container_cluster(small_disk: Path, cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """A cluster of the module's own: its edge's state on a small disk the tests fill."""
    env = {
        "DSEC_EDGE_STATE_DIR": str(small_disk / "edge"),
        "DSEC_EDGE_DEFAULT_DISK_MB": "1024",  # more than the whole "disk"
        "DSEC_EDGE_MAX_DISK_MB": "2048",
        "DSEC_EDGE_DISK_RESERVE_MB": str(RESERVE_MB),
        "DSEC_EDGE_REAP_INTERVAL_S": "0.5",
    }
    with cluster_with("dsk0", edge_env=env) as c:
        yield c


def test_every_sandbox_has_a_disk_limit_and_bad_limits_are_refused(
    client: Client, small_disk: Path
) -> None:
    with client.create(image="busybox", cpu=0.25, memory_mb=64) as sb:
        # The default limit (1024 MiB) is the size of its writable layer's filesystem.
        df = sb.run("df -k /root | tail -1").text.split()
        assert 900 * 1024 < int(df[1]) <= 1024 * 1024, df
    with pytest.raises(InvalidArgument) as info:
        client.create(image="busybox", cpu=0.25, memory_mb=64, disk_mb=4096)
    assert "resources.disk_mb=4096" in info.value.message and "2048" in info.value.message
    with pytest.raises(InvalidArgument, match=r"resources\.disk_mb=8:"):
        client.create(image="busybox", cpu=0.25, memory_mb=64, disk_mb=8)


def test_a_runaway_writer_is_ended_and_its_neighbour_keeps_working(
    client: Client, small_disk: Path
) -> None:
    with (
        client.create(image="busybox", cpu=0.25, memory_mb=128) as writer,
        client.create(image="busybox", cpu=0.25, memory_mb=64) as neighbour,
    ):
        # Its own limit (1024 MiB) is above what the node's disk has: only the reserve stops it.
        writer.start("dd if=/dev/zero of=/root/fill bs=1M")
        info = wait_for(lambda: (i := writer.refresh()).state == "TERMINATED" and i, timeout_s=60)
        assert info.termination_reason == "DISK_QUOTA", info.termination_message
        assert "free-space reserve" in info.termination_message
        assert neighbour.run("echo hi > /root/x && cat /root/x").text == "hi\n"
        assert neighbour.refresh().state == "RUNNING"
        # The writer's layer is gone with it: the node has its space back, and takes creates.
        assert wait_for(lambda: _free_mb(small_disk) > 2 * RESERVE_MB, timeout_s=10)
        wait_for(lambda: _try_create(client), timeout_s=5).stop()


def test_a_full_disk_refuses_creates_and_still_stops_reaps_and_deletes(
    client: Client, small_disk: Path
) -> None:

    stopped = client.create(image="busybox", cpu=0.25, memory_mb=64)
    deleted = client.create(image="busybox", cpu=0.25, memory_mb=64)
    idle = client.create(image="busybox", cpu=0.25, memory_mb=64, idle_timeout_s=4)
    stopped.start("sleep 600")
    filler = _fill(small_disk)
    try:
        # The reserve is checked every 0.25 s: the next creates are refused, typed.
        refusal = wait_for(lambda: _refusal(client), timeout_s=5)
        assert isinstance(refusal, NodeDiskLow), refusal
        assert refusal.metadata["edge"] == "dsk0"
        assert int(refusal.metadata["reserve_mb"]) == RESERVE_MB
        # Nothing of ours grew: no sandbox is ended for a fill that came from elsewhere.
        assert stopped.refresh().state == "RUNNING"
        # Teardown needs no disk: stop, delete and the idle reaper all work now.
        assert stopped.stop().termination_reason == "STOPPED"
        deleted.delete()
        with pytest.raises(SandboxNotFound):
            client.get(deleted.id)
        reaped = wait_for(lambda: (i := idle.refresh()).state == "TERMINATED" and i, timeout_s=20)
        assert reaped.termination_reason == "IDLE"
    finally:
        filler.unlink(missing_ok=True)
    # Space is back: the node takes creates again.
    with wait_for(lambda: _try_create(client), timeout_s=10) as again:
        assert again.run("echo back").text == "back\n"


def _refusal(client: Client) -> DSecError | None:
    try:
        client.create(image="busybox", cpu=0.25, memory_mb=64).stop()
    except DSecError as exc:
        return exc
    return None


def _try_create(client: Client) -> Sandbox | None:
    try:
        return client.create(image="busybox", cpu=0.25, memory_mb=64)
    except NodeDiskLow:
        return None


def test_the_edge_shuts_down_cleanly_on_a_full_disk(
    container_cluster: LocalCluster, client: Client, small_disk: Path
) -> None:
    """Last in this module: it stops the cluster. With the disk full, the edge's shutdown
    (on_shutdown=stop) still ends every sandbox and exits 0, leaving no process behind."""
    sandboxes = [client.create(image="busybox", cpu=0.25, memory_mb=64) for _ in range(2)]
    cgroup_parent = container_cluster.edges[0].extra_env["DSEC_EDGE_CGROUP_PARENT"]
    cgroups = [Path("/sys/fs/cgroup/pids") / cgroup_parent / sb.id for sb in sandboxes]
    assert all(cg.is_dir() for cg in cgroups)
    inits = [int((cg / "cgroup.procs").read_text().split()[0]) for cg in cgroups]
    filler = _fill(small_disk)
    try:
        edge = next(p for p in container_cluster.processes if p.name.startswith("edge"))
        assert edge.proc is not None
        container_cluster.stop(grace_s=30)
        assert edge.proc.returncode == 0, container_cluster.log_tail(edge)
    finally:
        filler.unlink(missing_ok=True)
    assert not any(Path(f"/proc/{pid}").exists() for pid in inits)
    assert not any(cg.exists() for cg in cgroups)
