"""The backends under test, one entry each: what the conformance suite (test_conformance.py,
test_long_pause.py) needs to know of a backend that a caller of the SDK does not.

A new backend adds one `BackendUnderTest` to BACKENDS: its name and edge runtime, an image every
scenario can use, the capabilities it declares, and how the suite reaches behind the SDK to kill
its runtime or damage a paused sandbox's kept state (the functions below, or its own).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dsecctl.cluster import LocalCluster

#: (cluster, sandbox id) -> host pids, or an action on the sandbox from the host.
HostProbe = Callable[[LocalCluster, str], list[int]]
HostAction = Callable[[LocalCluster, str], None]


def _pids_cgroup(cluster: LocalCluster, sandbox_id: str) -> list[int]:
    parent = cluster.edges[0].extra_env["DSEC_EDGE_CGROUP_PARENT"]
    procs = Path("/sys/fs/cgroup/pids") / parent / sandbox_id / "cgroup.procs"
    return [int(p) for p in procs.read_text().split()]


def first_in_pids_cgroup(cluster: LocalCluster, sandbox_id: str) -> list[int]:
    """The runtime's process: first in the sandbox's pids cgroup (a container's init, a
    microVM's QEMU)."""
    return _pids_cgroup(cluster, sandbox_id)[:1]


def kill_frozen_processes(cluster: LocalCluster, sandbox_id: str) -> None:
    """Every process of a paused (frozen) container: they die when thawed."""
    for pid in _pids_cgroup(cluster, sandbox_id):
        os.kill(pid, signal.SIGKILL)


def _saved_state(cluster: LocalCluster, sandbox_id: str) -> Path:
    (state,) = (cluster.home / "edges").glob(f"**/paused/{sandbox_id}.vmstate")
    return state


def remove_saved_state(cluster: LocalCluster, sandbox_id: str) -> None:
    """A paused microVM's saved memory, gone."""
    _saved_state(cluster, sandbox_id).unlink()


def corrupt_saved_state(cluster: LocalCluster, sandbox_id: str) -> None:
    """A paused microVM's saved memory, 1 MiB of it overwritten a third of the way in."""
    state = _saved_state(cluster, sandbox_id)
    with state.open("r+b") as f:
        f.seek(state.stat().st_size // 3)
        f.write(os.urandom(1 << 20))


#: The full-VM images (scripts/build-vm-images.sh).
VM_IMAGES = Path("/var/lib/dsec/vm-images")


def _domain_qemu(cluster: LocalCluster, sandbox_id: str) -> list[int]:
    """A full VM's QEMU: libvirt names it `-name guest=dsec-<edge tag>-<sandbox id>,...`."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(a.startswith(b"guest=dsec-") and f"-{sandbox_id},".encode() in a for a in argv):
                found.append(int(d.name))
    return found


def _managed_save(cluster: LocalCluster, sandbox_id: str) -> Path:
    (save,) = Path("/var/lib/libvirt/qemu/save").glob(f"dsec-*-{sandbox_id}.save")
    return save


def remove_managed_save(cluster: LocalCluster, sandbox_id: str) -> None:
    """A paused full VM's managed save (libvirt's), gone."""
    _managed_save(cluster, sandbox_id).unlink()


def corrupt_managed_save(cluster: LocalCluster, sandbox_id: str) -> None:
    """A paused full VM's managed save, 1 MiB of its memory overwritten halfway in."""
    save = _managed_save(cluster, sandbox_id)
    with save.open("r+b") as f:
        f.seek(save.stat().st_size // 2)
        f.write(os.urandom(1 << 20))


def vm_root_mb() -> int:
    """The bookworm VM image's root filesystem size (MB), 0 when the image is not built."""
    try:
        return int(json.loads((VM_IMAGES / "bookworm" / "image.json").read_text())["root_mb"])
    except (OSError, ValueError, KeyError):
        return 0


@dataclass(frozen=True)
class BackendUnderTest:
    name: str  # the SDK's backend= value
    runtime: str  # DSEC_EDGE_RUNTIME of its edge
    image: str  # an image every scenario can use (a POSIX shell, coreutils)
    #: What the backend declares beyond the contract (edge.backends.contract.Capability values).
    capabilities: frozenset[str]
    #: Host pids of a sandbox's runtime: what dies when the runtime dies.
    init_pids: HostProbe
    #: Ways to damage what a pause kept so that the resume must fail (RESUME_FAILED), by name.
    pause_damages: dict[str, HostAction]
    extra_env: dict[str, str] = field(default_factory=dict)
    #: The smallest memory limit it takes (the memory-bomb scenario runs at it).
    min_memory_mb: int = 64
    #: How a sandbox ends when its runtime process is killed from the host.
    runtime_death: str = "CHANNEL_CLOSED"
    #: The disk-limit scenario: a small disk it takes, and how many MB to write to fill it.
    small_disk_mb: int = 32
    fill_mb: int = 100
    #: A command serving the directory {dir} over HTTP on {port}, in the foreground.
    http_server: str = "httpd -f -p {port} -h {dir}"
    #: What its fork copies ("memory" or "files"; with "fork" in capabilities).
    fork_kind: str = ""
    #: The task the preemption scenario pauses with pause_task (test_long_pause.py).
    task_size: int = 16


BACKENDS = [
    BackendUnderTest(
        name="container",
        runtime="container",
        image="busybox",
        capabilities=frozenset(
            {
                "exec",
                "pause",
                "pack_diff",
                "trusted_exec",
                "network_policy",
                "modified_files",
                "fork",
            }
        ),
        fork_kind="files",
        init_pids=first_in_pids_cgroup,
        pause_damages={"kill": kill_frozen_processes},
    ),
    # QEMU microvm guests on the same edge (guests boot under TCG here: the cluster is shared
    # by the module, and the guests are restored from one template per shape).
    BackendUnderTest(
        name="microvm",
        runtime="container",
        image="busybox",
        capabilities=frozenset({"exec", "pause", "pack_diff", "network_policy", "fork"}),
        init_pids=first_in_pids_cgroup,
        pause_damages={"remove": remove_saved_state, "corrupt": corrupt_saved_state},
        extra_env={"DSEC_EDGE_MICROVM": "on"},
        min_memory_mb=256,
        runtime_death="RUNTIME_ERROR",
        fork_kind="memory",
    ),
    # Full VMs on libvirt (a Debian system with systemd; TCG here: restored from a template
    # per shape). The smallest disk holds the image's root filesystem and 512 MB more.
    BackendUnderTest(
        name="vm",
        runtime="container",
        image="bookworm",
        capabilities=frozenset({"exec", "pause", "network_policy"}),
        init_pids=_domain_qemu,
        pause_damages={"remove": remove_managed_save, "corrupt": corrupt_managed_save},
        extra_env={"DSEC_EDGE_VM": "on", "DSEC_EDGE_VM_IMAGE_DIR": str(VM_IMAGES)},
        min_memory_mb=512,
        runtime_death="RUNTIME_ERROR",
        small_disk_mb=vm_root_mb() + 512,
        fill_mb=vm_root_mb() + 512,
        http_server="python3 -m http.server {port} --directory {dir}",
        # 16 Debian guests of 512 MB each restored at once under TCG on 2 cores took ~8 of
        # the preemption test's 13 minutes; the task operations are the edge's, shared by
        # every backend, and run at 16 on the container and microVM backends.
        task_size=4,
    ),
]
