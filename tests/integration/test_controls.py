"""Fail closed: the edge checks every host control it relies on at start, and either enforces
it or refuses to start naming what is missing — unless the operator turned it off explicitly,
which GetNodeStatus (and `dsec status`) then shows.

The missing control here is real, not simulated: the eBPF pin directory is put on a filesystem
that is not bpffs, so the network control cannot work on that edge.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from dsec.edge.v1 import edge_pb2, edge_pb2_grpc
from dsecctl.cluster import EdgeSpec
from edge import controls
from edge.runtime import mounts
from libdsec import Client, NetworkPolicy
from libdsec.errors import FailedPrecondition
from tests.helpers import dsec_status
from tests.integration.conftest import ClusterWith, container_edge

pytestmark = pytest.mark.images("busybox")


def _edge(tmp: Path, **env: str) -> EdgeSpec:
    # a directory on the test's tmp filesystem: not bpffs
    return container_edge("ctl0", {"DSEC_EDGE_BPF_PIN_DIR": str(tmp / "not-bpffs" / "dsec"), **env})


def test_this_host_enforces_every_required_control() -> None:
    found = {
        c.name: c
        for c in controls.check(disabled=(), bpf_pin_dir=Path("/sys/fs/bpf/dsec"), apparmor=False)
    }
    required = {
        "cgroup_cpu",
        "cgroup_memory",
        "cgroup_pids",
        "cgroup_freezer",
        "memory_swap",
        "landlock",
        "seccomp",
        "disk_limit",
        "erofs",
        "network",
    }
    assert {n for n, c in found.items() if c.state == controls.ENFORCED} == required
    # The host they rest on, as `dsec status` shows it: this machine kind's hybrid layout.
    host = found["host"]
    assert host.state == controls.INFO and host.status_line
    assert "cgroups hybrid: v1 cpu, memory, pids, freezer; cgroup2 at" in host.detail
    assert f"kernel {os.uname().release}" in host.detail
    assert found["landlock"].detail.startswith("ABI ")
    assert found["apparmor"].state == controls.ABSENT
    # Optional too, and not built into this kernel: reported with the reason, the edge runs.
    assert found["core_scheduling"].state == controls.ABSENT
    assert "CONFIG_SCHED_CORE" in found["core_scheduling"].detail


def test_only_controls_with_a_defined_effect_can_be_turned_off() -> None:
    with pytest.raises(
        controls.ControlMissing, match="seccomp: only landlock, memory_swap, network"
    ):
        controls.check(disabled=("seccomp",), bpf_pin_dir=Path("/sys/fs/bpf/dsec"), apparmor=False)


def test_an_edge_missing_a_control_refuses_to_start_naming_it(
    tmp_path: Path, cluster_with: ClusterWith
) -> None:
    with pytest.raises(RuntimeError) as info, cluster_with("ctl0", edges=[_edge(tmp_path)]):
        pass
    text = str(info.value)
    assert "edge-ctl0 exited with 2" in text
    assert "refuses to run half-confined" in text and "network (needs bpffs at" in text
    assert "DSEC_EDGE_DISABLED_CONTROLS=network" in text


def test_a_control_turned_off_is_shown_and_its_feature_refused(
    tmp_path: Path, cluster_with: ClusterWith
) -> None:
    spec = _edge(tmp_path, DSEC_EDGE_DISABLED_CONTROLS="network")
    with cluster_with("ctl0", edges=[spec]) as c:
        edge = next(p for p in c.processes if p.name.startswith("edge"))
        with grpc.insecure_channel(edge.address) as ch:
            status = edge_pb2_grpc.EdgeServiceStub(ch).GetNodeStatus(
                edge_pb2.GetNodeStatusRequest(), timeout=10
            )
        states = {h.name: h.state for h in status.controls}
        assert states["network"] == "disabled" and states["landlock"] == "enforced"
        assert states["cgroup_memory"] == "enforced" and states["apparmor"] == "absent"
        with Client(c.apiserver, token=c.token) as client:
            with client.create(image="busybox", cpu=0.25, memory_mb=64) as sb:
                assert sb.run("echo ok").text == "ok\n"
            with pytest.raises(FailedPrecondition) as refused:
                client.create(
                    image="busybox",
                    cpu=0.25,
                    memory_mb=64,
                    network=NetworkPolicy(allow=["10.1.2.3:80"]),
                )
            assert refused.value.reason == "NETWORK_UNAVAILABLE"
        status = dsec_status(c.home)
        assert "controls disabled: network" in status, status
        enforced = next(line for line in status.splitlines() if "controls enforced:" in line)
        assert "landlock" in enforced and "cgroup_pids" in enforced and "disk_limit" in enforced
        assert "controls absent: apparmor, core_scheduling" in status
        assert "core_scheduling: this kernel has no core scheduling" in status
        assert "host: kernel " in status and "cgroups hybrid" in status
        assert "controls info" not in status


def test_an_edge_on_loop_devices_runs_sandboxes_from_layers_mounted_on_them(
    cluster_with: ClusterWith,
) -> None:
    """DSEC_EDGE_EROFS_MOUNT=loop: how a kernel older than 6.12 (no file-backed EROFS) gets
    its layers and the toolkit, on read-only loop devices; shown in the erofs control. Every
    device is freed once the edge and its sandboxes are gone."""
    edge = container_edge("ctl1", {"DSEC_EDGE_EROFS_MOUNT": "loop"})
    with cluster_with("ctl1", edges=[edge]) as c:
        home = str(c.home)
        proc = next(p for p in c.processes if p.name.startswith("edge"))
        with grpc.insecure_channel(proc.address) as ch:
            status = edge_pb2_grpc.EdgeServiceStub(ch).GetNodeStatus(
                edge_pb2.GetNodeStatusRequest(), timeout=10
            )
        erofs = next(h for h in status.controls if h.name == "erofs")
        assert erofs.state == "enforced" and "read-only loop devices" in erofs.detail, erofs
        with Client(c.apiserver, token=c.token) as client:
            with client.create(image="busybox", cpu=0.25, memory_mb=64) as sb:
                assert sb.run("cat /etc/hostname && ls /bin/sh").exit_code == 0
                used = [
                    m
                    for m in mounts.read_mountinfo()
                    if m.fstype == "erofs" and m.mountpoint.startswith(home)
                ]
                assert len(used) >= 2  # the toolkit and the image's layer(s)
                assert all(m.source.startswith("/dev/loop") for m in used), used
                bound = {m.source: mounts.erofs_backing(m.source) for m in used}
                assert all(bound.values()), bound
    assert not [m for m in mounts.read_mountinfo() if m.mountpoint.startswith(home)]
    # autoclear: every device was freed (another process may have taken its number since)
    assert not [d for d, f in bound.items() if mounts.erofs_backing(d) == f]
