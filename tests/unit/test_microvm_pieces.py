"""The microVM backend's host-side pieces that need no guest: the console's reading of a
guest's last words, the initramfs archive, the module order, the QEMU command line that a
snapshot must find unchanged, what pack_diff leaves out of a guest's writable layer, and what a
fork's child is told and given."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from edge.backends import guest_channel, packing
from edge.backends.guest_console import Console
from edge.backends.microvm import backend, guest, qemu, templates
from edge.backends.microvm.vm import Shape, disks_with_writable
from edge.images import ResolvedImage
from edge.model import SandboxRecord, SandboxSpec

PANIC_TAIL = b"""[    4.38] Kernel panic - not syncing: sysrq triggered crash\r
[    4.38] CPU: 0 PID: 131 Comm: sh Not tainted 6.1.0-57-cloud-amd64\r
"""


@pytest.mark.parametrize(
    ("text", "reason", "says"),
    [
        (PANIC_TAIL, "KERNEL_FAULT", "sysrq triggered crash"),
        (b"[ 4.3] Kernel panic - not syncing: System is deadlocked on memory\n", "OOM", "memory"),
        (
            b"[ 9.1] Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100\n",
            "CHANNEL_CLOSED",
            "aether",
        ),
        (b"DSEC-INIT: FATAL mount the overlay\n", "RUNTIME_ERROR", "mount the overlay"),
    ],
)
def test_the_console_tells_how_a_guest_ended(text: bytes, reason: str, says: str) -> None:
    c = Console("unused")
    c.feed(b"[    0.26] PCI: Fatal: No config space access function found\n" + text)
    told = c.diagnose()
    assert told is not None and told[0] == reason and says in told[1]


def test_a_console_with_nothing_to_tell_leaves_the_verdict_to_the_caller() -> None:
    c = Console("unused")
    c.feed(b"INFO aether[1]: claimed\n")
    assert c.diagnose() is None


def test_counters_are_read_across_chunks_and_the_record_stays_bounded() -> None:
    c = Console("unused", head_bytes=1024, tail_bytes=4096)
    line = b"[ 4.7] Out of memory: Killed process 142 (tail) total-vm:33792kB\n"
    c.feed(line[:20])
    c.feed(line[20:] + b"aether[1]: DSEC-COUNTER pids_limit_hits=7\n")
    for _ in range(1000):  # a guest writing its console without end
        c.feed(b"x" * 1000 + b"\n")
    c.feed(b"aether[1]: DSEC-DISK-FULL free_bytes=4096\n" + line)
    assert c.oom_kills == 2 and c.counters == {"pids_limit_hits": 7}
    assert c.disk_full == "free_bytes=4096"
    assert len(c.head) == 1024 and len(c.tail) == 4096
    assert b"not kept" in c.text() and c.text().endswith(line)


def test_the_initramfs_is_a_newc_archive_with_init_busybox_and_modules(tmp_path: Path) -> None:
    kit = guest.build_guest(tmp_path)
    listing = subprocess.run(
        f"zcat {kit.initrd} | cpio -t --quiet", shell=True, capture_output=True, check=True
    ).stdout.decode()
    names = set(listing.split())
    assert {"init", "bin/busybox", "modules.order", "mod/virtio_mmio.ko", "mod/erofs.ko"} <= names
    assert guest.build_guest(tmp_path) == kit  # content-addressed: built once


def test_modules_load_after_their_dependencies() -> None:
    _, release = guest.find_kernel()
    order = [p.name.split(".ko")[0] for p in guest.module_order(release)]
    assert order.index("virtio") < order.index("virtio_mmio") < order.index("virtio_blk")
    assert order.index("failover") < order.index("net_failover") < order.index("virtio_net")


def _machine(
    memory: qemu.Memory, *, incoming: bool, tap: int | None, balloon: bool = False
) -> list[str]:
    return qemu.Machine(
        vcpus=1,
        memory_mb=256,
        kernel=Path("/boot/k"),
        initrd=Path("/i"),
        append="console=ttyS0",
        disks=[qemu.Disk("rw", Path("/rw.img"), False), qemu.Disk("l0", Path("/l0"), True)],
        memory=memory,
        agent_fd=3,
        qmp_fd=4,
        console_fd=5,
        mac="02:00:00:00:00:01",
        tap_fd=tap,
        incoming=incoming,
        balloon=balloon,
    ).argv()


def _devices(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "-device"]


def test_a_clone_has_its_template_s_devices_in_the_same_order() -> None:
    template = _machine(qemu.Memory("file", Path("/t/ram"), share=True), incoming=False, tap=None)
    clone = _machine(qemu.Memory("file", Path("/t/ram"), share=False), incoming=True, tap=7)

    assert _devices(template) == _devices(clone)
    assert "share=on" in " ".join(template) and "share=off" in " ".join(clone)
    assert clone[-2:] == ["-incoming", "defer"]
    assert "tap,id=net0,fd=7" in clone and "hubport,id=net0,hubid=0" in template


def test_a_guest_that_reports_free_pages_has_the_balloon_in_every_restore_of_it() -> None:
    ram = qemu.Memory("ram")
    boot = _machine(ram, incoming=False, tap=7, balloon=True)
    restore = _machine(ram, incoming=True, tap=8, balloon=True)
    assert _devices(boot) == _devices(restore)
    assert _devices(boot)[-1] == "virtio-balloon-device,free-page-reporting=on"
    assert not any("balloon" in d for d in _devices(_machine(ram, incoming=False, tap=7)))


def test_a_template_made_without_the_balloon_is_not_one_made_with_it(tmp_path: Path) -> None:
    (tmp_path / "l0").write_bytes(b"layer")
    disks = [qemu.Disk("l0", tmp_path / "l0", True)]
    shape = Shape(1, 256, 1024)
    plain = templates.template_key("kit", "tcg", shape, disks)
    assert plain == templates.template_key("kit", "tcg", shape, disks, balloon=False)
    assert plain != templates.template_key("kit", "tcg", shape, disks, balloon=True)


def test_the_initramfs_has_the_balloon_driver_and_not_pmem() -> None:
    _, release = guest.find_kernel()
    order = [p.name.split(".ko")[0] for p in guest.module_order(release)]
    assert order.index("virtio") < order.index("virtio_balloon")
    assert "virtio_pmem" not in order and "nd_pmem" not in order


def _child(sandbox_id: str, net: dict[str, object] | None) -> SandboxRecord:
    rec = SandboxRecord(sandbox_id, "p", "u", SandboxSpec(backend="MICROVM"), "e")
    if net is not None:
        rec.runtime["net"] = net
    return rec


def test_a_fork_child_is_told_its_own_identity_and_address() -> None:
    net = {"mac": "02:aa:bb:cc:dd:ee", "address": "10.9.0.7", "prefix_len": 16}
    a = guest_channel.fork_sync(
        _child("sb-child1", {**net, "gateway": "10.9.0.1", "dns": "10.9.0.1"})
    )
    assert a.hostname == "sb-child1"
    assert a.files["/etc/hostname"] == "sb-child1\n"
    assert "127.0.1.1\tsb-child1" in a.files["/etc/hosts"]
    assert a.files["/etc/resolv.conf"] == "nameserver 10.9.0.1\n"
    assert (a.network.address, a.network.prefix_len, a.network.gateway) == (
        "10.9.0.7",
        16,
        "10.9.0.1",
    )
    assert a.network.mac == "02:aa:bb:cc:dd:ee"
    b = guest_channel.fork_sync(_child("sb-child2", None))
    assert b.hostname == "sb-child2" and not b.HasField("network")
    assert "/etc/resolv.conf" not in b.files
    # every child its own entropy and the clock of its start
    assert a.entropy != b.entropy and len(a.entropy) == 64 and b.clock_unix_ns > 0


def test_a_fork_child_has_the_source_s_disks_in_order_but_its_own_writable_one() -> None:
    src = _child("sb-src", None)
    src.runtime["disks"] = [
        ["rw", "/s/rw/w-1.img", False],
        ["tk", "/tk.erofs", True],
        ["l0", "/l0", True],
    ]
    disks = disks_with_writable(src, Path("/s/rw/sb-kid.img"))
    assert [(d.serial, str(d.path), d.readonly) for d in disks] == [
        ("rw", "/s/rw/sb-kid.img", False),
        ("tk", "/tk.erofs", True),
        ("l0", "/l0", True),
    ]


def test_pack_diff_knows_every_mount_point_init_makes_in_the_guest_s_root() -> None:
    # A directory init.sh creates in the overlay for a mount is residue (left out when empty):
    # the backend's list and the script must not drift apart.
    init = (Path(backend.__file__).parent / "init.sh").read_text()
    made = {
        "/" + d
        for line in init.splitlines()
        if line.startswith("mkdir -p /newroot/")
        for d in re.findall(r"/newroot/([^\s/]+)(?=\s|$)", line)
    }
    assert made == set(backend.GUEST_MOUNT_POINTS)


def test_pack_diff_never_packs_the_identity_files_a_claim_writes() -> None:
    rec = SandboxRecord("sb-pack", "p", "u", SandboxSpec(), "e")
    rec.runtime["net"] = {
        "mac": "02:00:00:00:00:01",
        "address": "10.0.0.2",
        "prefix_len": 24,
        "gateway": "10.0.0.1",
        "dns": "10.0.0.1",
    }
    files = set(guest_channel.identity(rec).files)
    assert files and files <= set(backend.GUEST_IDENTITY_FILES)


def test_a_fork_child_keeps_every_image_entry_pack_diff_builds_on() -> None:
    # A child's runtime record copies its source's image entries by name: the names and
    # packing.image_record must not drift apart.
    recorded = packing.image_record(ResolvedImage("busybox:latest", []))
    assert set(recorded) == set(backend.IMAGE_RECORD_KEYS)
