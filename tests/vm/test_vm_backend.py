"""The vm backend on real libvirt/QEMU guests: a complete Debian system with systemd, the SDK's
whole surface through aether over virtio-serial, limits, pause by managed save, the reasons a
VM ends, and an edge restart with VMs running. Every create restores the node's template of
its image and shape (tests/vm/conftest.py: one shape per image)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dsecctl.cluster import LocalCluster
from libdsec import Client, Sandbox
from libdsec.errors import InvalidArgument
from libdsec.types import Exited, Output, Started
from tests.helpers import sandbox_factory, wait_for
from tests.vm.conftest import VM_SHAPE, one_vm


@pytest.fixture
def make_vm(client: Client, request: pytest.FixtureRequest) -> Iterator[Callable[..., Sandbox]]:
    with sandbox_factory(client, request.node.nodeid, grace_s=1) as make:

        def vm(**kw: Any) -> Sandbox:
            return make(**{"backend": "vm", "image": "bookworm", **VM_SHAPE, **kw})

        yield vm


@pytest.fixture(scope="module")
def shared_vm(session_client: Client) -> Iterator[Sandbox]:
    """One bookworm VM for the tests that only read or write their own files."""
    with one_vm(session_client, "bookworm", "vm-shared") as sb:
        yield sb


def test_a_vm_runs_debian_with_systemd_as_its_init(shared_vm: Sandbox) -> None:
    r = shared_vm.run("cat /proc/1/comm; . /etc/os-release; echo $VERSION_CODENAME; uname -r")
    assert r.exit_code == 0, r.stderr
    comm, codename, release = r.text.split()
    assert (comm, codename) == ("systemd", "bookworm")
    assert release.endswith("-amd64")
    # aether is a system service of that systemd, on the virtio-serial port
    r = shared_vm.run("systemctl is-active dsec-aether.service; hostname")
    assert r.text.split() == ["active", shared_vm.id[:63]]


def test_the_sdk_surface_works_in_a_vm(shared_vm: Sandbox) -> None:
    sb = shared_vm
    sb.files.write("/root/hello.txt", b"hi from the host\n")
    assert sb.files.read("/root/hello.txt") == b"hi from the host\n"
    assert "/root/hello.txt" in [e.path for e in sb.files.list("/root")]
    out = list(sb.stream("for i in 1 2 3; do echo line$i; sleep 0.1; done"))
    text = b"".join(e.data for e in out if isinstance(e, Output))
    assert text.split() == [b"line1", b"line2", b"line3"]
    assert isinstance(out[0], Started) and isinstance(out[-1], Exited)
    session = sb.session()
    session.run("cd /tmp && export GREETING=hey")
    assert session.run("pwd; echo $GREETING").text.split() == ["/tmp", "hey"]
    server = sb.start("python3 -m http.server 8765 --directory /root")
    sb.wait_for_port(8765, timeout_s=60)
    resp = sb.http(8765, "/hello.txt")
    assert resp.status == 200 and resp.body == b"hi from the host\n"
    server.kill()
    watcher = sb.files.create_watcher("/root")
    sb.run("echo x > /root/watched.txt")
    events = wait_for(lambda: sb.files.watcher_events(watcher), timeout_s=30)
    assert "watched.txt" in {ev.name for ev in events}
    sb.files.remove_watcher(watcher)


def test_the_disk_limit_is_the_vm_disk_size(make_vm: Callable[..., Sandbox]) -> None:
    sb = make_vm(disk_mb=4096)
    size_kb = int(sb.run("df -k --output=size / | tail -n1").text)
    # the root filesystem grew (systemd-growfs) to the sandbox's disk, not beyond it
    assert 3_500_000 < size_kb <= 4096 * 1024


def test_a_disk_smaller_than_the_image_is_refused(client: Client) -> None:
    with pytest.raises(InvalidArgument) as err:
        client.create(backend="vm", image="bookworm", disk_mb=600, **VM_SHAPE)
    assert err.value.metadata.get("field") == "resources.disk_mb"
    assert "bookworm" in err.value.message


def test_an_unknown_vm_image_is_refused_naming_the_ones_there_are(client: Client) -> None:
    with pytest.raises(InvalidArgument) as err:
        client.create(backend="vm", image="python", **VM_SHAPE)
    assert err.value.reason == "IMAGE_NOT_FOUND"
    assert "bookworm" in err.value.message and "desktop" in err.value.message


def test_a_guest_kernel_panic_ends_the_sandbox_with_kernel_fault(
    make_vm: Callable[..., Sandbox],
) -> None:
    sb = make_vm()
    sb.run("echo 1 > /proc/sys/kernel/sysrq; (sleep 0.5; echo c > /proc/sysrq-trigger) &")
    wait_for(lambda: sb.refresh().state == "TERMINATED", timeout_s=120)
    assert sb.info.termination_reason == "KERNEL_FAULT", sb.info.termination_message
    assert "panic" in sb.info.termination_message.lower()


def test_a_domain_destroyed_outside_the_edge_ends_the_sandbox_runtime_error(
    make_vm: Callable[..., Sandbox],
) -> None:
    sb = make_vm()
    (name,) = [
        n for n in subprocess.run(
            ["virsh", "-c", "qemu:///system", "list", "--name"], capture_output=True, text=True,
            check=True,
        ).stdout.split() if n.endswith("-" + sb.id)
    ]  # fmt: skip
    subprocess.run(["virsh", "-c", "qemu:///system", "destroy", name], check=True,
                   capture_output=True)  # fmt: skip
    wait_for(lambda: sb.refresh().state == "TERMINATED", timeout_s=60)
    assert sb.info.termination_reason == "RUNTIME_ERROR"
    assert "destroyed outside the edge" in sb.info.termination_message


def test_pause_saves_the_vm_to_disk_and_resume_brings_it_back(
    make_vm: Callable[..., Sandbox],
) -> None:
    sb = make_vm()
    sb.run("echo kept > /dev/shm/in-memory; nohup sleep 100000 >/dev/null 2>&1 &")
    pid = sb.run("pgrep -xo sleep").text.strip()
    t0 = time.monotonic()
    info = sb.pause()
    assert info.state == "PAUSED"
    assert time.monotonic() - t0 < 120
    assert sb.refresh().state == "PAUSED"
    r = sb.run("cat /dev/shm/in-memory; pgrep -xo sleep")  # any call resumes it
    assert r.text.split() == ["kept", pid]
    assert sb.refresh().state == "RUNNING"


def test_an_edge_restart_takes_running_and_paused_vms_back(
    make_vm: Callable[..., Sandbox], vm_cluster: LocalCluster
) -> None:
    running = make_vm()
    paused = make_vm()
    running.run("echo before > /root/mark")
    paused.run("echo paused-before > /root/mark")
    paused.pause()
    edge = f"edge-{vm_cluster.edges[0].edge_id}"
    vm_cluster.kill(edge, signal.SIGKILL)  # a crash: the domains run on without the edge
    vm_cluster.restart(edge)
    wait_for(lambda: running.refresh().state == "RUNNING", timeout_s=120)
    assert running.run("cat /root/mark").text.strip() == "before"
    assert paused.refresh().state == "PAUSED"
    assert paused.run("cat /root/mark").text.strip() == "paused-before"
