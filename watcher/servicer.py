"""gRPC adapter of the watcher."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from common.convert import ts
from common.ids import EDGE_ID
from dsec.types.v1 import types_pb2
from dsec.watcher.v1 import watcher_pb2
from libdsec.errors import AlreadyExists, InvalidArgument, NotFound
from watcher.ledger import Lost, SandboxLedger
from watcher.view import ClusterView, EdgeEntry


def edge_status_pb(e: EdgeEntry, ledger: SandboxLedger | None = None) -> watcher_pb2.EdgeStatus:
    return watcher_pb2.EdgeStatus(
        info=e.info,
        health=watcher_pb2.EdgeHealth.Value("EDGE_HEALTH_" + e.health),  # type: ignore[arg-type]
        load=e.load,
        last_probe_at=ts(e.last_probe_at or None),
        consecutive_failures=e.consecutive_failures,
        last_error=e.last_error,
        probe_latency_ms=e.probe_latency_ms,
        sandboxes_by_project=e.by_project,
        sandboxes_by_principal=e.by_principal,
        sandboxes_by_task=e.by_task,
        sandboxes_reported=ledger.reported(e.edge_id) if ledger is not None else 0,
        health_reason=e.health_reason,
        health_detail=e.health_detail,
        clock_skew_s=e.clock_skew_s,
        clock_skew_error_s=e.clock_skew_error_s,
        draining=e.draining,
        drain_reason=e.drain_reason,
    )


def snapshot_pb(
    view: ClusterView, ledger: SandboxLedger | None = None
) -> watcher_pb2.ClusterSnapshot:
    by_project, by_principal, by_task = view.totals()
    now = time.time()
    return watcher_pb2.ClusterSnapshot(
        version=view.version,
        edges=[
            edge_status_pb(e, ledger) for e in sorted(view.edges.values(), key=lambda e: e.edge_id)
        ],
        sandboxes_by_project=by_project,
        sandboxes_by_principal=by_principal,
        sandboxes_by_task=by_task,
        taken_at=ts(now),
        uptime_s=now - view.started_at,
    )


def lost_pb(lost: Lost) -> types_pb2.Sandbox:
    """A lost sandbox as callers see it: as its edge last reported it, TERMINATED (EDGE_LOST)."""
    out = types_pb2.Sandbox()
    out.CopyFrom(lost.reported.sandbox)
    out.state = types_pb2.SANDBOX_STATE_TERMINATED
    out.termination.CopyFrom(
        types_pb2.Termination(
            reason=types_pb2.TERMINATION_REASON_EDGE_LOST,
            message=f"edge {lost.edge_id} was lost (unreachable)",
            at=ts(lost.lost_at),
        )
    )
    return out


class WatcherServicer:
    def __init__(
        self, view: ClusterView, reregister_interval_s: int, ledger: SandboxLedger | None = None
    ) -> None:
        self.view = view
        self.reregister_interval_s = reregister_interval_s
        self.ledger = ledger or SandboxLedger(1.0, 0.0)
        #: Probes an edge now (the prober's): a registration taking a held id first checks
        #: that the holder still answers.
        self.confirm_holder: Callable[[str], Awaitable[None]] | None = None

    async def RegisterEdge(
        self, request: watcher_pb2.RegisterEdgeRequest, context: Any
    ) -> watcher_pb2.RegisterEdgeResponse:
        info = request.info
        if not EDGE_ID.match(info.edge_id):
            raise InvalidArgument(
                f'edge_id {info.edge_id!r} must match [a-z0-9]{{1,16}} and not be "queued" (reserved)'
            )
        if not info.address:
            raise InvalidArgument("address is required")
        holder = self.view.holder(info.edge_id, info.address, info.incarnation)
        if holder is not None and self.confirm_holder is not None:
            await self.confirm_holder(info.edge_id)
            holder = self.view.holder(info.edge_id, info.address, info.incarnation)
        if holder is not None:
            raise AlreadyExists(
                f"edge id {info.edge_id} is in use by the live edge at {holder.address} "
                f"(another process, answering its probes); this edge at {info.address} "
                "must take another id (DSEC_EDGE_ID)",
                reason="EDGE_ID_IN_USE",
                metadata={"edge": info.edge_id, "holder_address": holder.address},
            )
        sent_at = request.sent_at.ToNanoseconds() / 1e9 if request.HasField("sent_at") else None
        self.view.register(info.edge_id, info, info.incarnation, sent_at)
        return watcher_pb2.RegisterEdgeResponse(reregister_interval_s=self.reregister_interval_s)

    async def GetClusterSnapshot(
        self, request: watcher_pb2.GetClusterSnapshotRequest, context: Any
    ) -> watcher_pb2.GetClusterSnapshotResponse:
        return watcher_pb2.GetClusterSnapshotResponse(snapshot=snapshot_pb(self.view, self.ledger))

    async def WatchCluster(
        self, request: watcher_pb2.WatchClusterRequest, context: Any
    ) -> AsyncIterator[watcher_pb2.WatchClusterResponse]:
        interval = (request.keepalive_interval_ms or 5000) / 1000
        q = self.view.subscribe()
        try:
            yield watcher_pb2.WatchClusterResponse(
                snapshot=snapshot_pb(self.view, self.ledger), version=self.view.version
            )
            while True:
                try:
                    kind, payload = await asyncio.wait_for(q.get(), timeout=interval)
                except TimeoutError:
                    yield watcher_pb2.WatchClusterResponse(
                        keepalive=types_pb2.Keepalive(at=ts(time.time())), version=self.view.version
                    )
                    continue
                if kind == "removed":
                    yield watcher_pb2.WatchClusterResponse(
                        edge_removed=payload, version=self.view.version
                    )
                else:
                    yield watcher_pb2.WatchClusterResponse(
                        edge_changed=edge_status_pb(payload, self.ledger),
                        version=self.view.version,
                    )
        finally:
            self.view.unsubscribe(q)

    async def GetEdgeHealth(
        self, request: watcher_pb2.GetEdgeHealthRequest, context: Any
    ) -> watcher_pb2.GetEdgeHealthResponse:
        entry = self.view.edges.get(request.edge_id)
        if entry is None:
            raise NotFound(f"edge {request.edge_id} is not known", reason="EDGE_NOT_FOUND")
        return watcher_pb2.GetEdgeHealthResponse(status=edge_status_pb(entry, self.ledger))

    async def ListLostSandboxes(
        self, request: watcher_pb2.ListLostSandboxesRequest, context: Any
    ) -> watcher_pb2.ListLostSandboxesResponse:
        found = self.ledger.find(
            sandbox_ids=request.sandbox_ids,
            edge_id=request.edge_id,
            project_prefix=request.project_prefix,
            task_id=request.task_id,
            labels=dict(request.label_selector),
        )
        return watcher_pb2.ListLostSandboxesResponse(
            sandboxes=[lost_pb(lost) for lost in found],
            lost_edge_ids=sorted(self.ledger.lost_edges),
        )
