"""A microVM's host side: its shape, its QEMU process (`Vm`), and how the edge tells its own
QEMU processes from any other (the `-name dsec:<edge tag>:<vm id>` of their command line)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from edge.backends.guest_console import Console
from edge.backends.microvm import qemu
from edge.model import SandboxRecord, SandboxSpec

#: The QEMU cgroups' cpu period (us).
CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class Shape:
    """What must match between a template and its clones."""

    vcpus: int
    memory_mb: int
    disk_mb: int


@dataclass
class Vm:
    """A running guest's host side."""

    sandbox_id: str
    rec: SandboxRecord | None  # None for a template's guest
    pid: int
    qmp: qemu.Qmp
    console: Console
    child: subprocess.Popen[bytes] | None  # None after an edge restart (not our child)
    qemu_name: str = ""  # the id in QEMU's -name: the sandbox's, or the warm guest's it was
    exit_status: int | None = None  # known for our children only
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    def watch(self) -> None:
        """Set `exited` when the process ends (a pidfd is readable then), child or not."""
        try:
            fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            self._ended()
            return
        loop = asyncio.get_running_loop()

        def ready() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            self._ended()

        loop.add_reader(fd, ready)

    def _ended(self) -> None:
        if self.child is not None:
            self.exit_status = self.child.wait()
        self.exited.set()

    @property
    def alive(self) -> bool:
        """Not exited: the pidfd event may lag the sockets' EOF, so /proc decides too."""
        if self.exited.is_set():
            return False
        return is_our_qemu(self.pid, self.qemu_name or self.sandbox_id, None)

    async def wait(self, timeout_s: float) -> bool:
        """True once the process has ended, False if it still runs after `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.exited.wait(), timeout_s)
        return self.exited.is_set()


def write_back(path: Path) -> None:
    """Write a file's dirty pages to disk and drop its pages from the page cache."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


#: Prefix of QEMU's argv for a BEST_EFFORT guest: util-linux's ``chrt`` puts it under
#: SCHED_IDLE and execs it, so every thread QEMU starts inherits the policy. Not a
#: ``preexec_fn``: Python between fork and exec in the edge (gRPC's threads) can deadlock.
SCHED_IDLE = ["chrt", "--idle", "0"]


def disk_id(rec: SandboxRecord) -> str:
    return str(rec.runtime.get("disk_id") or rec.sandbox_id)


def writable_disk(rec: SandboxRecord) -> Path:
    """The sandbox's writable disk (its file keeps the name it was made under)."""
    return next(Path(p) for serial, p, _ in rec.runtime["disks"] if serial == "rw")


def disks_with_writable(rec: SandboxRecord, rw: Path) -> list[qemu.Disk]:
    """The sandbox's disks in their order (a snapshot loads only into the same devices), the
    writable one replaced by `rw` (a fork's copy of it)."""
    return [
        qemu.Disk(serial, rw if serial == "rw" else Path(p), bool(ro))
        for serial, p, ro in rec.runtime["disks"]
    ]


def cpu_quota_us(spec: SandboxSpec) -> int:
    return max(1000, spec.cpu_millis * CPU_PERIOD_US // 1000)


def mac_of(vm_id: str) -> str:
    """A locally administered unicast MAC, stable per sandbox."""
    b = hashlib.sha256(vm_id.encode()).digest()[:5]
    return "02:" + ":".join(f"{x:02x}" for x in b)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def is_our_qemu(pid: int, vm_id: str, tag: str | None) -> bool:
    """`pid` is alive and is the QEMU of `vm_id` (not a reused pid, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[0] == "Z":
        return False
    name = _name_of(_cmdline(pid))
    return name is not None and name[1] == vm_id and tag in (None, name[0])


def _name_of(argv: list[str]) -> tuple[str, str] | None:
    """(edge tag, vm id) from a QEMU command line of this backend's."""
    if "-name" not in argv:
        return None
    parts = argv[argv.index("-name") + 1].split(":")
    return (parts[1], parts[2]) if len(parts) == 3 and parts[0] == "dsec" else None


def our_qemus(tag: str) -> list[tuple[int, str]]:
    """(pid, vm id) of every QEMU of the edge with `tag` on the node."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            name = _name_of(_cmdline(int(d.name)))
            if name is not None and name[0] == tag:
                out.append((int(d.name), name[1]))
    return out
