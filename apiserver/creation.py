"""Sandbox creation in batches: placement -> IAM -> edges, one call per stage.

Every create goes through :class:`CreationPipeline`, alone or with others:

- ``CreateSandboxes`` (a burst) is cut into chunks that run concurrently, so
  placement, IAM and the edges (separate processes) work at the same time;
- unary ``CreateSandbox`` calls are coalesced by :class:`CreateBatcher`: a
  call starts a batch at once when fewer than ``max_inflight`` batches are
  running, otherwise it joins the next one (a lone call waits for nothing);
  small batches ask placement for clumps, so they cost a few edge calls.

A round of the pipeline, for the items still pending:

1. placement ``PlaceSandboxGroups``: identical items are one group; one
   power-of-k decision per sandbox;
2. IAM ``ReserveQuotas``: a fresh sandbox id per item (it encodes the edge),
   one transaction for all, per-item results (quota exceeded names the
   limiting project; a known idempotency key names its sandbox);
3. edges ``CreateSandboxes``: one call per edge (and project/principal).
   Admitted -> done. Refused (capacity) -> the reservation is released and
   the item retried on another edge (at most ``max_create_attempts`` edges).
   Edge unreachable / call failed -> the outcome is unknown, so the
   reservation is kept (reconciliation releases it if the edge never got the
   sandbox; it covers the sandbox if it did) and the item is retried elsewhere,
   re-binding its idempotency key to the new attempt.

An idempotency key already bound to a sandbox returns that sandbox (from its
edge); while that sandbox is still being created elsewhere (reserved, not yet
on its edge) the item waits; if the sandbox is unknown to its edge and holds no
reservation (never created, or long gone) the key is re-bound and created.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.channels import DEFAULT_DEADLINE_S
from common.ids import new_sandbox_id
from dsec.edge.v1 import edge_pb2
from dsec.iam.v1 import iam_pb2, iam_pb2_grpc
from dsec.placement.v1 import placement_pb2, placement_pb2_grpc
from dsec.types.v1 import types_pb2
from libdsec.errors import (
    DeadlineExceeded,
    DSecError,
    EdgeCapacity,
    Internal,
    NoEligibleEdge,
    SandboxNotFound,
    Unavailable,
    item_error,
)

log = logging.getLogger(__name__)

CREATE_DEADLINE_S = 120.0  # a cold container start plus image work stays well under this
#: How long a create with a known idempotency key waits for the first attempt's sandbox.
IDEMPOTENT_WAIT_S = 15.0


@dataclass(frozen=True)
class Caller:
    principal_id: str
    project_id: str
    token: str


@dataclass(eq=False)
class CreateItem:
    """One sandbox to create, and where it is in the pipeline."""

    who: Caller
    spec: types_pb2.SandboxSpec  # normalized; shared (read-only) by identical items
    key: str = ""  # idempotency key
    wait_ready: bool = True
    result: types_pb2.Sandbox | None = None
    error: DSecError | None = None
    # --- the current attempt
    edge_id: str = ""
    address: str = ""
    sandbox_id: str = ""
    exclude: list[str] = field(default_factory=list)  # edges that refused or failed
    replaces: str = ""  # an attempt with an unknown outcome that holds the key
    existing: str = ""  # the key is bound to this sandbox
    existing_reserved: bool = False
    last_error: DSecError | None = None  # why the last edge tried did not create it
    deadline: float = 0.0

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


class CreationPipeline:
    def __init__(
        self,
        iam: iam_pb2_grpc.IamServiceStub,
        placement: placement_pb2_grpc.PlacementServiceStub,
        edge_stub: Callable[[str], Any],
        get_sandbox: Callable[[Caller, str], Awaitable[types_pb2.Sandbox]],
        remember_owner: Callable[[str, str], None],
        learn_edge: Callable[[str, str], None],
        *,
        max_attempts: int,
        downstream: Callable[[Awaitable[Any], str], Awaitable[Any]],
    ) -> None:
        self.iam = iam
        self.placement = placement
        self.edge_stub = edge_stub
        self.get_sandbox = get_sandbox
        self.remember_owner = remember_owner
        #: placement's answer names each edge's address: the edge directory learns it, so
        #: the next call on a new sandbox finds its edge even before the directory's refresh
        self.learn_edge = learn_edge
        self.max_attempts = max_attempts
        self.downstream = downstream

    async def run(
        self,
        items: list[CreateItem],
        *,
        edges_per_group: int = 0,
        idempotent_wait_s: float = IDEMPOTENT_WAIT_S,
    ) -> None:
        """Creates every item (or sets its error); never raises for one item's failure.

        An item whose idempotency key is bound to a sandbox still being created elsewhere
        waits ``idempotent_wait_s`` for it, then fails with ``CREATE_IN_PROGRESS`` (the
        create queue's dispatcher asks once and tries again next round).

        ``edges_per_group`` > 0 asks placement to put each group of identical
        items on about that many edges (clumps), so a small batch costs a few
        edge calls, not one per sandbox; 0 = one decision per sandbox.
        """
        try:
            await self._run(items, edges_per_group, idempotent_wait_s)
        except DSecError as err:  # a whole stage failed (e.g. placement unreachable)
            for it in items:
                if not it.done:
                    it.error = err
        except Exception as exc:
            log.exception("creation batch failed")
            for it in items:
                if not it.done:
                    it.error = Internal(f"creation failed: {type(exc).__name__}")

    async def _run(
        self, items: list[CreateItem], edges_per_group: int, idempotent_wait_s: float
    ) -> None:
        deadline = time.monotonic() + idempotent_wait_s
        for it in items:
            it.deadline = deadline
        pending = [it for it in items if not it.done]
        while pending:
            # Items placed ahead (a burst is placed in one call, see place()) keep their edge.
            unplaced = [it for it in pending if not it.edge_id]
            if unplaced:
                await self._place(unplaced, edges_per_group)
            placed = [it for it in pending if not it.done]
            await self._reserve(placed)
            fresh = [it for it in placed if not it.done and not it.existing]
            known = [it for it in placed if not it.done and it.existing]
            refused = [it for it in placed if it.done]  # by IAM: their placements go unused
            retry_edge, retry_known, _ = await asyncio.gather(
                self._create_on_edges(fresh),
                asyncio.gather(*(self._resolve_existing(it) for it in known)),
                self._report_unused(refused),
            )
            again = [it for it, more in zip(known, retry_known, strict=True) if more]
            await self._report_unused([it for it in known if it.done])
            pending = retry_edge + again

    # ------------------------------------------------------------ placement

    async def place(self, items: list[CreateItem]) -> None:
        """Places a whole burst in one placement call (one decision per sandbox over
        loads updated between decisions), ahead of running it in chunks: chunks
        placed separately would each see loads that lag the chunks before them."""
        try:
            await self._place([it for it in items if not it.done], 0)
        except DSecError as err:
            for it in items:
                if not it.done:
                    it.error = err

    async def _place(self, items: list[CreateItem], edges_per_group: int) -> None:
        groups: dict[tuple[int, str, tuple[str, ...]], list[CreateItem]] = {}
        for it in items:
            k = (id(it.spec), it.who.project_id, tuple(sorted(it.exclude)))
            groups.setdefault(k, []).append(it)
        req = placement_pb2.PlaceSandboxGroupsRequest()
        members = list(groups.values())
        for group in members:
            first = group[0]
            g = req.groups.add(count=len(group))
            if edges_per_group > 0:
                g.clump = -(-len(group) // edges_per_group)
            g.item.spec.CopyFrom(first.spec)
            g.item.project_id = first.who.project_id
            g.item.exclude_edges.extend(first.exclude)
        resp = await self.downstream(
            self.placement.PlaceSandboxGroups(req, timeout=DEFAULT_DEADLINE_S), "placement"
        )
        edges = [(e.edge_id, e.address) for e in resp.edges]
        for edge_id, address in edges:
            self.learn_edge(edge_id, address)
        for group, gp in zip(members, resp.placements, strict=True):
            indexes = gp.edge_indexes
            for it, idx in zip(group, indexes, strict=False):
                it.edge_id, it.address = edges[idx]
                it.sandbox_id = new_sandbox_id(it.edge_id)
            if len(indexes) < len(group):
                for it in group[len(indexes) :]:
                    # A retry that runs out of edges reports why the tried ones failed.
                    it.error = it.last_error or item_error(gp.error)

    # ------------------------------------------------------------------ IAM

    async def _reserve(self, items: list[CreateItem]) -> None:
        if not items:
            return
        req = iam_pb2.ReserveQuotasRequest()
        add = req.items.add
        for it in items:
            spec = it.spec
            add(
                project_id=it.who.project_id,
                sandbox_id=it.sandbox_id,
                backend=spec.backend,
                cpu_millis=spec.resources.cpu_millis,
                memory_mb=spec.resources.memory_mb,
                edge_id=it.edge_id,
                idempotency_key=it.key,
                replaces_sandbox_id=it.replaces,
            )
        resp = await self.downstream(self.iam.ReserveQuotas(req, timeout=DEFAULT_DEADLINE_S), "iam")
        for r in resp.results:
            it = items[r.index]
            it.existing = ""
            if r.error.code:
                it.error = item_error(r.error)
            elif r.existing_sandbox_id:
                it.existing = r.existing_sandbox_id
                it.existing_reserved = r.existing_reserved
            # already_reserved: an earlier round of ours holds this very id: proceed

    # ---------------------------------------------------------------- edges

    async def _create_on_edges(self, items: list[CreateItem]) -> list[CreateItem]:
        """Creates on the chosen edges; returns the items to retry elsewhere."""
        calls: dict[tuple[str, str, str, bool], list[CreateItem]] = {}
        for it in items:
            k = (it.address, it.who.project_id, it.who.principal_id, it.wait_ready)
            calls.setdefault(k, []).append(it)
        outcomes = await asyncio.gather(*(self._edge_call(group) for group in calls.values()))
        return [it for retry in outcomes for it in retry]

    async def _edge_call(self, group: list[CreateItem]) -> list[CreateItem]:
        first = group[0]
        by_spec: dict[int, list[CreateItem]] = {}
        for it in group:
            by_spec.setdefault(id(it.spec), []).append(it)
        req = edge_pb2.CreateSandboxesRequest(
            project_id=first.who.project_id,
            principal_id=first.who.principal_id,
            wait_ready=first.wait_ready,
        )
        ordered: list[CreateItem] = []
        for same in by_spec.values():
            g = req.groups.add()
            g.spec.CopyFrom(same[0].spec)
            g.sandbox_ids.extend([it.sandbox_id for it in same])
            ordered += same
        edge_id = first.edge_id
        try:
            resp = await self.downstream(
                self.edge_stub(first.address).CreateSandboxes(req, timeout=CREATE_DEADLINE_S),
                "edge",
            )
        except (Unavailable, DeadlineExceeded) as err:
            log.warning(
                "edge %s failed a batch of %d creates (%s); retrying them elsewhere",
                edge_id,
                len(ordered),
                err.reason,
                extra={"edge_id": edge_id},
            )
            await self._report_items(ordered, placement_pb2.OUTCOME_UNREACHABLE)
            # Unknown outcome: the reservations stay (reconciliation settles them).
            return self._retry(ordered, err, keep_key=True)
        except DSecError as err:
            for it in ordered:
                it.error = err
            if not isinstance(err, Internal) and err.code != grpc.StatusCode.UNKNOWN:
                # Refused as a whole before admission: nothing was created.
                await self._release([it.sandbox_id for it in ordered], not_created=True)
            return []
        refused: list[CreateItem] = []
        not_created: list[str] = []
        capacity: EdgeCapacity | None = None
        for it, r in zip(ordered, resp.results, strict=True):
            if not r.error.code:
                it.result = r.sandbox
                self.remember_owner(it.sandbox_id, it.who.project_id)
                continue
            not_created.append(it.sandbox_id)
            refusal = item_error(r.error)
            if isinstance(refusal, EdgeCapacity):
                capacity = refusal
                refused.append(it)
            else:
                it.error = refusal
        if not_created:
            await self._release(not_created, not_created=True)
        if refused:
            assert capacity is not None
            log.info(
                "edge %s refused %d sandboxes (%s); trying other edges",
                edge_id,
                len(refused),
                capacity.reason,
                extra={"edge_id": edge_id},
            )
            await self._report_items(refused, placement_pb2.OUTCOME_REJECTED)
        return self._retry(refused, capacity, keep_key=False)

    def _retry(
        self, items: list[CreateItem], err: DSecError | None, *, keep_key: bool
    ) -> list[CreateItem]:
        again = []
        for it in items:
            it.exclude.append(it.edge_id)
            it.edge_id = ""  # placed again, elsewhere
            it.last_error = err
            if keep_key and it.key:
                it.replaces = it.sandbox_id
            if len(it.exclude) >= self.max_attempts:
                it.error = err or NoEligibleEdge("no edge admitted the sandbox")
            else:
                again.append(it)
        return again

    async def _release(self, sandbox_ids: list[str], *, not_created: bool) -> None:
        await release_quota(self.iam, sandbox_ids, not_created=not_created)

    async def _report(
        self, edge_id: str, spec: types_pb2.SandboxSpec, outcome: Any, count: int = 1
    ) -> None:
        try:
            await self.placement.ReportOutcome(
                placement_pb2.ReportOutcomeRequest(
                    edge_id=edge_id,
                    outcome=outcome,
                    cpu_millis=spec.resources.cpu_millis,
                    memory_mb=spec.resources.memory_mb,
                    backend=spec.backend,
                    count=count,
                ),
                timeout=DEFAULT_DEADLINE_S,
            )
        except Exception as exc:
            log.debug("ReportOutcome failed: %s", exc)

    async def _report_unused(self, items: list[CreateItem]) -> None:
        """Tells placement which of its placements were never sent to their edge, so
        its overlay does not count them."""
        await self._report_items(items, placement_pb2.OUTCOME_UNUSED)

    async def _report_items(self, items: list[CreateItem], outcome: Any) -> None:
        """One ReportOutcome per edge and spec, with the count."""
        groups: dict[tuple[str, int], list[CreateItem]] = {}
        for it in items:
            if it.edge_id:
                groups.setdefault((it.edge_id, id(it.spec)), []).append(it)
        await asyncio.gather(
            *(
                self._report(edge_id, same[0].spec, outcome, len(same))
                for (edge_id, _), same in groups.items()
            )
        )

    # ----------------------------------------------------- idempotency keys

    async def _resolve_existing(self, it: CreateItem) -> bool:
        """The sandbox an idempotency key is bound to; True = go round again."""
        try:
            sb = await self.get_sandbox(it.who, it.existing)
        except SandboxNotFound:
            if not it.existing_reserved:
                # Never created (or ended and forgotten): this attempt takes the key over
                # (same edge, same fresh sandbox id: nothing was reserved for it yet).
                it.replaces = it.existing
                return True
            if time.monotonic() > it.deadline:
                it.error = Unavailable(
                    f"a create with idempotency key {it.key!r} is still in progress"
                    f" (sandbox {it.existing}); retry later",
                    reason="CREATE_IN_PROGRESS",
                )
                return False
            await asyncio.sleep(0.1)  # being created elsewhere: ask again
            return True
        while it.wait_ready and sb.state in (
            types_pb2.SANDBOX_STATE_PENDING,
            types_pb2.SANDBOX_STATE_STARTING,
        ):
            if time.monotonic() > it.deadline + CREATE_DEADLINE_S:
                break
            await asyncio.sleep(0.1)
            sb = await self.get_sandbox(it.who, it.existing)
        it.result = sb
        return False


class CreateBatcher:
    """Coalesces concurrent creates into pipeline batches.

    A create starts a batch at once if fewer than ``max_inflight`` batches are
    running; otherwise it queues, and the next batch takes up to ``max_batch``
    queued creates: under load, batches grow by themselves (each costs one
    placement call, one IAM transaction and a few edge calls, whatever its
    size). So that slow batches (containers starting) do not hold the queue,
    a batch also starts when the youngest running one is ``max_wait_s`` old.
    A lone create never waits.
    """

    def __init__(
        self,
        run: Callable[[list[CreateItem]], Awaitable[None]],
        *,
        max_batch: int = 1024,
        max_inflight: int = 1,
        max_wait_s: float = 0.1,
    ) -> None:
        self._run = run
        self.max_batch = max_batch
        self.max_inflight = max_inflight
        self.max_wait_s = max_wait_s
        self._queue: deque[tuple[CreateItem, asyncio.Future[None], contextvars.Context]] = deque()
        self._inflight = 0
        self._last_start = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.items = 0

    async def create(self, item: CreateItem) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((item, fut, contextvars.copy_context()))
        self._launch()
        await fut

    def _launch(self) -> None:
        while self._queue:
            waited = time.monotonic() - self._last_start
            if self._inflight >= self.max_inflight and waited < self.max_wait_s:
                if self._timer is None:
                    self._timer = asyncio.get_running_loop().call_later(
                        self.max_wait_s - waited, self._on_timer
                    )
                return
            batch: list[tuple[CreateItem, asyncio.Future[None], contextvars.Context]] = []
            while self._queue and len(batch) < self.max_batch:
                batch.append(self._queue.popleft())
            self._inflight += 1
            self._last_start = time.monotonic()
            # The batch runs in the context of its first call: that call's trace
            # continues through placement, IAM and the edges.
            task = asyncio.create_task(self._one(batch), context=batch[0][2])
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _on_timer(self) -> None:
        self._timer = None
        self._launch()

    async def _one(
        self, batch: list[tuple[CreateItem, asyncio.Future[None], contextvars.Context]]
    ) -> None:
        self.batches += 1
        self.items += len(batch)
        try:
            await self._run([it for it, _, _ in batch])
        finally:
            self._inflight -= 1
            for item, fut, _ in batch:
                if not item.done:  # cancelled (shutdown)
                    item.error = Unavailable("the API server is shutting down")
                if not fut.done():
                    fut.set_result(None)
            self._launch()

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for task in list(self._tasks):
            task.cancel()


async def release_quota(
    iam: iam_pb2_grpc.IamServiceStub, sandbox_ids: list[str], *, not_created: bool
) -> None:
    """Give the quota of `sandbox_ids` back; a failure is logged, not raised (reconciliation
    releases it later)."""
    if not sandbox_ids:
        return
    try:
        await iam.ReleaseQuota(
            iam_pb2.ReleaseQuotaRequest(sandbox_ids=sandbox_ids, not_created=not_created),
            timeout=DEFAULT_DEADLINE_S,
        )
    except Exception as exc:  # reconciliation will release it later
        log.warning("quota release of %d sandboxes failed: %s", len(sandbox_ids), exc)
