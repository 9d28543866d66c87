"""The edge's sandbox manager: each sandbox's lifecycle, its events, and the facade over them.

It decides locally and never waits on the control plane. The servicer calls this class alone;
it delegates to small collaborators, each one idea:

- :mod:`edge.admission` (:class:`Admission`): whether a create fits this node (validation,
  capacity with overcommit, the disk reserve) and what the live sandboxes hold (accounting);
- :mod:`edge.records` (:class:`RecordStore`): the records on disk, from which a restarted edge
  re-adopts its running sandboxes (:meth:`SandboxManager.recover`);
- :mod:`edge.reaper` (:class:`Reaper`): TTL and idle timeouts and the disk reserve, enforced
  here (so a sandbox is reclaimed even when every central service is down).

What stays here is the lifecycle itself: create and start, pause and resume (one transition
at a time per sandbox, one shared resume task), the one ending per sandbox (:meth:`end`),
recovery, task-level operations, and the events subscribers watch.
"""

from __future__ import annotations

import asyncio
import builtins
import copy
import logging
import math
import time
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from common.steps import step
from edge.admission import AccountingError, Admission, Capacity, Load
from edge.backends.contract import (
    ForkKind,
    Forks,
    MemoryUsage,
    ModifiedFiles,
    NetworkPolicies,
    Pausable,
    PauseOutcome,
    PausesFilesOnly,
    ResumeFailed,
    SandboxBackend,
    UsageMetrics,
    check_declared,
    offers,
    require,
)
from edge.disk_guard import DiskGuard
from edge.drain import DrainFile, DrainState
from edge.model import EDGE_ID, LIVE_STATES, TERMINAL, SandboxRecord, SandboxSpec
from edge.reaper import Reaper
from edge.records import RecordStore
from edge.usage import UsageSamples
from libdsec.errors import (
    DSecError,
    EdgeCapacity,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    SandboxNotFound,
    SandboxTerminated,
    Unavailable,
)

if TYPE_CHECKING:
    from edge.metrics import EdgeMetrics

#: What other modules import from here (Capacity and AccountingError live in edge.admission).
__all__ = ["ACTIONS", "ACT_CONCURRENCY", "AccountingError", "Capacity", "Load", "SandboxManager"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: What act_on does to each sandbox of a task-level operation.
ACTIONS = ("PAUSE", "RESUME", "STOP")
#: Sandboxes one act_on works on at a time (each pause or stop is its own runtime call).
ACT_CONCURRENCY = 8
#: Children one ForkSandbox makes at most (E2B's bound per call is 100; each child is a full
#: sandbox on the source's node).
MAX_FORK_CHILDREN = 64


class SandboxManager:
    def __init__(
        self,
        edge_id: str,
        state_dir: Path,
        capacity: Capacity,
        backends: Iterable[SandboxBackend],
        *,
        terminated_retention_s: float = 3600.0,
        reap_interval_s: float = 1.0,
        disk_guard: DiskGuard | None = None,
        disk_check_interval_s: float = 0.25,
        paused_at_ttl_keep_s: float = 86400.0,
    ) -> None:
        if not EDGE_ID.match(edge_id):
            raise ValueError(
                f'edge id {edge_id!r} must match [a-z0-9]{{1,16}} and not be "queued" (reserved)'
            )
        self.edge_id = edge_id
        #: The records on disk (recovery reads them back).
        self.state_dir = state_dir
        self.store = RecordStore(state_dir / "sandboxes")
        self.backends: dict[str, SandboxBackend] = {}
        for b in backends:
            check_declared(b)
            for kind in b.serves:
                self.backends.setdefault(kind, b)
            b.set_exit_callback(self._on_backend_exit)
        #: Capacity, accounting and the rules of a create.
        self.admission = Admission(edge_id, capacity, self.backends, disk_guard)
        #: Draining, as the operator last set it (kept across restarts: edge/drain.py).
        self._drain_file = DrainFile(state_dir)
        self.drain_state = self._drain_file.load()
        self.admission.draining = self.drain_state.draining
        #: TTL, idle and disk-reserve endings.
        self.reaper = Reaper(
            self,
            terminated_retention_s=terminated_retention_s,
            reap_interval_s=reap_interval_s,
            disk_guard=disk_guard,
            disk_check_interval_s=disk_check_interval_s,
            paused_at_ttl_keep_s=paused_at_ttl_keep_s,
        )
        self.records: dict[str, SandboxRecord] = {}
        self._ready: dict[str, asyncio.Event] = {}
        self._subscribers: set[asyncio.Queue[SandboxRecord]] = set()
        # Subscribers that only care about sandboxes ending (quota release):
        # the hot path of a burst does not copy records for them.
        self._end_subscribers: set[asyncio.Queue[SandboxRecord]] = set()
        self._background: set[asyncio.Task[Any]] = set()
        #: One pause or resume at a time per sandbox (a burst of calls to a paused sandbox
        #: resumes it once).
        self._transitions: dict[str, asyncio.Lock] = {}
        #: Resumes under way: one task each, shared by the callers (see resume()).
        self._resuming: dict[str, asyncio.Task[SandboxRecord]] = {}
        #: Sandboxes being ended: the one teardown each (see end()).
        self._endings: dict[str, asyncio.Task[None]] = {}
        #: Releases that would have taken the accounting below zero (a bug; see
        #: Admission.account).
        self.accounting_errors = 0
        #: Where starts, refusals, endings, pauses and resumes are counted (edge/metrics.py;
        #: set by the composition root, None in tests that build a manager alone).
        self.metrics: EdgeMetrics | None = None

    @property
    def capacity(self) -> Capacity:
        return self.admission.capacity

    @property
    def draining(self) -> bool:
        """A draining edge admits nothing new."""
        return self.admission.draining

    async def set_draining(self, draining: bool, reason: str) -> DrainState:
        """Drains (no new sandbox is admitted; those running go on) or undrains this edge,
        durably: written to the state dir first, so a failed write (OSError) changes nothing.
        Draining again keeps the first drain's time and takes the new reason."""
        old = self.drain_state
        since = (old.since if old.draining else time.time()) if draining else 0.0
        state = DrainState(draining, reason if draining else "", since)
        await asyncio.to_thread(self._drain_file.save, state)
        self.drain_state = state
        self.admission.draining = draining
        log.warning(
            "edge %s %s%s",
            self.edge_id,
            "is DRAINING" if draining else "is no longer draining",
            f": {reason}" if draining and reason else "",
            extra={"edge_id": self.edge_id},
        )
        return state

    # ------------------------------------------------------------- queries

    def load(self) -> Load:
        return self.admission.load()

    def live_counts(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Live sandboxes per project, per principal and per task (see Admission)."""
        return self.admission.live_counts()

    def get(self, sandbox_id: str) -> SandboxRecord:
        rec = self.records.get(sandbox_id)
        if rec is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} not found")
        return rec

    def get_live(self, sandbox_id: str) -> SandboxRecord:
        rec = self.get(sandbox_id)
        if rec.state == TERMINAL:
            raise SandboxTerminated(
                f"sandbox {sandbox_id} has terminated ({rec.termination_reason}: {rec.termination_message})",
                metadata={"termination_reason": rec.termination_reason},
            )
        return rec

    def list(
        self,
        *,
        project_prefix: str = "",
        task_id: str = "",
        labels: dict[str, str] | None = None,
        states: set[str] | None = None,
        include_terminated: bool = True,
    ) -> list[SandboxRecord]:
        out = []
        for rec in self.records.values():
            if project_prefix and not (
                rec.project_id == project_prefix or rec.project_id.startswith(project_prefix + "/")
            ):
                continue
            if task_id and rec.spec.task_id != task_id:
                continue
            if labels and any(rec.spec.labels.get(k) != v for k, v in labels.items()):
                continue
            if states and rec.state not in states:
                continue
            if not include_terminated and not rec.live:
                continue
            out.append(rec)
        out.sort(key=lambda r: r.created_at)
        return out

    def backend_of(self, rec: SandboxRecord) -> SandboxBackend:
        return self.backends[rec.spec.backend]

    # ----------------------------------------------------------- lifecycle

    async def create(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        project_id: str,
        principal_id: str,
        *,
        wait_ready: bool,
    ) -> tuple[SandboxRecord, bool]:
        """Admits and starts a sandbox. Idempotent on ``sandbox_id``."""
        existing = self.records.get(sandbox_id)
        if existing is not None:
            if wait_ready:
                await self._wait_ready(existing)
            return existing, True
        try:
            self.admission.validate(sandbox_id, spec)
            refusal = (await self._blocking_checks([spec]))[id(spec)]
            if refusal is not None:
                raise refusal
        except DSecError as err:
            self._refused(err)
            raise
        if sandbox_id in self.records:  # a concurrent retry got in first
            return await self.create(
                sandbox_id, spec, project_id, principal_id, wait_ready=wait_ready
            )
        try:
            self.admission.admit(spec)
        except DSecError as err:
            self._refused(err)
            raise
        rec = SandboxRecord(sandbox_id, project_id, principal_id, spec, self.edge_id)
        self.records[sandbox_id] = rec
        self.admission.account(rec, +1)
        self._ready[sandbox_id] = asyncio.Event()
        self._changed(rec)
        task = asyncio.create_task(self._start(rec))
        if wait_ready:
            await asyncio.shield(task)
        else:
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return rec, False

    def _refused(self, err: DSecError) -> None:
        if self.metrics is not None:
            self.metrics.refused(err.reason)

    async def create_many(
        self,
        items: builtins.list[tuple[str, SandboxSpec]],
        project_id: str,
        principal_id: str,
        *,
        wait_ready: bool,
    ) -> builtins.list[tuple[SandboxRecord | None, bool, DSecError | None]]:
        """Admits and starts a batch, in order: (record, already existed, error) per item.

        Same rules as :meth:`create`, item by item (so a batch larger than the
        free capacity is admitted up to the capacity), with one backend
        validation per distinct spec. Backends whose ``start`` completes
        without waiting (``starts_inline``, e.g. the null runtime) start the
        whole batch in one task instead of one task per sandbox.
        """
        out: builtins.list[tuple[SandboxRecord | None, bool, DSecError | None]] = []
        fresh: builtins.list[SandboxRecord] = []
        existing: builtins.list[SandboxRecord] = []
        admission = self.admission
        # Per distinct spec: the backend's refusal, then admission's rules of the spec.
        distinct = {id(spec): spec for _, spec in items}
        with step("edge.admission.checks"):
            validated = await self._blocking_checks(distinct.values())
        spec_refusal = {key: _refusal(admission.check_spec, spec) for key, spec in distinct.items()}
        # Nothing below yields: the disk is checked once for the batch, and each item gets
        # its first refusal in the order backend, id, spec, disk, capacity.
        disk_refusal = _refusal(admission.check_disk)
        for sandbox_id, spec in items:
            rec = self.records.get(sandbox_id)
            if rec is not None:
                existing.append(rec)
                out.append((rec, True, None))
                continue
            key = id(spec)
            refusal = (
                validated[key]
                or _refusal(admission.check_id, sandbox_id)
                or spec_refusal[key]
                or disk_refusal
                or _refusal(admission.check_capacity, spec)
            )
            if refusal is not None:
                out.append((None, False, refusal))
                self._refused(refusal)
                continue
            # Each record gets its own spec: a running sandbox's spec can change (its
            # network policy), and must not change its batch-mates'.
            rec = SandboxRecord(sandbox_id, project_id, principal_id, copy.copy(spec), self.edge_id)
            self.records[sandbox_id] = rec
            self.admission.account(rec, +1)
            self._ready[sandbox_id] = asyncio.Event()
            self._changed(rec)
            fresh.append(rec)
            out.append((rec, False, None))
        inline = []
        tasks = []
        for r in fresh:
            if self.backend_of(r).starts_inline:
                inline.append(r)
            else:
                tasks.append(asyncio.create_task(self._start(r)))
        if inline:
            tasks.append(asyncio.create_task(self._start_all(inline)))
        if wait_ready:
            await asyncio.shield(asyncio.gather(*tasks))
            for rec in existing:
                await self._wait_ready(rec)
        else:
            for task in tasks:
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        return out

    async def _blocking_checks(self, specs: Iterable[SandboxSpec]) -> dict[int, DSecError | None]:
        """What a create asks in a thread, in one go: each spec's backend validation (an
        unknown image fails here, fast), as its refusal by ``id(spec)``, and a fresh disk
        sample for admission. One thread per batch: on a busy node a thread's turn waits for
        the GIL, and with two turns per edge call (one each) a 32,768-sandbox burst on 16 null
        edges made 21,000 creations/s where one turn makes 23,000."""
        distinct = {id(spec): spec for spec in specs}

        def run() -> dict[int, DSecError | None]:
            out: dict[int, DSecError | None] = {}
            for key, spec in distinct.items():
                out[key] = None
                backend = self.backends.get(spec.backend)
                if backend is not None:
                    try:
                        backend.validate(spec)
                    except DSecError as exc:
                        out[key] = exc
            self.admission.refresh_disk_sample()
            return out

        return await asyncio.to_thread(run)

    async def _start_all(self, recs: builtins.list[SandboxRecord]) -> None:
        for rec in recs:
            await self._start(rec)

    async def _start(self, rec: SandboxRecord) -> None:
        backend = self.backend_of(rec)
        started = time.monotonic()
        self._set_state(rec, "STARTING")
        try:
            await backend.start(rec)
        except asyncio.CancelledError:
            await self.end(rec, "RUNTIME_ERROR", "creation cancelled")
            raise
        except Exception as exc:
            log.warning(
                "sandbox %s failed to start: %s",
                rec.sandbox_id,
                exc,
                extra={"sandbox_id": rec.sandbox_id},
            )
            await self.end(rec, "RUNTIME_ERROR", f"start failed: {exc}")
            return
        finally:
            ev = self._ready.pop(rec.sandbox_id, None)
            if ev is not None:
                ev.set()
        if rec.state == "STARTING":
            rec.started_at = time.time()
            rec.last_active_at = rec.started_at
            self._set_state(rec, "RUNNING")
            if self.metrics is not None:
                self.metrics.sandbox_started(rec, rec.spec.backend, started)

    async def _wait_ready(self, rec: SandboxRecord) -> None:
        ev = self._ready.get(rec.sandbox_id)
        if ev is not None:
            await ev.wait()

    async def stop(
        self, sandbox_id: str, *, reason: str = "STOPPED", message: str = "", grace_s: float = 2.0
    ) -> SandboxRecord:
        rec = self.get(sandbox_id)
        if rec.state == TERMINAL:
            return rec
        await self._wait_ready(rec)
        return await self.end(rec, reason, message or _default_message(reason), grace_s=grace_s)

    async def delete(self, sandbox_id: str) -> None:
        rec = self.get(sandbox_id)
        if rec.live:
            await self.stop(sandbox_id, reason="STOPPED", message="deleted")
        self.records.pop(sandbox_id, None)
        self.store.forget(sandbox_id)

    def _transition(self, sandbox_id: str) -> asyncio.Lock:
        return self._transitions.setdefault(sandbox_id, asyncio.Lock())

    async def pause(self, sandbox_id: str, *, files_only: bool = False) -> SandboxRecord:
        """Stops everything in the sandbox, keeps its state and gives its memory back where
        the backend can: what it gave back stops counting toward the node's admission.
        ``files_only``: only its files are kept (a cold pause: all of its memory is given
        back; the resume boots it afresh). A paused sandbox stays as it was paused."""
        rec = self.get_live(sandbox_id)
        pausable = require(self.backend_of(rec), Pausable)
        cold = require(self.backend_of(rec), PausesFilesOnly) if files_only else None
        await self._wait_ready(rec)
        async with self._transition(sandbox_id):
            if rec.state == "PAUSED":
                return rec
            if rec.state != "RUNNING":
                self.get_live(sandbox_id)  # ended meanwhile: SandboxTerminated with the reason
                raise FailedPrecondition(
                    f"sandbox {sandbox_id} is {rec.state}, not RUNNING: it cannot be paused",
                    reason="SANDBOX_NOT_RUNNING",
                    metadata={"state": rec.state},
                )
            if cold is not None:
                outcome = await cold.pause_files_only(rec)
            else:
                outcome = await pausable.pause(rec)
            if rec.state != "RUNNING":  # it ended while pausing (stop, TTL, runtime death)
                return rec
            rec.paused_files_only = cold is not None
            self._paused(rec, outcome)
            self._set_state(rec, "PAUSED")
            if self.metrics is not None:
                self.metrics.paused(rec.spec.backend, outcome)
        return rec

    def _paused(self, rec: SandboxRecord, outcome: PauseOutcome) -> None:
        held_mb = math.ceil(outcome.after.resident_bytes / (1 << 20))
        released = 0 if outcome.frozen_only else max(0, rec.spec.memory_mb - held_mb)
        self.admission.give_back(rec, released)
        rec.memory = {
            **_memory_fields(outcome.after),
            "freed_bytes": outcome.freed_bytes,
            "pause_s": round(outcome.seconds, 4),
            "frozen_only": outcome.frozen_only,
        }

    async def resume(self, sandbox_id: str) -> SandboxRecord:
        """Thaws a paused sandbox. The memory its pause gave back must fit the node's
        admission again: if it does not, NodeMemoryFull and the sandbox stays PAUSED.

        The resume runs in a task of its own, shared by every caller that asks meanwhile: a
        caller that gives up (its deadline, a cancelled RPC) cannot stop it half way (a
        thawed container still recorded PAUSED, a restored guest killed and restored again
        by the next call)."""
        rec = self.get_live(sandbox_id)
        require(self.backend_of(rec), Pausable)
        task = self._shared(self._resuming, sandbox_id, lambda: self._resume(rec))
        return await asyncio.shield(task)

    async def _resume(self, rec: SandboxRecord) -> SandboxRecord:
        sandbox_id = rec.sandbox_id
        pausable = require(self.backend_of(rec), Pausable)
        async with self._transition(sandbox_id):
            if rec.state != "PAUSED":
                return rec
            # Taken before the backend call, so concurrent resumes of others see it (if it
            # does not fit: NodeMemoryFull, and the sandbox stays PAUSED).
            need = self.admission.take_back(rec)
            started = time.monotonic()
            try:
                if rec.paused_files_only:
                    await require(self.backend_of(rec), PausesFilesOnly).resume_files_only(rec)
                else:
                    await pausable.resume(rec)
            except ResumeFailed as exc:
                # Its memory or state cannot come back: retrying would fail the same way.
                log.warning("resume of %s failed: %s", sandbox_id, exc)
                if self.metrics is not None:
                    self.metrics.resumed(rec.spec.backend, started, ok=False)
                await self.end(rec, "RESUME_FAILED", str(exc))
                self.get_live(sandbox_id)  # SandboxTerminated, with the reason
                raise  # (not reached)
            except BaseException:
                if rec.state == "PAUSED":  # still ours to account (not ended meanwhile)
                    self.admission.give_back(rec, need)
                raise
            rec.memory = {}
            rec.paused_files_only = False
            rec.last_active_at = time.time()
            if rec.paused_at_ttl:  # back from a pause at its TTL: a fresh TTL
                rec.paused_at_ttl = False
                rec.deadline_at = rec.last_active_at + rec.spec.ttl_s
            self._set_state(rec, "RUNNING")
            if self.metrics is not None:
                self.metrics.resumed(rec.spec.backend, started, ok=True)
        return rec

    async def fork(
        self,
        sandbox_id: str,
        child_ids: builtins.list[str],
        principal_id: str,
        *,
        labels: dict[str, str],
        task_id: str,
        ttl_s: int,
        require_memory: bool,
    ) -> tuple[ForkKind, float, builtins.list[tuple[SandboxRecord, DSecError | None]]]:
        """Copies of a running or paused sandbox at one instant: all children admitted or
        none (EdgeCapacity, metadata "fits": how many would), then the backend captures the
        source once and starts every child from it. Returns the fork's kind, how long the
        source stood still, and per child its record and why it does not run (None: it
        does). The source's transition lock is held throughout: no pause or resume of it
        meanwhile, and it stays as it was."""
        n = len(child_ids)
        if not 1 <= n <= MAX_FORK_CHILDREN or len(set(child_ids)) != n:
            raise InvalidArgument(
                f"count must be 1..{MAX_FORK_CHILDREN} distinct children, got {n}",
                reason="FORK_COUNT",
                metadata={"field": "count", "max": str(MAX_FORK_CHILDREN)},
            )
        source = self.get_live(sandbox_id)
        forks = require(self.backend_of(source), Forks)
        if require_memory and forks.fork_kind is not ForkKind.MEMORY:
            raise FailedPrecondition(
                f"the {source.spec.backend} backend forks files only (not processes or "
                "memory), and require_memory was set",
                reason="FORK_MEMORY_UNAVAILABLE",
                metadata={"backend": source.spec.backend, "fork_kind": forks.fork_kind.value},
            )
        await self._wait_ready(source)
        # In a task of its own: a caller that goes away cannot leave children half made.
        task = asyncio.create_task(
            self._fork(source, forks, child_ids, principal_id, labels, task_id, ttl_s)
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        kind, stall_s, out = await asyncio.shield(task)
        return kind, stall_s, out

    async def _fork(
        self,
        source: SandboxRecord,
        forks: Forks,
        child_ids: builtins.list[str],
        principal_id: str,
        labels: dict[str, str],
        task_id: str,
        ttl_s: int,
    ) -> tuple[ForkKind, float, builtins.list[tuple[SandboxRecord, DSecError | None]]]:
        sandbox_id = source.sandbox_id
        async with self._transition(sandbox_id):
            if source.state not in ("RUNNING", "PAUSED"):
                self.get_live(sandbox_id)  # ended meanwhile: SandboxTerminated, with why
                raise FailedPrecondition(
                    f"sandbox {sandbox_id} is {source.state}: only a RUNNING or PAUSED "
                    "sandbox can be forked",
                    reason="SANDBOX_NOT_RUNNING",
                    metadata={"state": source.state},
                )
            if source.paused_files_only:
                raise FailedPrecondition(
                    f"sandbox {sandbox_id} is paused with its files only: resume it first",
                    reason="SANDBOX_PAUSED_FILES_ONLY",
                )
            spec = copy.copy(source.spec)
            spec.labels = {**source.spec.labels, **labels}
            spec.task_id = task_id or source.spec.task_id
            spec.ttl_s = ttl_s or source.spec.ttl_s
            children = await self._admit_children(source, child_ids, principal_id, spec)
            errors: builtins.list[Exception | None]
            try:
                outcome = await forks.fork(source, children)
                errors, stall_s = outcome.errors, outcome.stall_s
            except Exception as exc:
                errors, stall_s = [exc] * len(children), 0.0
        out: builtins.list[tuple[SandboxRecord, DSecError | None]] = []
        for child, err in zip(children, errors, strict=True):
            self._ready.pop(child.sandbox_id).set()
            if err is None and child.state == "STARTING":
                child.started_at = time.time()
                child.last_active_at = child.started_at
                self._set_state(child, "RUNNING")
                out.append((child, None))
                continue
            if err is None:  # stopped while it started: ends as its stop said
                await self.end(child, "RUNTIME_ERROR", "ended while its fork started")
                out.append((child, self._ended_error(child)))
                continue
            why = getattr(err, "message", None) or str(err) or type(err).__name__
            log.warning("fork child %s of %s failed: %s", child.sandbox_id, sandbox_id, why)
            await self.end(child, "RUNTIME_ERROR", f"fork failed: {why}")
            failure = err if isinstance(err, DSecError) else Internal(f"fork failed: {why}")
            out.append((child, failure))
        return forks.fork_kind, stall_s, out

    @staticmethod
    def _ended_error(rec: SandboxRecord) -> SandboxTerminated:
        return SandboxTerminated(
            f"sandbox {rec.sandbox_id} has terminated "
            f"({rec.termination_reason}: {rec.termination_message})",
            metadata={"termination_reason": rec.termination_reason},
        )

    async def _admit_children(
        self,
        source: SandboxRecord,
        child_ids: builtins.list[str],
        principal_id: str,
        spec: SandboxSpec,
    ) -> builtins.list[SandboxRecord]:
        """Records for every child, STARTING and accounted, or none (EdgeCapacity)."""
        await self.admission.fresh_disk_sample()
        children: builtins.list[SandboxRecord] = []
        try:
            for cid in child_ids:
                if cid in self.records:
                    raise InvalidArgument(f"sandbox {cid} exists already", reason="FORK_CHILD_ID")
                self.admission.validate(cid, spec)
                self.admission.admit(spec)
                child = SandboxRecord(
                    cid, source.project_id, principal_id, copy.copy(spec), self.edge_id
                )
                child.forked_from = source.sandbox_id
                self.records[cid] = child
                self.admission.account(child, +1)
                children.append(child)
        except EdgeCapacity as exc:
            self._unadmit(children)
            raise type(exc)(
                f"the source's node fits {len(children)} of {len(child_ids)} children: "
                f"{exc.message}",
                reason=exc.reason,
                metadata={**exc.metadata, "fits": str(len(children))},
            ) from exc
        except BaseException:
            self._unadmit(children)
            raise
        for child in children:
            self._ready[child.sandbox_id] = asyncio.Event()
            self._set_state(child, "STARTING")
        return children

    def _unadmit(self, children: builtins.list[SandboxRecord]) -> None:
        for child in children:
            self.admission.account(child, -1)
            self.records.pop(child.sandbox_id, None)

    async def measure_memory(self, rec: SandboxRecord) -> None:
        """Refresh rec.memory from the backend (GetSandbox): resident and swapped now."""
        backend = self.backend_of(rec)
        if rec.state not in ("RUNNING", "PAUSED") or not offers(backend, Pausable):
            return
        usage = await require(backend, Pausable).memory_usage(rec)
        if usage is not None:
            rec.memory = {**rec.memory, **_memory_fields(usage)}

    def quiesced(self, sandbox_id: str) -> bool:
        """Paused, or being paused or resumed: nothing in the sandbox runs now (its streams'
        silence is the edge's to cover: edge/pause_streams.py)."""
        rec = self.records.get(sandbox_id)
        if rec is None or not rec.live:
            return False
        lock = self._transitions.get(sandbox_id)
        return rec.state == "PAUSED" or (lock is not None and lock.locked())

    def paused_status(self) -> tuple[int, int, int]:
        """(paused sandboxes, MiB their pauses gave back to the node's admission, bytes of them
        in swap or saved on disk as last measured)."""
        paused = [r for r in self.records.values() if r.state == "PAUSED"]
        swapped = sum(int(r.memory.get("swapped_bytes", 0)) for r in paused)
        return len(paused), sum(r.released_mb for r in paused), swapped

    async def touch(self, sandbox_id: str) -> SandboxRecord:
        """Marks activity (idle timer) before a call into the sandbox; resumes a paused one,
        unless it asked to be resumed only explicitly (spec.manual_resume): then
        FAILED_PRECONDITION SANDBOX_PAUSED."""
        rec = self.get_live(sandbox_id)
        await self._wait_ready(rec)
        if rec.state == "PAUSED" and rec.spec.manual_resume:
            raise FailedPrecondition(
                f"sandbox {sandbox_id} is paused and resumes only when asked to "
                "(manual_resume): resume it first",
                reason="SANDBOX_PAUSED",
                metadata={"state": "PAUSED"},
            )
        if rec.state == "PAUSED":
            await self.resume(sandbox_id)
        if rec.state != "RUNNING":
            if rec.state == TERMINAL:
                self.get_live(sandbox_id)  # raises SandboxTerminated with the reason
            raise Unavailable(f"sandbox {sandbox_id} is {rec.state}", reason="SANDBOX_NOT_READY")
        rec.last_active_at = time.time()
        return rec

    async def set_timeout(self, sandbox_id: str, timeout_s: float) -> SandboxRecord:
        """The sandbox ends (TTL) ``timeout_s`` seconds from now, whatever its ttl_s said; the
        new deadline is on the record (persisted: it survives an edge restart)."""
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise InvalidArgument(
                f"timeout_s={timeout_s} must be a positive number of seconds",
                reason="INVALID_TTL",
                metadata={"field": "timeout_s"},
            )
        rec = self.get_live(sandbox_id)  # ended: SandboxTerminated (FAILED_PRECONDITION)
        if rec.state == "STOPPING":
            raise FailedPrecondition(
                f"sandbox {sandbox_id} is STOPPING: its lifetime cannot change",
                reason="SANDBOX_NOT_RUNNING",
                metadata={"state": rec.state},
            )
        rec.deadline_at = time.time() + timeout_s
        self._changed(rec)
        return rec

    # ----------------------------------------------------------- containment

    async def update_network_policy(self, sandbox_id: str, policy: dict[str, Any]) -> SandboxRecord:
        """Replaces a live sandbox's egress policy (the next connection sees it)."""
        rec = self.get_live(sandbox_id)  # an ended sandbox: SandboxTerminated (FAILED_PRECONDITION)
        await self._wait_ready(rec)
        if rec.state not in ("RUNNING", "PAUSED"):
            self.get_live(sandbox_id)
            raise FailedPrecondition(
                f"sandbox {sandbox_id} is {rec.state}: its network policy cannot change now",
                reason="SANDBOX_NOT_RUNNING",
            )
        await require(self.backend_of(rec), NetworkPolicies).update_network_policy(rec, policy)
        self._changed(rec)
        return rec

    def note_violation(self, sandbox_id: str, counter: str, n: int = 1) -> None:
        """Count contained misbehaviour (ViolationCounters field `counter`) of a sandbox."""
        rec = self.records.get(sandbox_id)
        if rec is not None:
            rec.violations = {**rec.violations, counter: rec.violations.get(counter, 0) + n}

    def usage_samples(self, sandbox_id: str, start: float, end: float) -> UsageSamples:
        """The sandbox's resource-use samples taken in [start, end] (Unix time)."""
        rec = self.get_live(sandbox_id)
        return require(self.backend_of(rec), UsageMetrics).usage_samples(rec, start, end)

    async def modified_files(self, sandbox_id: str) -> builtins.list[tuple[str, bool]]:
        """(path, deleted) of every file of the read-only layers the sandbox changed."""
        rec = self.get_live(sandbox_id)
        await self._wait_ready(rec)
        return await require(self.backend_of(rec), ModifiedFiles).modified_files(rec)

    async def end(
        self, rec: SandboxRecord, reason: str, message: str, *, grace_s: float | None = None
    ) -> SandboxRecord:
        """The one way a sandbox ends, whatever ends it (a stop, a task stop, TTL, idle, a
        containment reason, a lost channel, a failed start or resume, the edge's shutdown,
        a lost edge's return). The first call wins: its reason is the sandbox's, and its
        teardown (a graceful stop when ``grace_s`` is given, then destroy, then the release
        of what the sandbox held) runs once, in a task of its own, so a caller that goes
        away (a cancelled RPC) cannot leave it half done. Every later call waits for that
        teardown and returns the same record."""
        if rec.sandbox_id not in self._endings:
            if rec.state == TERMINAL:
                return rec
            rec.termination_reason = reason
            rec.termination_message = message
        elif reason != rec.termination_reason:
            log.debug(
                "sandbox %s is already ending (%s); %s comes too late",
                rec.sandbox_id,
                rec.termination_reason,
                reason,
            )
        ending = self._shared(self._endings, rec.sandbox_id, lambda: self._teardown(rec, grace_s))
        await asyncio.shield(ending)
        return rec

    async def _teardown(self, rec: SandboxRecord, grace_s: float | None) -> None:
        sid = rec.sandbox_id
        self._set_state(rec, "STOPPING")
        backend = self.backend_of(rec)
        if grace_s is not None:
            try:
                await backend.stop(rec, grace_s)
            except Exception as exc:
                log.warning("stop of %s failed: %s", sid, exc)
        try:
            await backend.destroy(rec)
        except Exception as exc:
            log.error("destroy of %s failed (will retry at orphan cleanup): %s", sid, exc)
        rec.terminated_at = time.time()
        try:
            self.admission.account(rec, -1)
        except AccountingError as exc:
            self.accounting_errors += 1
            log.error("%s", exc, extra={"sandbox_id": sid})
        rec.released_mb = 0
        self._transitions.pop(sid, None)
        self._set_state(rec, TERMINAL)
        if self.metrics is not None:
            self.metrics.ended(rec, rec.spec.backend)
        log.info(
            "sandbox %s terminated: %s %s",
            sid,
            rec.termination_reason,
            rec.termination_message,
            extra={"sandbox_id": sid, "reason": rec.termination_reason},
        )

    def _shared(
        self,
        table: dict[str, asyncio.Task[T]],
        sandbox_id: str,
        make: Callable[[], Coroutine[Any, Any, T]],
    ) -> asyncio.Task[T]:
        """The task under way for ``sandbox_id`` in ``table`` (its resume, its ending), or a new
        one of ``make()``: one per sandbox, awaited (shielded) by every caller, so a caller that
        goes away cannot cut it short. It leaves the table when done; its exception is
        retrieved here (every caller may have gone)."""
        task = table.get(sandbox_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(make(), name=sandbox_id)
            table[sandbox_id] = task

            def done(t: asyncio.Task[T]) -> None:
                if table.get(sandbox_id) is t:
                    del table[sandbox_id]
                if not t.cancelled():
                    t.exception()

            task.add_done_callback(done)
        return task

    async def _on_backend_exit(self, sandbox_id: str, reason: str, message: str) -> None:
        rec = self.records.get(sandbox_id)
        if rec is None:
            return
        await self.end(rec, reason, message)

    # ------------------------------------------- TTL, idle, disk reserve (edge.reaper)

    async def reap_once(self, now: float | None = None) -> builtins.list[str]:
        """Stops sandboxes past TTL or idle timeout; forgets old terminated records."""
        return await self.reaper.reap_once(now)

    async def reap_loop(self) -> None:
        await self.reaper.reap_loop()

    async def disk_guard_once(self) -> str | None:
        """One pass of the free-space reserve: returns the sandbox it ended, if any."""
        return await self.reaper.disk_guard_once()

    async def disk_guard_loop(self) -> None:
        await self.reaper.disk_guard_loop()

    # ------------------------------------------------------------ recovery

    async def recover(self) -> None:
        """After a restart: re-adopt live sandboxes from disk, clean up orphans."""
        keep: set[str] = set()
        for rec in self.store.read_all():
            backend = self.backends.get(rec.spec.backend)
            if backend is None:
                continue
            self.records[rec.sandbox_id] = rec
            if rec.live and rec.state == "STOPPING" and rec.termination_reason:
                # The previous edge was ending it: the teardown is finished, with that reason
                # (the first reason wins, across a restart too).
                self.admission.account(rec, +1)
                await self.end(rec, rec.termination_reason, rec.termination_message)
            elif rec.live:
                self.admission.account(rec, +1)
                adopted = False
                try:
                    adopted = await backend.adopt(rec)
                except Exception as exc:
                    log.warning("adopting %s failed: %s", rec.sandbox_id, exc)
                if adopted:
                    keep.add(rec.sandbox_id)
                    if rec.state in ("PENDING", "STARTING", "STOPPING"):
                        self._set_state(rec, "RUNNING")
                    log.info(
                        "re-adopted sandbox %s",
                        rec.sandbox_id,
                        extra={"sandbox_id": rec.sandbox_id},
                    )
                else:
                    await self.end(rec, "RUNTIME_ERROR", "lost while the edge was down")
        for backend in {id(b): b for b in self.backends.values()}.values():
            removed = await backend.cleanup_orphans(keep)
            if removed:
                log.info("cleaned up %d orphans: %s", len(removed), ", ".join(removed[:20]))

    # ------------------------------------------------------ state & events

    def _set_state(self, rec: SandboxRecord, state: str) -> None:
        rec.state = state
        self._changed(rec)

    def changed(self, rec: SandboxRecord) -> None:
        """A record changed outside a state change (persisted, watchers told)."""
        self._changed(rec)

    def _changed(self, rec: SandboxRecord) -> None:
        # STARTING is not written: recovery treats it as PENDING (no runtime state yet either
        # way), and each write is a new inode (tmp + rename) in the event loop's thread.
        if self.backend_of(rec).persistent and rec.state != "STARTING":
            with step("edge.store.write"):
                self.store.write(rec)
        subscribers = self._subscribers
        if rec.state == TERMINAL and self._end_subscribers:
            subscribers = subscribers | self._end_subscribers
        if not subscribers:
            return
        snapshot = copy.copy(rec)  # subscribers see the state as of this change
        for q in list(subscribers):
            try:
                q.put_nowait(snapshot)
            except asyncio.QueueFull:
                # A subscriber that cannot keep up is dropped, not waited on.
                self._subscribers.discard(q)
                self._end_subscribers.discard(q)

    def subscribe(
        self, maxsize: int = 10_000, *, terminal_only: bool = False
    ) -> asyncio.Queue[SandboxRecord]:
        """A queue of record snapshots, one per state change (or only per sandbox end)."""
        q: asyncio.Queue[SandboxRecord] = asyncio.Queue(maxsize=maxsize)
        (self._end_subscribers if terminal_only else self._subscribers).add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[SandboxRecord]) -> None:
        self._subscribers.discard(q)
        self._end_subscribers.discard(q)

    def live_ids(self) -> builtins.list[str]:
        return [r.sandbox_id for r in self.records.values() if r.state in LIVE_STATES]

    async def stop_all(self, message: str) -> int:
        """Stops every live sandbox (edge shutdown with on_shutdown=stop)."""
        live = [r.sandbox_id for r in self.records.values() if r.live]
        await asyncio.gather(
            *(self.stop(sid, message=message, grace_s=0.2) for sid in live), return_exceptions=True
        )
        return len(live)

    # ------------------------------------------------------- task-level operations

    async def act_on(
        self,
        action: str,
        *,
        project_prefix: str = "",
        task_id: str = "",
        labels: dict[str, str] | None = None,
        reason: str = "STOPPED",
        message: str = "",
        grace_s: float = 2.0,
        skip_terminated: bool = False,
        concurrency: int = ACT_CONCURRENCY,
    ) -> builtins.list[tuple[str, SandboxRecord | None, DSecError | None]]:
        """Pauses, resumes or stops (``action``: PAUSE, RESUME, STOP) every sandbox matching
        the selector, this edge's share of a task-level operation, through :meth:`pause`,
        :meth:`resume` and :meth:`stop` (``reason``, ``message``, ``grace_s``), at most
        ``concurrency`` at a time. Per sandbox, in creation order: (id, a snapshot of the
        record as the action left it, None), or (id, None, its error, with the sandbox's
        ``state`` in the metadata): one sandbox failing stops none of the others. The
        sandboxes are those matching when the call starts (terminated ones too, unless
        ``skip_terminated``); an empty selector (no task id, no labels) is refused."""
        if action not in ACTIONS:
            raise InvalidArgument(f"unknown action {action!r}: one of {', '.join(ACTIONS)}")
        if not task_id and not labels:
            raise InvalidArgument("give a task_id and/or labels (refusing to act on every sandbox)")
        recs = self.list(
            project_prefix=project_prefix,
            task_id=task_id,
            labels=labels,
            include_terminated=not skip_terminated,
        )
        sem = asyncio.Semaphore(max(1, concurrency))

        async def act(rec: SandboxRecord) -> tuple[str, SandboxRecord | None, DSecError | None]:
            sid = rec.sandbox_id
            async with sem:
                try:
                    if action == "PAUSE":
                        done = await self.pause(sid)
                    elif action == "RESUME":
                        done = await self.resume(sid)
                    else:
                        done = await self.stop(sid, reason=reason, message=message, grace_s=grace_s)
                except DSecError as exc:
                    exc.metadata.setdefault("state", rec.state)
                    return sid, None, exc
                except Exception:
                    # One sandbox's bug must not fail its task-mates' results.
                    log.exception("%s of %s failed", action.lower(), sid, extra={"sandbox_id": sid})
                    return (
                        sid,
                        None,
                        Internal(f"{action.lower()} of {sid} failed (see the edge log)"),
                    )
                return sid, copy.copy(done), None

        return list(await asyncio.gather(*(act(r) for r in recs)))

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        # Resumes and teardowns under way finish: half done, they leave a sandbox in a state
        # its record does not say (a thawed container recorded PAUSED, an orphan).
        pending = [*self._resuming.values(), *self._endings.values()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


def _memory_fields(usage: MemoryUsage) -> dict[str, Any]:
    return {
        "resident_bytes": usage.resident_bytes,
        "swapped_bytes": usage.swapped_bytes,
        "at": time.time(),
    }


def _default_message(reason: str) -> str:
    return {
        "STOPPED": "stopped by request",
        "TTL": "maximum lifetime reached",
        "IDLE": "idle timeout reached",
        "PREEMPTED": "preempted: its job was preempted",
    }.get(reason, reason.lower())


def _refusal(check: Callable[..., None], *args: Any) -> DSecError | None:
    """The error ``check(*args)`` raises, or None if it passes."""
    try:
        check(*args)
    except DSecError as exc:
        return exc
    return None
