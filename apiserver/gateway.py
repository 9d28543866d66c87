"""The API server's flows: create (IAM -> placement -> edge) and routing to edges.

Stateless by design: everything it needs is either in the request, derivable
from the sandbox id (the owning edge), cached from another service (tokens,
edge addresses, sandbox owners), or asked for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from apiserver.config import ApiServerConfig
from apiserver.routing import AuthCache, EdgeDirectory, OwnerCache, downstream, not_found, within
from common.channels import DEFAULT_DEADLINE_S
from common.ids import edge_of, new_sandbox_id
from dsec.edge.v1 import edge_pb2, edge_pb2_grpc
from dsec.iam.v1 import iam_pb2, iam_pb2_grpc
from dsec.placement.v1 import placement_pb2, placement_pb2_grpc
from dsec.types.v1 import types_pb2
from libdsec._status import status_for
from libdsec.errors import (
    DSecError,
    EdgeCapacity,
    InvalidArgument,
    NoEligibleEdge,
    NotFound,
    SandboxNotFound,
    Unavailable,
)

log = logging.getLogger(__name__)

CREATE_DEADLINE_S = 120.0  # a cold container start plus image work stays well under this


@dataclass(frozen=True)
class Caller:
    principal_id: str
    project_id: str
    token: str


class Gateway:
    def __init__(
        self,
        cfg: ApiServerConfig,
        iam: iam_pb2_grpc.IamServiceStub,
        placement: placement_pb2_grpc.PlacementServiceStub,
        edges: EdgeDirectory,
    ) -> None:
        self.cfg = cfg
        self.iam = iam
        self.placement = placement
        self.edges = edges
        self.auth = AuthCache(iam, cfg.auth_cache_ttl_s)
        self.owners = OwnerCache()
        # Idempotency keys seen by this instance: (project, key) -> (expiry, sandbox id).
        self._idempotent: dict[tuple[str, str], tuple[float, str]] = {}
        self._inflight: dict[tuple[str, str], asyncio.Future[types_pb2.Sandbox]] = {}

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

    async def create(
        self, who: Caller, req: Any, *, placement: placement_pb2.Placement | None = None
    ) -> types_pb2.Sandbox:
        """Creates one sandbox. With an idempotency key, a retry returns the first attempt's sandbox."""
        spec = self.normalize(req.spec)
        key = (who.project_id, req.idempotency_key) if req.idempotency_key else None
        if key is not None:
            now = time.monotonic()
            known = self._idempotent.get(key)
            if known is not None and known[0] > now:
                return await self.get(who, known[1])
            if key in self._inflight:
                return await asyncio.shield(self._inflight[key])
            fut: asyncio.Future[types_pb2.Sandbox] = asyncio.get_running_loop().create_future()
            self._inflight[key] = fut
            try:
                sb = await self._create(who, spec, req.wait_ready, placement)
            except BaseException as exc:
                fut.set_exception(exc)
                fut.exception()  # retrieved: no "never retrieved" warning
                raise
            finally:
                self._inflight.pop(key, None)
            fut.set_result(sb)
            self._idempotent[key] = (now + 24 * 3600, sb.id)
            return sb
        return await self._create(who, spec, req.wait_ready, placement)

    async def _place(
        self, who: Caller, spec: types_pb2.SandboxSpec, exclude: list[str]
    ) -> placement_pb2.Placement:
        item = placement_pb2.PlacementItem(
            spec=spec, project_id=who.project_id, exclude_edges=exclude
        )
        resp = await downstream(
            self.placement.PlaceSandbox(
                placement_pb2.PlaceSandboxRequest(item=item), timeout=DEFAULT_DEADLINE_S
            ),
            "placement",
        )
        return resp.placement

    async def _create(
        self,
        who: Caller,
        spec: types_pb2.SandboxSpec,
        wait_ready: bool,
        placement: placement_pb2.Placement | None,
    ) -> types_pb2.Sandbox:
        tried: list[str] = []
        last_error: DSecError | None = None
        while len(tried) < self.cfg.max_create_attempts:
            if placement is None:
                placement = await self._place(who, spec, tried)
            if placement.error_code:
                if last_error is not None:
                    raise last_error
                raise status_for(
                    placement.error_code, placement.error_reason, placement.error_message
                )
            for cand in placement.candidates:
                if cand.edge_id in tried or len(tried) >= self.cfg.max_create_attempts:
                    continue
                tried.append(cand.edge_id)
                try:
                    return await self._create_on(who, spec, wait_ready, cand)
                except (EdgeCapacity, Unavailable) as err:
                    last_error = err
                    await self._report(
                        cand.edge_id,
                        spec,
                        placement_pb2.OUTCOME_REJECTED
                        if isinstance(err, EdgeCapacity)
                        else placement_pb2.OUTCOME_UNREACHABLE,
                    )
                    log.info(
                        "edge %s refused a sandbox (%s); trying another", cand.edge_id, err.reason
                    )
            placement = None
        raise last_error or NoEligibleEdge("no edge admitted the sandbox")

    async def _create_on(
        self,
        who: Caller,
        spec: types_pb2.SandboxSpec,
        wait_ready: bool,
        cand: placement_pb2.Candidate,
    ) -> types_pb2.Sandbox:
        sandbox_id = new_sandbox_id(cand.edge_id)
        await downstream(
            self.iam.ReserveQuota(
                iam_pb2.ReserveQuotaRequest(
                    project_id=who.project_id,
                    sandbox_id=sandbox_id,
                    backend=spec.backend,
                    cpu_millis=spec.resources.cpu_millis,
                    memory_mb=spec.resources.memory_mb,
                    edge_id=cand.edge_id,
                ),
                timeout=DEFAULT_DEADLINE_S,
            ),
            "iam",
        )
        edge = self.edges.stub_for_address(cand.address)
        try:
            resp = await downstream(
                edge.CreateSandbox(
                    edge_pb2.CreateSandboxRequest(
                        sandbox_id=sandbox_id,
                        spec=spec,
                        project_id=who.project_id,
                        principal_id=who.principal_id,
                        wait_ready=wait_ready,
                    ),
                    timeout=CREATE_DEADLINE_S,
                ),
                "edge",
            )
        except BaseException:
            # Not admitted: the reservation goes back at once. (If the edge did
            # admit and only the answer was lost, reconciliation keeps it.)
            await self._release([sandbox_id])
            raise
        self.owners.put(sandbox_id, who.project_id)
        return resp.sandbox

    async def _release(self, sandbox_ids: list[str]) -> None:
        try:
            await self.iam.ReleaseQuota(
                iam_pb2.ReleaseQuotaRequest(sandbox_ids=sandbox_ids), timeout=DEFAULT_DEADLINE_S
            )
        except Exception as exc:  # reconciliation will release it later
            log.warning("quota release of %s failed: %s", sandbox_ids, exc)

    async def _report(self, edge_id: str, spec: types_pb2.SandboxSpec, outcome: Any) -> None:
        try:
            await self.placement.ReportOutcome(
                placement_pb2.ReportOutcomeRequest(
                    edge_id=edge_id,
                    outcome=outcome,
                    cpu_millis=spec.resources.cpu_millis,  # type: ignore[arg-type]
                    memory_mb=spec.resources.memory_mb,
                    backend=spec.backend,
                ),
                timeout=DEFAULT_DEADLINE_S,
            )
        except Exception as exc:
            log.debug("ReportOutcome failed: %s", exc)

    async def create_many(
        self, who: Caller, items: list[Any]
    ) -> list[tuple[types_pb2.Sandbox | None, DSecError | None]]:
        """Creates a batch: one placement call for all items, then edges in parallel."""
        if len(items) > 50_000:
            raise InvalidArgument("at most 50000 items per CreateSandboxes call")
        specs: list[types_pb2.SandboxSpec | None] = []
        results: list[tuple[types_pb2.Sandbox | None, DSecError | None]] = [(None, None)] * len(
            items
        )
        for i, item in enumerate(items):
            try:
                specs.append(self.normalize(item.spec))
            except DSecError as err:
                specs.append(None)
                results[i] = (None, err)
        valid = [i for i, s in enumerate(specs) if s is not None]
        placements: dict[int, placement_pb2.Placement] = {}
        if valid:
            req = placement_pb2.PlaceSandboxesRequest(
                items=[
                    placement_pb2.PlacementItem(spec=specs[i], project_id=who.project_id)
                    for i in valid
                ]
            )
            resp = await downstream(
                self.placement.PlaceSandboxes(req, timeout=DEFAULT_DEADLINE_S), "placement"
            )
            placements = dict(zip(valid, resp.placements, strict=True))
        sem = asyncio.Semaphore(self.cfg.batch_concurrency)

        async def one(i: int) -> None:
            async with sem:
                try:
                    results[i] = (await self.create(who, items[i], placement=placements[i]), None)
                except DSecError as err:
                    results[i] = (None, err)

        await asyncio.gather(*(one(i) for i in valid))
        return results

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
        stub = await self.edge_for(who, sandbox_id)
        try:
            resp = await downstream(
                stub.GetSandbox(
                    edge_pb2.GetSandboxRequest(sandbox_id=sandbox_id), timeout=DEFAULT_DEADLINE_S
                ),
                "edge",
            )
        except SandboxNotFound:
            self.owners.drop(sandbox_id)
            raise
        return resp.sandbox

    async def fan_out(
        self, fn: Callable[[edge_pb2_grpc.EdgeServiceStub], Awaitable[Any]]
    ) -> list[Any]:
        """Calls every known edge; an unreachable edge is skipped (and logged), not fatal."""
        await self.edges.refresh()
        stubs = [self.edges.stub_for_address(a) for a in self.edges.addresses.values()]
        results = await asyncio.gather(
            *(downstream(fn(s), "edge") for s in stubs), return_exceptions=True
        )
        out = []
        for r in results:
            if isinstance(r, BaseException):
                if not isinstance(r, DSecError):
                    raise r
                log.warning("edge unreachable during fan-out: %s", r)
                continue
            out.append(r)
        return out
