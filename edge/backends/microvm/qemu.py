"""One QEMU `microvm` process: its command line, its QMP monitor, saving and restoring it.

Every socket QEMU serves (the agent's virtio-serial port, the QMP monitor, the serial console)
is bound and listened on by the edge and handed to QEMU as an inherited descriptor
(`-chardev socket,fd=N,server=on`): the edge reaches each through a short /proc/self/fd path
(AF_UNIX paths are limited to 107 bytes), and the files stay where a restarted edge finds them.

The device list is the same, in the same order, for a template, its clones and a restore: a
snapshot loads only into the machine it was taken from. What differs between them is behind
the devices (which files the drives are, which tap the NIC uses, how RAM is backed). So the
one optional device, the free-page-reporting balloon (`Machine.balloon`), is chosen when a
guest first boots and recorded with the sandbox: its restores and clones have it or not as the
guest did, whatever the edge's setting is by then.

Snapshots go through QEMU 7.2's migration to `exec:cat` (7.2 has no `file:` URI; see
../shared/notes/microvm-probe.md). A template's RAM is a `memory-backend-file` with share=on:
saved with `x-ignore-shared`, only device state is written and the RAM file *is* the memory.
Clones map that file with share=off (MAP_PRIVATE: copy-on-write, the file never changes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qemu.qmp import ConnectError, ExecInterruptedError, ExecuteError, QMPClient, StateError
from qemu.qmp.message import Message

from libdsec.errors import Unavailable

# Every QMP failure reaches the edge as a QmpError naming its cause; the library would also log
# one ERROR line per failed connect (the edge retries every 5 ms until QEMU listens).
logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)

#: The default migration bandwidth (128 MiB/s) would throttle a save; this is "unlimited".
MAX_BANDWIDTH = 100 << 30
#: The MMIO balloon: no inflation target is ever set; the guest only reports free pages.
BALLOON_DEVICE = "virtio-balloon-device,free-page-reporting=on"


@dataclass(frozen=True)
class Disk:
    serial: str  # how the guest's init finds it (edge/backends/microvm/init.sh)
    path: Path
    readonly: bool


@dataclass(frozen=True)
class Memory:
    """How guest RAM is backed: a template's shared file, a clone's private map of it, or
    anonymous memory (cold boots without a template, restores of a paused sandbox)."""

    kind: str  # "file" | "ram"
    path: Path | None = None
    share: bool = False

    def object_arg(self, size_mb: int) -> str:
        if self.kind == "ram":
            return f"memory-backend-ram,id=mem,size={size_mb}M"
        assert self.path is not None
        share = "on" if self.share else "off"
        return f"memory-backend-file,id=mem,size={size_mb}M,mem-path={self.path},share={share}"


@dataclass
class Machine:
    vcpus: int
    memory_mb: int
    kernel: Path
    initrd: Path
    append: str
    disks: list[Disk]
    memory: Memory
    agent_fd: int
    qmp_fd: int
    console_fd: int
    mac: str
    tap_fd: int | None = None
    accel: str = "tcg"
    incoming: bool = False
    pidfile: Path | None = None
    #: virtio-balloon with free-page reporting: the guest hands pages it frees back (QEMU
    #: discards them, ~2 s after the guest frees them). Only for RAM that is the guest's own
    #: ("ram", or a template's share=on file): QEMU 7.2 discards a page of a file-backed
    #: guest by punching a hole in the *file*, even when mapped share=off, which for a clone
    #: is its template's RAM file -- every other clone's memory (see docs/ARCHITECTURE.md).
    balloon: bool = False
    extra: list[str] = field(default_factory=list)

    def argv(self, binary: str = "qemu-system-x86_64") -> list[str]:
        cpu = "host" if self.accel == "kvm" else "max"
        args = [
            binary,
            "-M",
            "microvm,acpi=on,memory-backend=mem",
            "-accel",
            self.accel,
            "-cpu",
            cpu,
            "-smp",
            str(self.vcpus),
            "-m",
            f"{self.memory_mb}M",
            "-object",
            self.memory.object_arg(self.memory_mb),
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
            "-kernel",
            str(self.kernel),
            "-initrd",
            str(self.initrd),
            "-append",
            self.append,
            "-chardev",
            f"socket,id=con,fd={self.console_fd},server=on,wait=off",
            "-serial",
            "chardev:con",
            "-chardev",
            f"socket,id=qmp,fd={self.qmp_fd},server=on,wait=off",
            "-mon",
            "chardev=qmp,mode=control",
            "-chardev",
            f"socket,id=agent,fd={self.agent_fd},server=on,wait=off",
            "-device",
            "virtio-serial-device",
            "-device",
            "virtserialport,chardev=agent,name=dsec.aether",
        ]
        for d in self.disks:
            ro = ",readonly=on" if d.readonly else ",discard=unmap"
            args += [
                "-drive",
                f"id={d.serial},file={d.path},format=raw,if=none,aio=threads{ro}",
                "-device",
                f"virtio-blk-device,drive={d.serial},serial={d.serial}",
            ]
        if self.tap_fd is not None:
            netdev = f"tap,id=net0,fd={self.tap_fd}"  # QEMU finds the tap's virtio header
        else:
            netdev = "hubport,id=net0,hubid=0"  # a NIC to nowhere (templates)
        args += ["-netdev", netdev, "-device", f"virtio-net-device,netdev=net0,mac={self.mac}"]
        if self.balloon:
            args += ["-device", BALLOON_DEVICE]
        if self.pidfile is not None:
            args += ["-pidfile", str(self.pidfile)]
        if self.incoming:
            args += ["-incoming", "defer"]
        return args + self.extra

    def fds(self) -> list[int]:
        fds = [self.agent_fd, self.qmp_fd, self.console_fd]
        return fds + ([self.tap_fd] if self.tap_fd is not None else [])


class QmpError(Unavailable):
    def __init__(self, message: str) -> None:
        super().__init__(message, reason="QMP_ERROR")


class _Client(QMPClient):
    """QEMU's own QMP client, keeping only the last few events (for diagnosis) instead of
    queueing every event for a reader the edge does not run."""

    def __init__(self) -> None:
        super().__init__(readbuflen=1 << 20)
        self.recent: list[dict[str, Any]] = []

    async def _event_dispatch(self, msg: Message) -> None:
        self.recent = [*self.recent[-15:], dict(msg)]


class Qmp:
    """A QMP connection (`qemu.qmp`, QEMU's own asyncio client) with the edge's conventions:
    connecting retries until QEMU listens, every command has a deadline, and every failure is a
    `QmpError` (an `Unavailable`)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._client = _Client()

    @property
    def events(self) -> list[dict[str, Any]]:
        """The last few events QEMU sent."""
        return self._client.recent

    async def connect(self, timeout_s: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                # The greeting and capability negotiation are part of connect().
                await asyncio.wait_for(self._client.connect(self.address), timeout_s)
                return
            except (ConnectError, TimeoutError) as exc:
                if loop.time() > deadline:
                    raise QmpError(f"QMP at {self.address} unreachable: {exc}") from exc
                await asyncio.sleep(0.005)

    async def execute(self, command: str, timeout_s: float = 30.0, **arguments: Any) -> Any:
        try:
            async with asyncio.timeout(timeout_s):
                return await self._client.execute(command, arguments or None)
        except ExecuteError as exc:
            raise QmpError(f"{command}: {exc}") from exc
        except StateError as exc:
            raise QmpError(f"{command}: QMP not connected") from exc
        except ExecInterruptedError as exc:
            raise QmpError(f"{command}: QMP connection closed") from exc

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.disconnect()


async def save(qmp: Qmp, path: Path, *, ignore_shared: bool, timeout_s: float = 120.0) -> None:
    """Stop the guest and write its state (and its RAM unless `ignore_shared` and the RAM is a
    shared file) to `path`; the guest stays stopped."""
    await qmp.execute(
        "migrate-set-capabilities",
        capabilities=[{"capability": "x-ignore-shared", "state": ignore_shared}],
    )
    await qmp.execute("migrate-set-parameters", **{"max-bandwidth": MAX_BANDWIDTH})
    await qmp.execute("stop")
    await qmp.execute("migrate", uri="exec:cat > " + shlex.quote(str(path)))
    await _wait_for(qmp, "query-migrate", ("completed",), ("failed", "cancelled"), timeout_s)


async def restore(
    qmp: Qmp, path: Path, *, ignore_shared: bool, start: bool = True, timeout_s: float = 120.0
) -> None:
    """Load `path` into a QEMU started with `-incoming defer`, then let the guest run (unless
    not `start`: a fork's helper only loads a state to save it again). A state saved from a
    stopped guest loads as "paused" (QEMU restores the run state it was saved in)."""
    await qmp.execute(
        "migrate-set-capabilities",
        capabilities=[{"capability": "x-ignore-shared", "state": ignore_shared}],
    )
    await qmp.execute("migrate-incoming", uri="exec:cat " + shlex.quote(str(path)))
    await _wait_for(qmp, "query-status", ("paused", "running", "postmigrate"), (), timeout_s)
    status = await qmp.execute("query-status")
    if not start:
        if status.get("status") == "running":
            raise QmpError(f"{path} was saved from a running guest: it ran on after its load")
        return
    if status.get("status") != "running":
        await qmp.execute("cont")


async def _wait_for(
    qmp: Qmp, query: str, done: tuple[str, ...], failed: tuple[str, ...], timeout_s: float
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay = 0.002
    while True:
        reply = await qmp.execute(query)
        status = reply.get("status", "")
        if status in done:
            return
        if status in failed:
            raise QmpError(f"{query}: {status}: {reply.get('error-desc', '')}")
        if loop.time() > deadline:
            raise QmpError(f"{query} still {status!r} after {timeout_s} s")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)
