"""One QEMU `microvm` process: its command line, its QMP monitor, saving and restoring it.

Every socket QEMU serves (the agent's virtio-serial port, the QMP monitor, the serial console)
is bound and listened on by the edge and handed to QEMU as an inherited descriptor
(`-chardev socket,fd=N,server=on`): the edge reaches each through a short /proc/self/fd path
(AF_UNIX paths are limited to 107 bytes), and the files stay where a restarted edge finds them.

The device list is the same, in the same order, for a template, its clones and a restore: a
snapshot loads only into the machine it was taken from. What differs between them is behind
the devices (which files the drives are, which tap the NIC uses, how RAM is backed).

Snapshots go through QEMU 7.2's migration to `exec:cat` (7.2 has no `file:` URI; see
../shared/notes/microvm-probe.md). A template's RAM is a `memory-backend-file` with share=on:
saved with `x-ignore-shared`, only device state is written and the RAM file *is* the memory.
Clones map that file with share=off (MAP_PRIVATE: copy-on-write, the file never changes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libdsec.errors import Unavailable

#: The default migration bandwidth (128 MiB/s) would throttle a save; this is "unlimited".
MAX_BANDWIDTH = 100 << 30


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


class Qmp:
    """A QMP connection: one command at a time, events kept (the last few) for diagnosis."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()
        self.events: list[dict[str, Any]] = []

    async def connect(self, timeout_s: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(
                    self.address, limit=1 << 20
                )
                break
            except (ConnectionError, FileNotFoundError) as exc:
                if loop.time() > deadline:
                    raise QmpError(f"QMP at {self.address} unreachable: {exc}") from exc
                await asyncio.sleep(0.005)
        await asyncio.wait_for(self._read(), timeout_s)  # the greeting
        await self.execute("qmp_capabilities")

    async def _read(self) -> dict[str, Any]:
        assert self._reader is not None
        line = await self._reader.readline()
        if not line:
            raise QmpError("QMP connection closed")
        msg: dict[str, Any] = json.loads(line)
        return msg

    async def execute(self, command: str, timeout_s: float = 30.0, **arguments: Any) -> Any:
        async with self._lock:
            if self._writer is None:
                raise QmpError("QMP not connected")
            msg: dict[str, Any] = {"execute": command}
            if arguments:
                msg["arguments"] = arguments
            self._writer.write(json.dumps(msg).encode() + b"\n")
            await self._writer.drain()
            async with asyncio.timeout(timeout_s):
                while True:
                    reply = await self._read()
                    if "event" in reply:
                        self.events = [*self.events[-15:], reply]
                        continue
                    if "error" in reply:
                        raise QmpError(f"{command}: {reply['error'].get('desc', reply['error'])}")
                    return reply.get("return")

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
            self._writer = None


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


async def restore(qmp: Qmp, path: Path, *, ignore_shared: bool, timeout_s: float = 120.0) -> None:
    """Load `path` into a QEMU started with `-incoming defer`, then let the guest run."""
    await qmp.execute(
        "migrate-set-capabilities",
        capabilities=[{"capability": "x-ignore-shared", "state": ignore_shared}],
    )
    await qmp.execute("migrate-incoming", uri="exec:cat " + shlex.quote(str(path)))
    await _wait_for(qmp, "query-status", ("paused", "running", "postmigrate"), (), timeout_s)
    status = await qmp.execute("query-status")
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
