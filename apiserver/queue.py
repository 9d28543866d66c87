"""The create queue: creates that wait their turn (``CreateSandboxRequest.wait_s``).

A create with ``wait_s`` that cannot be placed now (no edge has room, an edge refused for
capacity, or the project is at its quota) is not refused: it becomes an entry of the queue,
``sb-queued-<random>``, and is placed as soon as room appears (a stop, a pause that gives
memory back, a TTL expiry, a new edge), or ends with ``QUEUE_TIMEOUT`` at its deadline. A
create no edge could ever hold (``ExceedsEveryEdge``, ``BackendNotOffered``) or that is
invalid is refused at once, as without ``wait_s``.

Where the queue lives: in IAM's store, with the quotas (SQLite or PostgreSQL), so it survives
API server restarts; quota is reserved only when an entry is placed.

Who serves it: the API server holding IAM's lease ``create-queue`` (renewed every round; it
lapses :data:`LEASE_TTL_S` after its holder stops renewing, and another API server takes
over). Its dispatcher, every :data:`ROUND_S` (at once when a create joins the queue here):

1. ends the entries past their deadline (``QUEUE_TIMEOUT``, naming the last refusal);
2. orders the others in fair share (:class:`FairShare`) and sends the first
   :data:`MAX_ROUND` through the creation pipeline, each entry its own placement group, so
   placement serves them in that order until room runs out;
3. records each outcome: placed (the sandbox id), still waiting (the new refusal) or
   refused for good (the error).

Exactly once: each entry's create carries an idempotency key (the caller's, or
``queue:<queue id>``), so a dispatcher that dies between placing an entry and recording it,
and its successor placing it again, get the same sandbox; a client that retries its create
with its key (the SDK always sends one) finds the entry its first attempt queued.

Waiting: the API server that queued a create waits for its entry (one ``GetQueued`` call
per :data:`POLL_S` for all of its waiting calls). A caller that disconnects loses nothing:
the entry stays, is placed in its turn, and a retry with the same key gets its sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from apiserver.creation import CREATE_DEADLINE_S, Caller, CreateItem, CreationPipeline
from apiserver.routing import downstream, not_found, within
from common.channels import DEFAULT_DEADLINE_S
from common.convert import ts
from common.ids import new_queue_id
from common.metrics import LATENCY_BUCKETS_S, Metrics
from dsec.apiserver.v1 import apiserver_pb2
from dsec.iam.v1 import iam_pb2, iam_pb2_grpc
from dsec.types.v1 import types_pb2
from libdsec.errors import (
    Cancelled,
    DSecError,
    EdgeCapacity,
    InvalidArgument,
    NoEligibleEdge,
    QueueTimeout,
    QuotaExceeded,
    item_error,
    item_status,
)

log = logging.getLogger(__name__)

#: The longest a create may wait in the queue.
MAX_WAIT_S = 86_400.0
#: Priorities of queued creates (inside a project).
MAX_PRIORITY = 1000
#: The dispatcher's round: how soon freed room is used (placement also learns of freed
#: room from the edges' probes, within a second).
ROUND_S = 0.2
#: Entries sent through the pipeline per round.
MAX_ROUND = 256
#: How often a waiting call's API server asks IAM about its entries.
POLL_S = 0.1
LEASE = "create-queue"
LEASE_TTL_S = 3.0
#: A waiting call whose entry no dispatcher ended this long after its deadline ends it.
DEADLINE_SLACK_S = 5.0

WAITING = iam_pb2.QUEUE_STATE_WAITING
PLACED = iam_pb2.QUEUE_STATE_PLACED
TIMED_OUT = iam_pb2.QUEUE_STATE_TIMED_OUT
CANCELLED = iam_pb2.QUEUE_STATE_CANCELLED
FAILED = iam_pb2.QUEUE_STATE_FAILED


def checked_wait_s(value: float) -> float:
    """``wait_s`` of a create, validated (0 = no queue)."""
    if not (0 <= value <= MAX_WAIT_S):  # NaN fails too
        raise InvalidArgument(
            f"wait_s={value} must be in 0..{MAX_WAIT_S:g} (0 = refuse at once when full)",
            reason="INVALID_WAIT",
        )
    return float(value)


def checked_priority(value: int) -> int:
    if not -MAX_PRIORITY <= value <= MAX_PRIORITY:
        raise InvalidArgument(
            f"priority={value} must be in {-MAX_PRIORITY}..{MAX_PRIORITY}",
            reason="INVALID_PRIORITY",
        )
    return value


def queueable(err: DSecError | None) -> bool:
    """Whether a create refused with ``err`` may wait for room: the cluster or the project
    is full now. Never: invalid input, a backend nobody offers, more than any edge holds."""
    return isinstance(err, NoEligibleEdge | EdgeCapacity | QuotaExceeded)


def in_progress(err: DSecError | None) -> bool:
    """Whether an entry's key is bound to a sandbox still being created elsewhere: a client's
    retry through another API server, or a dispatcher that died after reserving it (its
    reservation is released by reconciliation). The entry keeps waiting and asks again."""
    return err is not None and err.reason == "CREATE_IN_PROGRESS"


# ------------------------------------------------------------------ fair share


def weight(share_weight: Mapping[str, float] | None, project_id: str) -> float:
    """A project's weight in the fair share (IAM's answer; missing or 0 = 1)."""
    return (share_weight or {}).get(project_id) or 1.0


class FairShare:
    """The order in which waiting entries are served: weighted fair share of the cluster across
    projects and, inside a project, fair share of placements across its tasks.

    Projects: the next entry served is the head of the project whose share in use is the
    smallest: (sandboxes it holds now, as IAM counts them, + those picked ahead of it in this
    order) / its weight; ties go to the project whose oldest entry arrived first. A project
    that holds many sandboxes already (a burst that took the free room before others came)
    therefore waits until the others have caught up, and idle time earns nothing.

    Inside that project: the task whose head has the highest ``priority`` goes first, then the
    task with the fewest placements from the queue so far, then arrival order; a task that
    starts waiting again starts level with the project's waiting tasks. The order is a function
    of the arrival order (``seq``), what each project holds, and what the queue placed:
    deterministic.
    """

    def __init__(self) -> None:
        self.task_vt: dict[tuple[str, str], float] = {}
        self._active_tasks: set[tuple[str, str]] = set()

    def _join(self, tasks: set[tuple[str, str]]) -> None:
        """Tasks that start waiting start at the floor of their project's waiting tasks."""
        for p in {t[0] for t in tasks}:
            mine = {t for t in tasks if t[0] == p}
            known = [self.task_vt[t] for t in mine & self._active_tasks if t in self.task_vt]
            floor = min(known, default=0.0)
            for t in mine - self._active_tasks:
                self.task_vt[t] = max(self.task_vt.get(t, 0.0), floor)
        self._active_tasks = tasks

    def order(
        self,
        entries: Iterable[iam_pb2.QueueEntry],
        limit: int,
        in_use: Mapping[str, int] | None = None,
        share_weight: Mapping[str, float] | None = None,
        *,
        join: bool = True,
    ) -> list[iam_pb2.QueueEntry]:
        """The first ``limit`` entries in serving order; ``in_use``: the sandboxes each
        project holds now, ``share_weight``: each one's weight (missing or 0 = 1; ``join`` =
        False: a look that changes no state, e.g. positions)."""
        queues: dict[str, dict[str, list[iam_pb2.QueueEntry]]] = {}
        for e in entries:
            queues.setdefault(e.project_id, {}).setdefault(e.task_id, []).append(e)
        weights = {p: weight(share_weight, p) for p in queues}
        for tasks in queues.values():
            for q in tasks.values():
                q.sort(key=lambda e: (-e.priority, e.seq))
                q.reverse()  # pop() from the end = the head
        task_keys = {(p, t) for p, tasks in queues.items() for t in tasks}
        if join:
            self._join(task_keys)
        held = in_use or {}
        share = {p: held.get(p, 0) / weights[p] for p in queues}
        tvt = {t: self.task_vt.get(t, 0.0) for t in task_keys}
        out: list[iam_pb2.QueueEntry] = []
        while queues and len(out) < limit:
            p = min(queues, key=lambda p: (share[p], min(q[-1].seq for q in queues[p].values())))
            tasks = queues[p]
            t = min(tasks, key=lambda t: (-tasks[t][-1].priority, tvt[(p, t)], tasks[t][-1].seq))
            out.append(tasks[t].pop())
            share[p] += 1.0 / weights[p]
            tvt[(p, t)] += 1.0
            if not tasks[t]:
                del tasks[t]
                if not tasks:
                    del queues[p]
        return out

    def placed(self, entries: Iterable[iam_pb2.QueueEntry]) -> None:
        for e in entries:
            key = (e.project_id, e.task_id)
            self.task_vt[key] = self.task_vt.get(key, 0.0) + 1.0


_Pair = tuple[iam_pb2.QueueEntry, apiserver_pb2.CreateSandboxRequest]


def _request(e: iam_pb2.QueueEntry) -> apiserver_pb2.CreateSandboxRequest:
    return apiserver_pb2.CreateSandboxRequest.FromString(e.request)


def _first_run(batch: list[_Pair]) -> list[_Pair]:
    """The leading entries of one project and principal (one edge call)."""
    head = batch[0][0]
    n = 1
    while n < len(batch) and (batch[n][0].project_id, batch[n][0].principal_id) == (
        head.project_id,
        head.principal_id,
    ):
        n += 1
    return batch[:n]


def _shape(spec: types_pb2.SandboxSpec) -> tuple[int, str]:
    return spec.backend, repr(sorted(spec.node_selector.items()))


class _Blocked:
    """What entries of this round could not get: room for a shape (per backend and node
    selector, the smallest cpu/memory refused), or a project's quota."""

    def __init__(self) -> None:
        self.shapes: dict[tuple[int, str], list[tuple[int, int, int]]] = {}
        self.projects: set[str] = set()

    def add(self, e: iam_pb2.QueueEntry, req: apiserver_pb2.CreateSandboxRequest, err: Any) -> None:
        if isinstance(err, QuotaExceeded):
            self.projects.add(e.project_id)
            return
        r = req.spec.resources
        self.shapes.setdefault(_shape(req.spec), []).append(
            (r.cpu_millis, r.memory_mb, r.gpu_count)
        )

    def holds(self, e: iam_pb2.QueueEntry, req: apiserver_pb2.CreateSandboxRequest) -> bool:
        if e.project_id in self.projects:
            return True
        r = req.spec.resources
        return any(
            r.cpu_millis >= c and r.memory_mb >= m and r.gpu_count >= g
            for c, m, g in self.shapes.get(_shape(req.spec), [])
        )


# ---------------------------------------------------------------------- views


def pending_view(e: iam_pb2.QueueEntry, position: int = 0) -> types_pb2.Sandbox:
    """A queue entry as a sandbox: PENDING while it waits, TERMINATED once it ended without
    a sandbox (timed out, cancelled, failed)."""
    req = apiserver_pb2.CreateSandboxRequest.FromString(e.request)
    sb = types_pb2.Sandbox(
        id=e.queue_id,
        project_id=e.project_id,
        spec=req.spec,
        state=types_pb2.SANDBOX_STATE_PENDING,
        principal_id=e.principal_id,
        created_at=ts(e.enqueued_at),
    )
    fill_status(sb.queue, e, position)
    if e.state in (TIMED_OUT, CANCELLED, FAILED):
        sb.state = types_pb2.SANDBOX_STATE_TERMINATED
        sb.termination.reason = {
            TIMED_OUT: types_pb2.TERMINATION_REASON_QUEUE_TIMEOUT,
            CANCELLED: types_pb2.TERMINATION_REASON_STOPPED,
        }.get(e.state, types_pb2.TERMINATION_REASON_RUNTIME_ERROR)
        sb.termination.message = e.reason or e.error.message
        sb.termination.at.FromNanoseconds(int(e.ended_at * 1e9))
    return sb


def fill_status(out: types_pb2.QueueStatus, e: iam_pb2.QueueEntry, position: int) -> None:
    out.queue_id = e.queue_id
    out.position = position
    out.reason = e.reason
    out.enqueued_at.FromNanoseconds(int(e.enqueued_at * 1e9))
    out.deadline.FromNanoseconds(int(e.deadline * 1e9))
    out.placed_sandbox_id = e.placed_sandbox_id
    out.priority = e.priority


@dataclass
class _Waiter:
    future: asyncio.Future[iam_pb2.QueueEntry]
    deadline: float


class CreateQueue:
    """This API server's part of the queue: its waiting calls, and the dispatcher when it
    holds the lease."""

    def __init__(
        self,
        iam: iam_pb2_grpc.IamServiceStub,
        pipeline: CreationPipeline,
        get: Callable[[Caller, str], Awaitable[types_pb2.Sandbox]],
        instance: str,
        metrics: Metrics | None = None,
    ) -> None:
        #: How long each queued create of this server waited, by how it ended (IAM's
        #: dsec_queue_waiting counts the ones waiting now, by project).
        self.waits = (
            metrics.meter.create_histogram(
                "dsec_queue_wait_seconds",
                unit="s",
                description="Time queued creates waited, by outcome (placed, timed_out, ...)",
                explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
            )
            if metrics is not None
            else None
        )
        self.iam = iam
        self.pipeline = pipeline
        self.get_sandbox = get
        self.holder = f"{instance or 'apiserver'}/{os.getpid()}/{secrets.token_hex(3)}"
        self.fair = FairShare()
        self.dispatching = False
        self.dispatcher = ""  # the holder of the lease, as last seen
        self.waiting = 0  # entries waiting at the last round (dispatcher only)
        self._waiters: dict[str, list[_Waiter]] = {}
        self._wake = asyncio.Event()
        self._poll_wake = asyncio.Event()

    async def run(self) -> None:
        """The dispatcher (when this server holds the lease) and the waiting calls' poller."""
        await asyncio.gather(self._dispatch_loop(), self._poll_loop())

    @property
    def backlogged(self) -> bool:
        """Whether creates are known to be waiting: a new create then joins the queue rather
        than taking room ahead of them."""
        return bool(self._waiters) or self.waiting > 0

    # ------------------------------------------------------------- enqueue

    async def wait_for_room(
        self,
        items: list[CreateItem],
        requests: list[Any],
        refusals: list[DSecError | None],
    ) -> None:
        """Queues ``items`` (each refused with its ``refusals`` entry, None = queued without
        trying) and waits until each is placed or ends; sets each item's result or error."""
        now = time.time()
        entries = []
        for it, req, why in zip(items, requests, refusals, strict=True):
            qid = new_queue_id()
            body = apiserver_pb2.CreateSandboxRequest(
                spec=it.spec, idempotency_key=it.key or f"queue:{qid}", wait_ready=False
            )
            entries.append(
                iam_pb2.QueueEntry(
                    queue_id=qid,
                    project_id=it.who.project_id,
                    principal_id=it.who.principal_id,
                    task_id=it.spec.task_id,
                    priority=req.priority,
                    deadline=now + req.wait_s,
                    idempotency_key=it.key,
                    request=body.SerializeToString(),
                    reason=why.message if why is not None else "waiting for its turn",
                )
            )
        resp = await downstream(
            self.iam.Enqueue(iam_pb2.EnqueueRequest(entries=entries), timeout=DEFAULT_DEADLINE_S),
            "iam",
        )
        self._wake.set()
        outcomes = await asyncio.gather(*(self._wait(e) for e in resp.entries))
        ended = time.time()
        for it, entry in zip(items, outcomes, strict=True):
            if self.waits is not None:
                outcome = iam_pb2.QueueState.Name(entry.state).removeprefix("QUEUE_STATE_")
                waited = (entry.ended_at or ended) - entry.enqueued_at
                self.waits.record(max(0.0, waited), {"outcome": outcome.lower()})
            await self._settle(it, entry)

    async def _wait(self, entry: iam_pb2.QueueEntry) -> iam_pb2.QueueEntry:
        if entry.state != WAITING:
            return entry
        fut: asyncio.Future[iam_pb2.QueueEntry] = asyncio.get_running_loop().create_future()
        w = _Waiter(fut, entry.deadline)
        self._waiters.setdefault(entry.queue_id, []).append(w)
        self._poll_wake.set()
        try:
            return await fut
        finally:
            mine = self._waiters.get(entry.queue_id, [])
            if w in mine:
                mine.remove(w)
            if not mine:
                self._waiters.pop(entry.queue_id, None)

    async def _settle(self, it: CreateItem, e: iam_pb2.QueueEntry) -> None:
        if e.state == PLACED:
            try:
                sb = await self.get_sandbox(it.who, e.placed_sandbox_id)
                until = time.monotonic() + CREATE_DEADLINE_S
                while (
                    it.wait_ready
                    and sb.state
                    in (types_pb2.SANDBOX_STATE_PENDING, types_pb2.SANDBOX_STATE_STARTING)
                    and time.monotonic() < until
                ):
                    await asyncio.sleep(0.05)
                    sb = await self.get_sandbox(it.who, e.placed_sandbox_id)
            except DSecError as err:
                it.error = err
                return
            fill_status(sb.queue, e, 0)
            it.result = sb
        elif e.state == TIMED_OUT:
            it.error = QueueTimeout(
                e.reason, metadata={"queue_id": e.queue_id, "project_id": e.project_id}
            )
        elif e.state == CANCELLED:
            it.error = Cancelled(
                f"the queued create {e.queue_id} was cancelled: {e.reason}",
                reason="QUEUE_CANCELLED",
                metadata={"queue_id": e.queue_id},
            )
        else:
            it.error = item_error(e.error)

    async def _poll_loop(self) -> None:
        """Resolves this server's waiting calls: one GetQueued for all of them per round."""
        while True:
            if not self._waiters:
                self._poll_wake.clear()
                await self._poll_wake.wait()
            await asyncio.sleep(POLL_S)
            ids = list(self._waiters)
            if not ids:
                continue
            try:
                # Only the entries that ended: a call waiting among thousands costs nothing
                # until its entry changes.
                resp = await self.iam.GetQueued(
                    iam_pb2.GetQueuedRequest(queue_ids=ids, ended_only=True),
                    timeout=DEFAULT_DEADLINE_S,
                )
            except Exception as exc:  # IAM restarting: ask again next round
                log.debug("GetQueued failed: %s", exc)
                continue
            for e in resp.entries:
                for w in self._waiters.get(e.queue_id, []):
                    if not w.future.done():
                        w.future.set_result(e)
            now = time.time()
            overdue = [
                qid
                for qid, ws in self._waiters.items()
                if ws and now > ws[0].deadline + DEADLINE_SLACK_S and not ws[0].future.done()
            ]
            if overdue:  # no dispatcher ended them (none holds the lease): end them here
                with contextlib.suppress(Exception):
                    got = await self.iam.GetQueued(
                        iam_pb2.GetQueuedRequest(queue_ids=overdue, waiting_only=True),
                        timeout=DEFAULT_DEADLINE_S,
                    )
                    await self._end(list(got.entries), TIMED_OUT)

    # ---------------------------------------------------------- dispatcher

    async def _dispatch_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), ROUND_S if self.dispatching else 1.0)
            self._wake.clear()
            try:
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # IAM or placement away: the next round tries again
                log.warning("create queue round failed: %s", exc)

    async def _round(self) -> None:
        lease = await self.iam.AcquireLease(
            iam_pb2.AcquireLeaseRequest(name=LEASE, holder=self.holder, ttl_s=LEASE_TTL_S),
            timeout=DEFAULT_DEADLINE_S,
        )
        self.dispatcher = lease.holder
        if not lease.held:
            if self.dispatching:
                log.info("the create queue is served by %s now", lease.holder)
            self.dispatching, self.waiting = False, 0
            return
        if not self.dispatching:
            log.info("serving the create queue (%s)", self.holder)
            self.dispatching = True
        resp = await self.iam.GetQueued(
            iam_pb2.GetQueuedRequest(waiting_only=True), timeout=DEFAULT_DEADLINE_S
        )
        now = time.time()
        expired = [e for e in resp.entries if e.deadline <= now]
        live = [e for e in resp.entries if e.deadline > now]
        self.waiting = len(live)
        if expired:
            await self._end(expired, TIMED_OUT)
        if not live:
            return
        batch = [
            (e, _request(e))
            for e in self.fair.order(live, MAX_ROUND, resp.in_use, resp.share_weight)
        ]
        updates: list[iam_pb2.QueueUpdate] = []
        # In serving order, one run of consecutive entries of one project (and principal) per
        # pipeline call: the edges admit one call's items in order, but two calls racing to
        # one edge would not keep the order between them. What one entry could not get, the
        # entries after it that ask for as much or more of it are not tried for this round
        # (a shape that found no room, a project at its quota); smaller ones still are, so a
        # big request at the head does not hold the small ones behind it.
        blocked = _Blocked()
        while batch:
            batch = [(e, r) for e, r in batch if not blocked.holds(e, r)]
            if not batch:
                break
            run = _first_run(batch)
            batch = batch[len(run) :]
            placed = await self._place(run, updates, blocked)
            self.fair.placed(placed)
            self.waiting -= len(placed)
        if updates:
            await downstream(
                self.iam.UpdateQueued(
                    iam_pb2.UpdateQueuedRequest(updates=updates), timeout=DEFAULT_DEADLINE_S
                ),
                "iam",
            )

    async def _place(
        self,
        run: list[tuple[iam_pb2.QueueEntry, apiserver_pb2.CreateSandboxRequest]],
        updates: list[iam_pb2.QueueUpdate],
        blocked: _Blocked,
    ) -> list[iam_pb2.QueueEntry]:
        """Sends entries through the creation pipeline; adds their outcomes to ``updates``
        and what they could not get to ``blocked``; returns the placed ones."""
        items = []
        for e, req in run:
            who = Caller(e.principal_id, e.project_id, "")
            # Its own spec object: one placement group per entry, served in this order.
            items.append(CreateItem(who, req.spec, req.idempotency_key, wait_ready=False))
        # An entry whose key is being created elsewhere is asked about once per round, not
        # waited for: the round would hold every entry behind it.
        await self.pipeline.run(items, idempotent_wait_s=0.0)
        placed = []
        for (e, req), it in zip(run, items, strict=True):
            if queueable(it.error):
                blocked.add(e, req, it.error)
            if it.result is not None:
                placed.append(e)
                updates.append(
                    iam_pb2.QueueUpdate(
                        queue_id=e.queue_id, state=PLACED, placed_sandbox_id=it.result.id
                    )
                )
            elif queueable(it.error) or in_progress(it.error):
                if it.error is not None and it.error.message != e.reason:
                    updates.append(
                        iam_pb2.QueueUpdate(queue_id=e.queue_id, reason=it.error.message)
                    )
            elif it.error is not None:
                u = iam_pb2.QueueUpdate(queue_id=e.queue_id, state=FAILED, reason=it.error.message)
                item_status(it.error, u.error)
                updates.append(u)
        return placed

    async def _end(self, entries: list[iam_pb2.QueueEntry], state: int) -> None:
        updates = []
        for e in entries:
            waited = max(0.0, e.deadline - e.enqueued_at)
            why = (
                f"waited {round(waited, 1):g} s in the create queue and was never placed"
                f" (last refusal: {e.reason})"
            )
            updates.append(iam_pb2.QueueUpdate(queue_id=e.queue_id, state=state, reason=why))  # type: ignore[arg-type]
        await downstream(
            self.iam.UpdateQueued(
                iam_pb2.UpdateQueuedRequest(updates=updates), timeout=DEFAULT_DEADLINE_S
            ),
            "iam",
        )

    # --------------------------------------------------------- get / stop / list

    async def _entry(self, who: Caller, queue_id: str) -> iam_pb2.QueueEntry:
        resp = await downstream(
            self.iam.GetQueued(
                iam_pb2.GetQueuedRequest(queue_ids=[queue_id]), timeout=DEFAULT_DEADLINE_S
            ),
            "iam",
        )
        if not resp.entries or not within(resp.entries[0].project_id, who.project_id):
            raise not_found(queue_id)
        return resp.entries[0]

    async def positions(
        self, project_prefix: str = ""
    ) -> tuple[list[iam_pb2.QueueEntry], dict[str, int], Mapping[str, float]]:
        """Every waiting entry (of the subtree), each one's place in the serving order of the
        whole queue (1 = next), and the projects' weights."""
        resp = await downstream(
            self.iam.GetQueued(
                iam_pb2.GetQueuedRequest(waiting_only=True), timeout=DEFAULT_DEADLINE_S
            ),
            "iam",
        )
        ordered = self.fair.order(
            resp.entries, len(resp.entries), resp.in_use, resp.share_weight, join=False
        )
        pos = {e.queue_id: i for i, e in enumerate(ordered, 1)}
        mine = [e for e in ordered if within(e.project_id, project_prefix)]
        return mine, pos, resp.share_weight

    async def get(self, who: Caller, queue_id: str) -> types_pb2.Sandbox:
        e = await self._entry(who, queue_id)
        if e.state == PLACED:
            sb = await self.get_sandbox(who, e.placed_sandbox_id)
            fill_status(sb.queue, e, 0)
            return sb
        position = 0
        if e.state == WAITING:
            _, pos, _ = await self.positions()
            position = pos.get(queue_id, 0)
        return pending_view(e, position)

    async def stop(self, who: Caller, queue_id: str) -> tuple[types_pb2.Sandbox | None, str]:
        """Cancels a waiting entry; returns its view, or (None, the placed sandbox's id) when
        it was placed already (the caller stops that sandbox)."""
        e = await self._entry(who, queue_id)
        if e.state == WAITING:
            resp = await downstream(
                self.iam.UpdateQueued(
                    iam_pb2.UpdateQueuedRequest(
                        updates=[
                            iam_pb2.QueueUpdate(
                                queue_id=queue_id,
                                state=CANCELLED,
                                reason=f"stopped by {who.principal_id} while waiting",
                            )
                        ]
                    ),
                    timeout=DEFAULT_DEADLINE_S,
                ),
                "iam",
            )
            e = resp.entries[0]
        if e.state == PLACED:
            return None, e.placed_sandbox_id
        return pending_view(e), ""

    async def listing(
        self, who: Caller, task_id: str, labels: dict[str, str], subprojects: bool
    ) -> list[types_pb2.Sandbox]:
        mine, pos, _ = await self.positions(who.project_id)
        out = []
        for e in mine:
            if task_id and e.task_id != task_id:
                continue
            if not subprojects and e.project_id != who.project_id:
                continue
            sb = pending_view(e, pos.get(e.queue_id, 0))
            if any(sb.spec.labels.get(k) != v for k, v in labels.items()):
                continue
            out.append(sb)
        return out

    async def summary(self, who: Caller, include_entries: bool) -> apiserver_pb2.ListQueueResponse:
        mine, pos, weights = await self.positions(who.project_id)
        now = time.time()
        groups: dict[tuple[str, str], apiserver_pb2.QueueGroup] = {}
        for e in mine:
            g = groups.get((e.project_id, e.task_id))
            if g is None:
                g = groups[(e.project_id, e.task_id)] = apiserver_pb2.QueueGroup(
                    project_id=e.project_id,
                    task_id=e.task_id,
                    share_weight=weight(weights, e.project_id),
                )
            g.waiting += 1
            g.oldest_wait_s = max(g.oldest_wait_s, now - e.enqueued_at)
        out = apiserver_pb2.ListQueueResponse(
            groups=sorted(groups.values(), key=lambda g: (-g.waiting, g.project_id, g.task_id)),
            waiting=len(mine),
            dispatcher=self.dispatcher,
        )
        if include_entries:
            out.entries.extend(pending_view(e, pos.get(e.queue_id, 0)) for e in mine)
        return out
