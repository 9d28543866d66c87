"""The edge's own reasons to end a sandbox: its TTL, its idle timeout, the node's disk reserve.

Enforced on the edge (so a sandbox is reclaimed even when every central service is down), by
two loops the edge server runs: the reaper (every ``reap_interval_s``: TTL and idle timeouts,
and terminated records forgotten after ``terminated_retention_s``) and the disk guard (every
``disk_check_interval_s``: below a filesystem's free-space reserve, the sandbox writing there
fastest ends, DISK_QUOTA). Either ends a sandbox through the manager's one ending
(:meth:`edge.manager.SandboxManager.stop`); this module only decides which and when.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import time
from typing import Protocol

from edge.backends.contract import DiskUsage, Executes, SandboxBackend, offers, require
from edge.disk_guard import Allocations, DiskGuard
from edge.model import TERMINAL, SandboxRecord
from edge.records import RecordStore
from libdsec.errors import DSecError

log = logging.getLogger(__name__)


class Sandboxes(Protocol):
    """What the reaper reads and calls of the manager (edge.manager.SandboxManager): its
    records, its backends, and its one way to end a sandbox."""

    records: dict[str, SandboxRecord]
    backends: dict[str, SandboxBackend]
    store: RecordStore

    def backend_of(self, rec: SandboxRecord) -> SandboxBackend: ...

    async def stop(
        self, sandbox_id: str, *, reason: str = ..., message: str = ..., grace_s: float = ...
    ) -> SandboxRecord: ...

    async def pause(self, sandbox_id: str, *, files_only: bool = False) -> SandboxRecord: ...

    def changed(self, rec: SandboxRecord) -> None: ...


class Reaper:
    """TTL, idle and disk-reserve endings of one manager's sandboxes."""

    def __init__(
        self,
        manager: Sandboxes,
        *,
        terminated_retention_s: float,
        reap_interval_s: float,
        disk_guard: DiskGuard | None,
        disk_check_interval_s: float,
        paused_at_ttl_keep_s: float = 86400.0,
    ) -> None:
        self.manager = manager
        #: How long a sandbox paused at its TTL is kept for a resume before it ends, TTL.
        self.paused_at_ttl_keep_s = paused_at_ttl_keep_s
        self.retention_s = terminated_retention_s
        self.reap_interval_s = reap_interval_s
        #: Free-space reserve of the filesystems the edge writes (None: not watched).
        self.disk_guard = disk_guard
        self.disk_check_interval_s = disk_check_interval_s
        self._disk_passes = 0

    # ------------------------------------------------------------ TTL, idle

    async def reap_once(self, now: float | None = None) -> builtins.list[str]:
        """Stops sandboxes past TTL or idle timeout; forgets old terminated records."""
        m = self.manager
        now = time.time() if now is None else now
        reaped = []
        for rec in list(m.records.values()):
            if rec.state == TERMINAL:
                if rec.terminated_at and now - rec.terminated_at > self.retention_s:
                    m.records.pop(rec.sandbox_id, None)
                    m.store.forget(rec.sandbox_id)
                continue
            if rec.state not in ("RUNNING", "PAUSED"):
                continue
            if now >= rec.expires_at:
                if rec.spec.pause_at_ttl and not rec.paused_at_ttl:
                    await self._pause_at_ttl(rec, now)
                    continue
                message = (
                    f"paused at its TTL and not resumed within {self.paused_at_ttl_keep_s:.0f} s"
                    if rec.paused_at_ttl
                    else ""
                )
                await m.stop(rec.sandbox_id, reason="TTL", message=message, grace_s=1.0)
                reaped.append(rec.sandbox_id)
            elif (
                rec.spec.idle_timeout_s
                and rec.state == "RUNNING"
                and now - rec.last_active_at >= rec.spec.idle_timeout_s
            ):
                if self._calls_in_flight(rec):
                    # A call under way (a long command, a stream, an open watch) is activity:
                    # the idle time counts from its end.
                    rec.last_active_at = now
                    continue
                await m.stop(rec.sandbox_id, reason="IDLE", grace_s=1.0)
                reaped.append(rec.sandbox_id)
        return reaped

    async def _pause_at_ttl(self, rec: SandboxRecord, now: float) -> None:
        """The TTL of a sandbox that asked for a pause instead (spec.pause_at_ttl): paused
        (or left paused), kept for paused_at_ttl_keep_s; a resume gives it a fresh TTL
        (SandboxManager.resume). A pause that fails ends it, TTL, as without the option."""
        m = self.manager
        try:
            if rec.state == "RUNNING":
                await m.pause(rec.sandbox_id, files_only=rec.spec.pause_at_ttl_files_only)
        except DSecError as exc:
            if rec.state == TERMINAL:
                return
            log.warning(
                "sandbox %s: the pause at its TTL failed (%s): ended instead",
                rec.sandbox_id,
                exc,
                extra={"sandbox_id": rec.sandbox_id},
            )
            await m.stop(rec.sandbox_id, reason="TTL", message=f"the pause failed: {exc}")
            return
        if rec.state != "PAUSED":
            return  # ended or resumed meanwhile: the next pass sees it again
        rec.paused_at_ttl = True
        rec.deadline_at = now + self.paused_at_ttl_keep_s
        m.changed(rec)
        log.info(
            "sandbox %s paused at its TTL (kept %.0f s unless resumed)",
            rec.sandbox_id,
            self.paused_at_ttl_keep_s,
            extra={"sandbox_id": rec.sandbox_id},
        )

    def _calls_in_flight(self, rec: SandboxRecord) -> bool:
        backend = self.manager.backend_of(rec)
        if not offers(backend, Executes):
            return False
        try:
            channel = require(backend, Executes).channel(rec)
        except DSecError:
            return False  # no channel now (reconnecting): nothing under way on it
        return bool(getattr(channel, "open_calls", 0))

    async def reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            await self.reap_once()

    # ------------------------------------------------------------ disk reserve

    def _disk_allocations(self) -> Allocations:
        """Per live sandbox, the bytes it holds on which filesystem (blocking)."""
        out: Allocations = {}
        for b in {id(b): b for b in self.manager.backends.values()}.values():
            if offers(b, DiskUsage):
                out.update(require(b, DiskUsage).disk_allocations())
        return out

    async def disk_guard_once(self) -> str | None:
        """One pass of the free-space reserve (see edge.disk_guard): returns the sandbox it
        ended, if any."""
        guard = self.disk_guard
        if guard is None:
            return None
        filesystems = await asyncio.to_thread(guard.sample)
        fs = guard.low()
        self._disk_passes += 1
        near = any(f.free_bytes < 2 * guard.reserve_bytes for f in filesystems)
        if fs is None and not near and self._disk_passes % 8:
            return None  # allocations are sampled every 8th pass while there is room
        allocations = await asyncio.to_thread(self._disk_allocations)
        if fs is None:
            guard.remember(allocations)
            return None
        sid = guard.fastest_writer(fs, allocations)
        records = self.manager.records
        if sid is None or sid not in records or not records[sid].live:
            if self._disk_passes % 40 == 1:
                log.warning(
                    "%s has %d MiB free, below the reserve of %d MiB, and no sandbox is "
                    "writing there: creates are refused until space is back",
                    fs.path,
                    fs.free_mb,
                    guard.reserve_bytes >> 20,
                )
            return None
        used_mb = allocations[sid][1] >> 20
        log.warning(
            "%s below its reserve (%d MiB free): ending %s, the fastest writer (%d MiB)",
            fs.path,
            fs.free_mb,
            sid,
            used_mb,
            extra={"sandbox_id": sid, "reason": "DISK_QUOTA"},
        )
        await self.manager.stop(
            sid,
            reason="DISK_QUOTA",
            message=(
                f"the node's disk ({fs.path}) fell below its free-space reserve "
                f"({fs.free_mb} MiB free) while this sandbox was writing fastest "
                f"({used_mb} MiB in its writable layer)"
            ),
            grace_s=0.0,
        )
        await asyncio.to_thread(guard.sample)  # its space is back: admission sees it at once
        return sid

    async def disk_guard_loop(self) -> None:
        while True:
            await asyncio.sleep(self.disk_check_interval_s)
            try:
                await self.disk_guard_once()
            except Exception:
                log.exception("disk guard pass failed")
