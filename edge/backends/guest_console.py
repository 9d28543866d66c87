"""A guest's serial console, read by the edge: the kernel's last words and its OOM kills.

QEMU serves the console as a socket (qemu.py); the edge reads it for the guest's whole life and
keeps a bounded record in memory (the first `head_bytes` and a ring of the last `tail_bytes`):
a guest that writes its console without end (anything root in the guest can do) costs the host
no disk and no unbounded memory. What the edge needs from it:

- why the guest ended (`diagnose`): a kernel panic (KERNEL_FAULT), the OOM killer taking the
  guest's init (OOM), init's own refusal to start ("DSEC-INIT: FATAL ...", RUNTIME_ERROR), or
  aether exiting (pid 1 gone: CHANNEL_CLOSED);
- how many processes the guest kernel OOM-killed (`oom_kills`), as the memory cgroup tells a
  container's, and what aether reports of the guest's own counters (its pids cgroup's limit
  hits: `counters`). Root in the guest can write the console too: it can only misreport its
  own sandbox.

At the end the record is written to the sandbox's console log (at most head + tail bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge.backends.channels import ChannelKeeper
    from edge.model import SandboxRecord
    from edge.network.manager import NetworkManager

OOM_KILL = re.compile(rb"Out of memory: Killed process|Memory cgroup out of memory")
PANIC = re.compile(rb"Kernel panic - not syncing: ([^\r\n]*)")
INIT_FATAL = re.compile(rb"DSEC-INIT: FATAL ([^\r\n]*)")
KILLED_INIT = b"Attempted to kill init"
#: Counters the guest's aether reports (what only the guest can read, e.g. its pids cgroup).
COUNTER = re.compile(rb"DSEC-COUNTER (\w+)=(\d+)")
DISK_FULL = re.compile(rb"DSEC-DISK-FULL ([^\r\n]*)")


class Console:
    def __init__(self, address: str, head_bytes: int = 16 << 10, tail_bytes: int = 64 << 10):
        self.address = address
        self.head_bytes = head_bytes
        self.tail_bytes = tail_bytes
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self.oom_kills = 0
        self.counters: dict[str, int] = {}
        self.disk_full = ""  # what aether said when the writable disk filled up
        self._line = bytearray()  # the line being received (scanned when complete)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._read(), name=f"console-{self.address}")

    async def _read(self) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(self.address)
        except OSError:
            return
        try:
            while chunk := await reader.read(1 << 16):
                self.feed(chunk)
        except OSError:
            pass
        finally:
            writer.close()

    def feed(self, data: bytes) -> None:
        self._scan(data)
        room = self.head_bytes - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            over = len(self.tail) - self.tail_bytes
            if over > 0:
                del self.tail[:over]
                self.dropped += over

    def _scan(self, data: bytes) -> None:
        self._line += data
        *lines, rest = self._line.split(b"\n")
        self._line = bytearray(rest[-4096:])  # an endless line is not a line
        for line in lines:
            if OOM_KILL.search(line):
                self.oom_kills += 1
            elif m := COUNTER.search(line):
                self.counters[m.group(1).decode()] = int(m.group(2))
            elif m := DISK_FULL.search(line):
                self.disk_full = m.group(1).decode(errors="replace").strip() or "full"

    async def drained(self, timeout_s: float = 2.0) -> None:
        """Wait until QEMU closed the console (after it exited) or `timeout_s`."""
        if self._task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def text(self) -> bytes:
        gap = f"\n[... {self.dropped} bytes not kept ...]\n".encode() if self.dropped else b""
        return bytes(self.head) + gap + bytes(self.tail)

    def diagnose(self) -> tuple[str, str] | None:
        """(termination reason, message) told by the console, or None if it tells nothing."""
        text = self.text()
        fatal = INIT_FATAL.search(text)
        if fatal:
            return "RUNTIME_ERROR", "guest init: " + fatal.group(1).decode(errors="replace")
        panic = PANIC.search(text)
        if panic is None:
            return None
        why = panic.group(1).decode(errors="replace").strip()
        if "memory" in why.lower():  # "Out of memory and no killable processes", "deadlocked"
            return "OOM", "the guest ran out of memory: " + why
        if KILLED_INIT in panic.group(0):
            return "CHANNEL_CLOSED", "aether (the guest's init) exited: " + why
        return "KERNEL_FAULT", "guest kernel panic: " + why

    def write(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            path.write_bytes(self.text())


async def account(
    console: Console,
    rec: SandboxRecord,
    channels: ChannelKeeper,
    network: NetworkManager | None,
    disk_mb: int,
) -> None:
    """One round of a VM guest's accounting (every second, by its backend's watch loop):
    what its console counted (OOM kills, aether's counters) and what the host-side filter and
    resolver counted of it, into its record's violations; a guest past its policy's
    max_blocked_connects ends (POLICY_VIOLATION), one whose writable disk filled up ends
    (DISK_QUOTA), as a container does."""
    sid = rec.sandbox_id
    counted = dict(console.counters)
    if console.oom_kills:
        counted["oom_kills"] = console.oom_kills
    if network is not None:
        blocked = network.blocked(sid)
        if blocked:
            counted["blocked_connects"] = blocked
        refused = network.dns_refusals_of(sid)
        if refused:
            counted["dns_refusals"] = refused
        rec.blocked_names = network.blocked_names(sid)
    if any(rec.violations.get(k) != v for k, v in counted.items()):
        rec.violations = {**rec.violations, **counted}
    max_blocked = int((rec.spec.network or {}).get("max_blocked_connects", 0) or 0)
    blocked = counted.get("blocked_connects", 0)
    if max_blocked and blocked > max_blocked and rec.state == "RUNNING":
        msg = (
            f"{blocked} connections blocked by the network policy "
            f"(max_blocked_connects {max_blocked})"
        )
        await channels.report_exit(sid, "POLICY_VIOLATION", msg)
    elif console.disk_full and rec.state == "RUNNING":
        msg = f"the writable disk ({disk_mb} MB) is full ({console.disk_full})"
        await channels.report_exit(sid, "DISK_QUOTA", msg)
