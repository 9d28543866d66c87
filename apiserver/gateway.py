"""The API server's flows: create (placement -> IAM -> edge, in batches: see
``apiserver/creation.py``) and routing to edges.

Stateless by design: everything it needs is either in the request, derivable
from the sandbox id (the owning edge), cached from another service (tokens,
edge addresses, sandbox owners), or asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from apiserver import snapshots
from apiserver.config import ApiServerConfig
from apiserver.creation import Caller, CreateBatcher, CreateItem, CreationPipeline
from apiserver.queue import CreateQueue, checked_priority, checked_wait_s, queueable
from apiserver.routing import AuthCache, EdgeDirectory, OwnerCache, downstream, not_found, within
from common.channels import DEFAULT_DEADLINE_S
from common.ids import edge_of
from common.metrics import Metrics
from dsec.edge.v1 import edge_pb2, edge_pb2_grpc
from dsec.iam.v1 import iam_pb2_grpc
from dsec.placement.v1 import placement_pb2_grpc
from dsec.types.v1 import types_pb2
from libdsec.errors import (
    DSecError,
    InvalidArgument,
    NotFound,
    SandboxNotFound,
    SandboxTerminated,
    Unavailable,
)

log = logging.getLogger(__name__)

__all__ = ["Caller", "Gateway"]

#: Items per CreateSandboxes call.
MAX_CREATE_MANY = 50_000


class Gateway:
    def __init__(
        self,
        cfg: ApiServerConfig,
        iam: iam_pb2_grpc.IamServiceStub,
        placement: placement_pb2_grpc.PlacementServiceStub,
        edges: EdgeDirectory,
        metrics: Metrics | None = None,
    ) -> None:
        self.cfg = cfg
        #: Creates under way in this server (each item of a burst counts), when measured.
        self.in_flight = (
            metrics.meter.create_up_down_counter(
                "dsec_apiserver_creates_in_flight",
                description="Creates this API server is working on (a burst's items each)",
            )
            if metrics is not None
            else None
        )
        self.iam = iam
        self.placement = placement
        self.edges = edges
        self.auth = AuthCache(iam, cfg.auth_cache_ttl_s)
        self.owners = OwnerCache()
        self.pipeline = CreationPipeline(
            iam,
            placement,
            edges.stub_for_address,
            self.get,
            self.owners.put,
            edges.learn,
            max_attempts=cfg.max_create_attempts,
            downstream=downstream,
        )
        self.batcher = CreateBatcher(
            lambda items: self.pipeline.run(items, edges_per_group=cfg.create_batch_edges),
            max_batch=cfg.create_batch_max,
            max_inflight=cfg.create_batches_inflight,
            max_wait_s=cfg.create_batch_wait_s,
        )
        self._normalized: dict[bytes, types_pb2.SandboxSpec] = {}
        self.queue = CreateQueue(iam, self.pipeline, self.get, cfg.instance_name, metrics)

    async def caller(self, token: str) -> Caller:
        p = await self.auth.principal(token)
        return Caller(p.principal_id, p.project_id, token)

    # -------------------------------------------------------------- create

    def normalize(self, spec: types_pb2.SandboxSpec) -> types_pb2.SandboxSpec:
        """Validates a spec and fills platform defaults; raises InvalidArgument naming the field."""
        cfg = self.cfg
        out = types_pb2.SandboxSpec()
        out.CopyFrom(spec)
        if out.backend == types_pb2.BACKEND_UNSPECIFIED:
            out.backend = types_pb2.BACKEND_CONTAINER
        if out.backend not in types_pb2.Backend.values():
            raise InvalidArgument(f"unknown backend {out.backend}", reason="INVALID_BACKEND")
        r = out.resources
        r.cpu_millis = r.cpu_millis or cfg.default_cpu_millis
        r.memory_mb = r.memory_mb or cfg.default_memory_mb
        if not 10 <= r.cpu_millis <= cfg.max_cpu_millis:
            raise InvalidArgument(
                f"resources.cpu_millis={r.cpu_millis} must be in 10..{cfg.max_cpu_millis}",
                reason="INVALID_RESOURCES",
            )
        if not 16 <= r.memory_mb <= cfg.max_memory_mb:
            raise InvalidArgument(
                f"resources.memory_mb={r.memory_mb} must be in 16..{cfg.max_memory_mb}",
                reason="INVALID_RESOURCES",
            )
        out.ttl_s = out.ttl_s or cfg.default_ttl_s
        if out.ttl_s > cfg.max_ttl_s:
            raise InvalidArgument(
                f"ttl_s={out.ttl_s} exceeds the maximum {cfg.max_ttl_s}", reason="INVALID_TTL"
            )
        for k, v in out.labels.items():
            if not k or len(k) > 63 or len(v) > 255:
                raise InvalidArgument(
                    f"label {k!r}: keys 1..63 chars, values <= 255 chars", reason="INVALID_LABEL"
                )
        if len(out.task_id) > 128:
            raise InvalidArgument("task_id is longer than 128 characters")
        if len(out.image) > 512:
            raise InvalidArgument("image name is longer than 512 characters")
        return out

    def normalize_shared(self, spec: types_pb2.SandboxSpec) -> types_pb2.SandboxSpec:
        """:meth:`normalize`, memoized: identical specs (a burst) share one normalized,
        read-only message, which also lets the pipeline group them."""
        raw = spec.SerializeToString(deterministic=True)
        out = self._normalized.get(raw)
        if out is None:
            out = self.normalize(spec)
            if len(self._normalized) >= 4096:
                self._normalized.clear()
            self._normalized[raw] = out
        return out

    async def create(self, who: Caller, req: Any) -> types_pb2.Sandbox:
        """Creates one sandbox. With an idempotency key (durable, in IAM), a retry on
        any API server instance returns the first attempt's sandbox. With ``wait_s``, a
        create the cluster has no room for waits in the queue (``apiserver/queue.py``)."""
        with self._counted(1):
            return await self._create(who, req)

    @contextlib.contextmanager
    def _counted(self, n: int) -> Iterator[None]:
        """``n`` creates in flight for the span of the block."""
        if self.in_flight is None:
            yield
            return
        self.in_flight.add(n)
        try:
            yield
        finally:
            self.in_flight.add(-n)

    async def _create(self, who: Caller, req: Any) -> types_pb2.Sandbox:
        wait_s = checked_wait_s(req.wait_s)
        checked_priority(req.priority)
        snapshots.check_visible(who.project_id, req.spec.image)
        item = CreateItem(who, self.normalize_shared(req.spec), req.idempotency_key, req.wait_ready)
        refusal: DSecError | None = None
        if not (wait_s and self.queue.backlogged):  # creates are waiting: no jumping ahead
            await self.batcher.create(item)
            if item.error is None or not (wait_s and queueable(item.error)):
                if item.error is not None:
                    raise item.error
                assert item.result is not None
                return item.result
            refusal, item.error = item.error, None
        await self.queue.wait_for_room([item], [req], [refusal])
        if item.error is not None:
            raise item.error
        assert item.result is not None
        return item.result

    async def create_many(
        self, who: Caller, requests: list[Any]
    ) -> list[tuple[types_pb2.Sandbox | None, DSecError | None]]:
        """Creates a burst: chunks go through the pipeline concurrently; one result per item."""
        if len(requests) > MAX_CREATE_MANY:
            raise InvalidArgument(f"at most {MAX_CREATE_MANY} items per CreateSandboxes call")
        with self._counted(len(requests)):
            return await self._create_many(who, requests)

    async def _create_many(
        self, who: Caller, requests: list[Any]
    ) -> list[tuple[types_pb2.Sandbox | None, DSecError | None]]:
        for req in requests:
            checked_wait_s(req.wait_s)
            checked_priority(req.priority)
        backlogged = self.queue.backlogged
        items: list[CreateItem] = []
        # A key repeated inside the burst names the same sandbox: only its first item is
        # created, the others get its outcome. (Sent through the pipeline, a repeat waited
        # for the first's sandbox, and when the first failed it waited out the whole
        # IDEMPOTENT_WAIT_S inside this call: found by tests/fuzz.)
        first_with_key: dict[str, CreateItem] = {}
        repeats: list[tuple[CreateItem, CreateItem]] = []
        for req in requests:
            it = CreateItem(who, types_pb2.SandboxSpec(), req.idempotency_key, req.wait_ready)
            try:
                snapshots.check_visible(who.project_id, req.spec.image)
                it.spec = self.normalize_shared(req.spec)
            except DSecError as err:
                it.error = err
            items.append(it)
            first = first_with_key.setdefault(it.key, it) if it.key else it
            if first is not it and it.error is None:
                first.wait_ready = first.wait_ready or it.wait_ready
                repeats.append((it, first))
        repeated = {id(it) for it, _ in repeats}
        valid = [it for it in items if it.error is None and id(it) not in repeated]
        request_of = {id(it): req for it, req in zip(items, requests, strict=True)}
        # Creates are waiting already: the ones that may wait join the queue behind them.
        queued_now = [it for it in valid if backlogged and request_of[id(it)].wait_s]
        valid = [it for it in valid if not (backlogged and request_of[id(it)].wait_s)]
        tried = valid
        await self.pipeline.place(valid)
        valid = [it for it in valid if it.error is None]
        size = max(1, self.cfg.create_chunk)
        chunks = [valid[i : i + size] for i in range(0, len(valid), size)]
        sem = asyncio.Semaphore(self.cfg.create_chunks_inflight)

        async def one(chunk: list[CreateItem]) -> None:
            async with sem:
                await self.pipeline.run(chunk)

        await asyncio.gather(*(one(c) for c in chunks))
        refused = [it for it in tried if request_of[id(it)].wait_s and queueable(it.error)]
        to_queue = queued_now + refused
        if to_queue:
            refusals = [it.error for it in to_queue]
            for it in to_queue:
                it.error = None
            await self.queue.wait_for_room(
                to_queue, [request_of[id(it)] for it in to_queue], refusals
            )
        for it, first in repeats:
            it.result, it.error = first.result, first.error
        return [(it.result, it.error) for it in items]

    # ------------------------------------------------------------- routing

    async def edge_for(self, who: Caller, sandbox_id: str) -> edge_pb2_grpc.EdgeServiceStub:
        """The owning edge's stub, after checking the caller may touch this sandbox.

        A sandbox of another project is reported exactly like a missing one.
        """
        if not sandbox_id:
            raise InvalidArgument("sandbox_id is required")
        edge_id = edge_of(sandbox_id)
        if edge_id is None:
            raise not_found(sandbox_id)
        if edge_id in self.edges.unhealthy:
            # Its edge fails its probes (a lost node: calls would wait out their deadline on
            # it). If the watcher declared it lost, say so at once; callers turn this into
            # the sandbox's EDGE_LOST end (get, explain).
            down = Unavailable(f"edge {edge_id} is not answering", reason="EDGE_UNAVAILABLE")
            try:
                declared = await self.lost(who, sandbox_id, down) is not None
            except SandboxNotFound:  # not among its lost ones: the edge (maybe back) decides
                declared = False
            if declared:
                raise down
        stub = await self.edges.stub(edge_id)
        if stub is None:
            raise not_found(sandbox_id)
        owner = self.owners.get(sandbox_id)
        if owner is None:
            try:
                resp = await downstream(
                    stub.GetSandbox(
                        edge_pb2.GetSandboxRequest(sandbox_id=sandbox_id),
                        timeout=DEFAULT_DEADLINE_S,
                    ),
                    "edge",
                )
            except NotFound:
                raise not_found(sandbox_id) from None
            owner = resp.sandbox.project_id
            self.owners.put(sandbox_id, owner)
        if not within(owner, who.project_id):
            raise not_found(sandbox_id)
        return stub

    async def get(self, who: Caller, sandbox_id: str) -> types_pb2.Sandbox:
        try:
            stub = await self.edge_for(who, sandbox_id)
            try:
                resp = await downstream(
                    stub.GetSandbox(
                        edge_pb2.GetSandboxRequest(sandbox_id=sandbox_id),
                        timeout=DEFAULT_DEADLINE_S,
                    ),
                    "edge",
                )
            except SandboxNotFound:
                self.owners.drop(sandbox_id)
                raise
        except (NotFound, Unavailable) as err:
            lost = await self.lost(who, sandbox_id, err)
            if lost is None:
                raise
            return lost
        return resp.sandbox

    async def list_sandboxes(
        self,
        who: Caller,
        *,
        task_id: str = "",
        labels: dict[str, str] | None = None,
        states: list[types_pb2.SandboxState.ValueType] | None = None,
        include_subprojects: bool = False,
    ) -> list[types_pb2.Sandbox]:
        """The caller's sandboxes (its project's, or its whole subtree's), oldest first: every
        edge's (terminated ones too, as long as the edge keeps them), those of edges declared
        lost (TERMINATED, EDGE_LOST) and the creates waiting in the queue (PENDING). An edge
        that does not answer is left out (and logged). ListSandboxes and the dashboard."""
        labels = labels or {}
        states = states or []
        req = edge_pb2.ListSandboxesRequest(
            project_prefix=who.project_id,
            task_id=task_id,
            label_selector=labels,
            states=states,
            include_terminated=True,
        )
        answers = await self.fan_out(lambda s: s.ListSandboxes(req, timeout=DEFAULT_DEADLINE_S))
        sandboxes = [sb for a in answers for sb in a.sandboxes]
        if not states or types_pb2.SANDBOX_STATE_TERMINATED in states:
            sandboxes += await self._lost_listing(who, task_id, labels, {sb.id for sb in sandboxes})
        if not include_subprojects:
            sandboxes = [sb for sb in sandboxes if sb.project_id == who.project_id]
        if not states or types_pb2.SANDBOX_STATE_PENDING in states:
            sandboxes += await self.queue.listing(who, task_id, labels, include_subprojects)
        sandboxes.sort(key=lambda sb: (sb.created_at.seconds, sb.created_at.nanos, sb.id))
        return sandboxes

    async def _lost_listing(
        self, who: Caller, task_id: str, labels: dict[str, str], listed: set[str]
    ) -> list[types_pb2.Sandbox]:
        """The caller's sandboxes of edges declared lost (an edge that answers again wins)."""
        try:
            resp = await self.edges.lost(
                project_prefix=who.project_id, task_id=task_id, label_selector=labels
            )
        except DSecError as exc:  # the watcher is down: the edges' answers stand
            log.warning("lost-sandbox listing failed: %s", exc)
            return []
        return [sb for sb in resp.sandboxes if sb.id not in listed]

    async def explain(self, who: Caller, sandbox_id: str, err: DSecError) -> DSecError:
        """What a call gets when the sandbox's edge could not serve it (``err``): if the edge
        was declared lost, SandboxTerminated (EDGE_LOST), like a sandbox that ended on a live
        edge (or NOT_FOUND for one the watcher never heard of); otherwise ``err``."""
        if not isinstance(err, SandboxNotFound | Unavailable):
            return err
        try:
            sb = await self.lost(who, sandbox_id, err)
        except SandboxNotFound as exc:
            return exc
        if sb is None:
            return err
        return SandboxTerminated(
            f"sandbox {sandbox_id} has terminated (EDGE_LOST: {sb.termination.message})",
            metadata={"termination_reason": "EDGE_LOST"},
        )

    async def lost(
        self, who: Caller, sandbox_id: str, err: NotFound | Unavailable
    ) -> types_pb2.Sandbox | None:
        """For a sandbox its edge cannot answer for: as the watcher reports it if its edge was
        declared lost (TERMINATED, EDGE_LOST), None if not. A sandbox the lost edge held that
        the watcher never heard of is NOT_FOUND rather than UNAVAILABLE for ever."""
        try:
            resp = await self.edges.lost(sandbox_ids=[sandbox_id])
        except DSecError as exc:  # the watcher is down: the edge's answer stands
            log.warning("lost-sandbox lookup of %s failed: %s", sandbox_id, exc)
            return None
        for sb in resp.sandboxes:
            if sb.id == sandbox_id and within(sb.project_id, who.project_id):
                self.owners.put(sandbox_id, sb.project_id)
                return sb
        if isinstance(err, Unavailable) and edge_of(sandbox_id) in resp.lost_edge_ids:
            raise not_found(sandbox_id) from err
        return None

    async def fan_out_each(
        self, fn: Callable[[edge_pb2_grpc.EdgeServiceStub], Awaitable[Any]]
    ) -> dict[str, Any]:
        """Calls every known edge at once: edge id -> its answer, or the :class:`DSecError`
        its call failed with (an edge that fails is one entry, not the whole call's end)."""
        await self.edges.refresh()
        edges = sorted(self.edges.addresses.items())
        results = await asyncio.gather(
            *(downstream(fn(self.edges.stub_for_address(a)), "edge") for _, a in edges),
            return_exceptions=True,
        )
        out: dict[str, Any] = {}
        for (edge_id, _), r in zip(edges, results, strict=True):
            if isinstance(r, BaseException) and not isinstance(r, DSecError):
                raise r
            out[edge_id] = r
        return out

    async def fan_out(
        self, fn: Callable[[edge_pb2_grpc.EdgeServiceStub], Awaitable[Any]]
    ) -> list[Any]:
        """Calls every known edge; an unreachable edge is skipped (and logged), not fatal."""
        out = []
        for edge_id, r in (await self.fan_out_each(fn)).items():
            if isinstance(r, DSecError):
                log.warning("edge %s unreachable during fan-out: %s", edge_id, r)
                continue
            out.append(r)
        return out
