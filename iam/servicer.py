"""gRPC adapter of IAM: proto in -> domain call -> proto out."""

from __future__ import annotations

import time
from typing import Any

from common.auth import bearer_token
from common.convert import enum_name, from_ts, ts
from dsec.iam.v1 import iam_pb2
from dsec.types.v1 import types_pb2
from iam.domain import Iam, Principal
from iam.store import ProjectRecord, QueueRow, Quota, Reservation, TokenRecord
from libdsec.errors import InvalidArgument, item_status

#: Items per ReserveQuotas call.
MAX_BATCH = 100_000


#: The largest weight a project may have in the create queue's fair share.
MAX_SHARE_WEIGHT = 1000.0


def quota_from_pb(q: iam_pb2.Quota) -> Quota:
    w = q.share_weight
    if not (w == 0 or 0.001 <= w <= MAX_SHARE_WEIGHT):  # NaN fails both
        raise InvalidArgument(
            f"quota.share_weight={w} must be 0 (= 1) or in 0.001..{MAX_SHARE_WEIGHT:g}",
            reason="INVALID_SHARE_WEIGHT",
        )
    return Quota(q.cpu_millis, q.memory_mb, q.sandboxes, dict(q.sandboxes_by_backend), w)


def project_pb(rec: ProjectRecord) -> iam_pb2.Project:
    return iam_pb2.Project(
        project_id=rec.project_id,
        parent_id=rec.parent_id,
        quota=iam_pb2.Quota(
            cpu_millis=rec.quota.cpu_millis,
            memory_mb=rec.quota.memory_mb,
            sandboxes=rec.quota.sandboxes,
            sandboxes_by_backend=rec.quota.sandboxes_by_backend,
            share_weight=rec.quota.share_weight,
        ),
        usage=iam_pb2.Usage(
            cpu_millis=rec.usage.cpu_millis,
            memory_mb=rec.usage.memory_mb,
            sandboxes=rec.usage.sandboxes,
            sandboxes_by_backend=rec.usage.sandboxes_by_backend,
        ),
        created_at=ts(rec.created_at),
    )


def token_pb(rec: TokenRecord) -> iam_pb2.TokenInfo:
    return iam_pb2.TokenInfo(
        token_id=rec.token_id,
        name=rec.name,
        project_id=rec.project_id,
        kind=rec.kind,  # type: ignore[arg-type]
        role=rec.role,  # type: ignore[arg-type]
        created_at=ts(rec.created_at),
        expires_at=ts(rec.expires_at),
        revoked=rec.revoked,
    )


def principal_pb(p: Principal) -> iam_pb2.Principal:
    return iam_pb2.Principal(
        principal_id=p.principal_id,
        name=p.name,
        kind=p.kind,  # type: ignore[arg-type]
        role=p.role,  # type: ignore[arg-type]
        project_id=p.project_id,
        expires_at=ts(p.expires_at),
    )


def _entries(rows: list[QueueRow]) -> list[iam_pb2.QueueEntry]:
    out = []
    for row in rows:
        e = iam_pb2.QueueEntry.FromString(row.body)
        e.seq, e.state, e.ended_at = row.seq, row.state, row.ended_at  # type: ignore[assignment]
        out.append(e)
    return out


class IamServicer:
    def __init__(self, iam: Iam, cache_ttl_s: int) -> None:
        self.iam = iam
        self.cache_ttl_s = cache_ttl_s

    async def _caller(self, context: Any) -> Principal:
        return await self.iam.authenticate(bearer_token(context))

    async def Authenticate(
        self, request: iam_pb2.AuthenticateRequest, context: Any
    ) -> iam_pb2.AuthenticateResponse:
        who = await self.iam.authenticate(request.token)
        return iam_pb2.AuthenticateResponse(
            principal=principal_pb(who), cache_ttl_s=self.cache_ttl_s
        )

    async def Authorize(
        self, request: iam_pb2.AuthorizeRequest, context: Any
    ) -> iam_pb2.AuthorizeResponse:
        rec = await self.iam._run(self.iam.store.get_token, request.principal_id)
        if rec is None or rec.revoked:
            return iam_pb2.AuthorizeResponse(allowed=False, reason="unknown or revoked principal")
        who = Principal(rec.token_id, rec.name, rec.kind, rec.role, rec.project_id, rec.expires_at)
        ok, why = self.iam.authorize(who, request.action, request.project_id)
        return iam_pb2.AuthorizeResponse(allowed=ok, reason=why)

    async def CreateProject(
        self, request: iam_pb2.CreateProjectRequest, context: Any
    ) -> iam_pb2.CreateProjectResponse:
        who = await self._caller(context)
        rec = await self.iam.create_project(
            who,
            request.parent_id,
            request.name,
            quota_from_pb(request.quota),
            exist_ok=request.exist_ok,
        )
        return iam_pb2.CreateProjectResponse(project=project_pb(rec))

    async def GetProject(
        self, request: iam_pb2.GetProjectRequest, context: Any
    ) -> iam_pb2.GetProjectResponse:
        who = await self._caller(context)
        return iam_pb2.GetProjectResponse(
            project=project_pb(await self.iam.get_project(who, request.project_id))
        )

    async def ListProjects(
        self, request: iam_pb2.ListProjectsRequest, context: Any
    ) -> iam_pb2.ListProjectsResponse:
        who = await self._caller(context)
        recs = await self.iam.list_projects(who, request.parent_id, request.recursive)
        return iam_pb2.ListProjectsResponse(projects=[project_pb(r) for r in recs])

    async def SetQuota(
        self, request: iam_pb2.SetQuotaRequest, context: Any
    ) -> iam_pb2.SetQuotaResponse:
        who = await self._caller(context)
        if not request.project_id:
            raise InvalidArgument("project_id is required")
        rec = await self.iam.set_quota(who, request.project_id, quota_from_pb(request.quota))
        return iam_pb2.SetQuotaResponse(project=project_pb(rec))

    async def DeleteProject(
        self, request: iam_pb2.DeleteProjectRequest, context: Any
    ) -> iam_pb2.DeleteProjectResponse:
        who = await self._caller(context)
        if not request.project_id:
            raise InvalidArgument("project_id is required")
        await self.iam.delete_project(who, request.project_id)
        return iam_pb2.DeleteProjectResponse()

    async def CreateToken(
        self, request: iam_pb2.CreateTokenRequest, context: Any
    ) -> iam_pb2.CreateTokenResponse:
        who = await self._caller(context)
        token, rec = await self.iam.create_token(
            who,
            request.project_id,
            request.name,
            request.kind,
            request.role,
            request.ttl_s,
            request.e2b_format,
        )
        return iam_pb2.CreateTokenResponse(info=token_pb(rec), token=token)

    async def ListTokens(
        self, request: iam_pb2.ListTokensRequest, context: Any
    ) -> iam_pb2.ListTokensResponse:
        who = await self._caller(context)
        recs = await self.iam.list_tokens(who, request.project_id, request.include_revoked)
        return iam_pb2.ListTokensResponse(tokens=[token_pb(r) for r in recs])

    async def RevokeToken(
        self, request: iam_pb2.RevokeTokenRequest, context: Any
    ) -> iam_pb2.RevokeTokenResponse:
        who = await self._caller(context)
        await self.iam.revoke_token(who, request.token_id)
        return iam_pb2.RevokeTokenResponse()

    async def ReserveQuota(
        self, request: iam_pb2.ReserveQuotaRequest, context: Any
    ) -> iam_pb2.ReserveQuotaResponse:
        if not request.sandbox_id or not request.project_id:
            raise InvalidArgument("sandbox_id and project_id are required")
        out = await self.iam.reserve(
            Reservation(
                request.sandbox_id,
                request.project_id,
                enum_name(types_pb2.Backend, request.backend, "backend"),
                request.cpu_millis,
                request.memory_mb,
                request.edge_id,
                request.idempotency_key,
                request.replaces_sandbox_id,
            )
        )
        if out.error is not None:
            raise out.error
        return iam_pb2.ReserveQuotaResponse(
            already_reserved=out.already_reserved,
            existing_sandbox_id=out.existing_sandbox_id,
            existing_reserved=out.existing_reserved,
        )

    async def ReserveQuotas(
        self, request: iam_pb2.ReserveQuotasRequest, context: Any
    ) -> iam_pb2.ReserveQuotasResponse:
        if len(request.items) > MAX_BATCH:
            raise InvalidArgument(f"at most {MAX_BATCH} items per ReserveQuotas call")
        items = []
        backends: dict[int, str] = {}  # a burst names one or two backends, thousands of times
        for it in request.items:
            if not it.sandbox_id or not it.project_id:
                raise InvalidArgument("every item needs sandbox_id and project_id")
            backend = backends.get(it.backend)
            if backend is None:
                backend = backends[it.backend] = enum_name(
                    types_pb2.Backend, it.backend, "items.backend"
                )
            items.append(
                Reservation(
                    it.sandbox_id,
                    it.project_id,
                    backend,
                    it.cpu_millis,
                    it.memory_mb,
                    it.edge_id,
                    it.idempotency_key,
                    it.replaces_sandbox_id,
                )
            )
        outcomes = await self.iam.reserve_many(items)
        resp = iam_pb2.ReserveQuotasResponse()
        reserved = 0
        for i, out in enumerate(outcomes):
            if out.reserved:
                reserved += 1
                continue
            r = resp.results.add(
                index=i,
                already_reserved=out.already_reserved,
                existing_sandbox_id=out.existing_sandbox_id,
                existing_reserved=out.existing_reserved,
            )
            if out.error is not None:
                item_status(out.error, r.error)
        resp.reserved = reserved
        return resp

    async def ReleaseQuota(
        self, request: iam_pb2.ReleaseQuotaRequest, context: Any
    ) -> iam_pb2.ReleaseQuotaResponse:
        return iam_pb2.ReleaseQuotaResponse(
            released=await self.iam.release(list(request.sandbox_ids), request.not_created)
        )

    async def ListReservedEdges(
        self, request: iam_pb2.ListReservedEdgesRequest, context: Any
    ) -> iam_pb2.ListReservedEdgesResponse:
        return iam_pb2.ListReservedEdgesResponse(
            reservations_by_edge=await self.iam.reserved_edges()
        )

    async def ReconcileQuota(
        self, request: iam_pb2.ReconcileQuotaRequest, context: Any
    ) -> iam_pb2.ReconcileQuotaResponse:
        if not request.edge_id:
            raise InvalidArgument("edge_id is required")
        as_of = from_ts(request.as_of) or 0.0
        n = await self.iam.reconcile(request.edge_id, set(request.live_sandbox_ids), as_of)
        return iam_pb2.ReconcileQuotaResponse(released=n)

    # -------------------------------------------------------------- queue

    async def Enqueue(
        self, request: iam_pb2.EnqueueRequest, context: Any
    ) -> iam_pb2.EnqueueResponse:
        if len(request.entries) > MAX_BATCH:
            raise InvalidArgument(f"at most {MAX_BATCH} entries per Enqueue call")
        now = time.time()
        rows = []
        for e in request.entries:
            if not e.queue_id or not e.project_id:
                raise InvalidArgument("every entry needs queue_id and project_id")
            e.state = iam_pb2.QUEUE_STATE_WAITING
            e.enqueued_at = e.enqueued_at or now
            rows.append(
                QueueRow(
                    e.queue_id,
                    e.project_id,
                    e.idempotency_key,
                    e.state,
                    0,
                    e.SerializeToString(),
                )
            )
        return iam_pb2.EnqueueResponse(entries=_entries(await self.iam.queue_add(rows)))

    async def GetQueued(
        self, request: iam_pb2.GetQueuedRequest, context: Any
    ) -> iam_pb2.GetQueuedResponse:
        if request.queue_ids:
            rows = await self.iam.queue_get(list(request.queue_ids))
            if request.waiting_only:
                rows = [r for r in rows if r.state == iam_pb2.QUEUE_STATE_WAITING]
            elif request.ended_only:
                rows = [r for r in rows if r.state != iam_pb2.QUEUE_STATE_WAITING]
        else:
            rows = await self.iam.queue_list(request.project_prefix, request.waiting_only)
            if request.waiting_only:
                in_use, weights = await self.iam.queue_shares({r.project_id for r in rows})
                return iam_pb2.GetQueuedResponse(
                    entries=_entries(rows), in_use=in_use, share_weight=weights
                )
        return iam_pb2.GetQueuedResponse(entries=_entries(rows))

    async def UpdateQueued(
        self, request: iam_pb2.UpdateQueuedRequest, context: Any
    ) -> iam_pb2.UpdateQueuedResponse:
        by_id: dict[str, iam_pb2.QueueUpdate] = {}
        for u in request.updates:
            if not u.queue_id:
                raise InvalidArgument("every update needs queue_id")
            enum_name(iam_pb2.QueueState, u.state, "updates.state")
            if u.state == iam_pb2.QUEUE_STATE_WAITING:
                raise InvalidArgument("an entry cannot be put back to WAITING", reason="BAD_STATE")
            if u.state == iam_pb2.QUEUE_STATE_PLACED and not u.placed_sandbox_id:
                raise InvalidArgument("a PLACED update needs placed_sandbox_id")
            by_id[u.queue_id] = u
        now = time.time()

        def change(row: QueueRow) -> QueueRow | None:
            """Only a waiting entry changes: the first end (placed, cancelled, timed out,
            failed) wins, and a later one is answered with the entry as it ended."""
            if row.state != iam_pb2.QUEUE_STATE_WAITING:
                return None
            u = by_id[row.queue_id]
            e = iam_pb2.QueueEntry.FromString(row.body)
            if u.reason:
                e.reason = u.reason
            if u.state:
                e.state = u.state
                e.placed_sandbox_id = u.placed_sandbox_id
                e.error.CopyFrom(u.error)
                e.ended_at = now
            return QueueRow(
                row.queue_id,
                row.project_id,
                row.key,
                e.state,
                row.seq,
                e.SerializeToString(),
                e.ended_at,
            )

        rows = await self.iam.queue_update(list(by_id), change)
        return iam_pb2.UpdateQueuedResponse(entries=_entries(rows))

    async def AcquireLease(
        self, request: iam_pb2.AcquireLeaseRequest, context: Any
    ) -> iam_pb2.AcquireLeaseResponse:
        if not request.name or not request.holder:
            raise InvalidArgument("name and holder are required")
        if not 0.1 <= request.ttl_s <= 600:  # NaN fails too
            raise InvalidArgument(f"ttl_s={request.ttl_s} must be in 0.1..600")
        held, holder = await self.iam.lease(request.name, request.holder, request.ttl_s)
        return iam_pb2.AcquireLeaseResponse(held=held, holder=holder)

    async def GetUsage(
        self, request: iam_pb2.GetUsageRequest, context: Any
    ) -> iam_pb2.GetUsageResponse:
        who = await self._caller(context)
        p = project_pb(await self.iam.get_project(who, request.project_id))
        return iam_pb2.GetUsageResponse(usage=p.usage, quota=p.quota)
