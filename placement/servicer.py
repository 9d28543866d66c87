"""gRPC adapter of placement."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from grpc_health.v1 import health_pb2

from common.config import WATCHER_WARMUP_S
from common.convert import enum_name
from common.metrics import Metrics
from dsec.placement.v1 import placement_pb2
from dsec.types.v1 import types_pb2
from libdsec.errors import DSecError, InvalidArgument, Unavailable, item_status
from placement.follower import SnapshotFollower
from placement.policy import Placer, Request

log = logging.getLogger(__name__)


def log_view_change(before: str, after: str, age_s: float) -> None:
    level = logging.INFO if after == "FRESH" else logging.WARNING
    log.log(
        level,
        "cluster view %s -> %s (last watcher message %.1f s ago)",
        before,
        after,
        age_s,
        extra={"view_state": after},
    )


def _request(item: placement_pb2.PlacementItem) -> Request:
    spec = item.spec
    backend = (
        enum_name(types_pb2.Backend, spec.backend, "spec.backend", "BACKEND_")
        if spec.backend
        else "CONTAINER"
    )
    # What an edge's warm sandboxes can serve (edge/backends/warm.py: no toolkit layers, no network
    # policy, no disk quota): such a create prefers an edge that has one of its image ready.
    warm_image = (
        spec.image
        if backend == "CONTAINER"
        and spec.image
        and not spec.toolkits
        and not spec.network.ByteSize()
        and not spec.resources.disk_mb
        and not spec.resources.gpu_count
        else ""
    )
    return Request(
        backend=backend,
        cpu_millis=spec.resources.cpu_millis or 1000,
        memory_mb=spec.resources.memory_mb or 512,
        gpu_count=spec.resources.gpu_count,
        node_selector=dict(spec.node_selector),
        exclude=frozenset(item.exclude_edges),
        warm_image=warm_image,
    )


#: Health service name whose status tells operators whether the view is fresh.
VIEW_HEALTH = "dsec.placement.v1.ClusterView"

#: Sandboxes per PlaceSandboxGroups call.
MAX_GROUP_TOTAL = 100_000


class PlacementServicer:
    def __init__(
        self,
        placer: Placer,
        follower: SnapshotFollower,
        max_age_s: float,
        warmup_s: float = WATCHER_WARMUP_S,
        metrics: Metrics | None = None,
    ) -> None:
        #: Every item placed or refused (and why), counted when the service has metrics.
        self.decisions = (
            metrics.meter.create_counter(
                "dsec_placement_decisions",
                description="Items placed or refused, by outcome and reason",
            )
            if metrics is not None
            else None
        )
        self.placer = placer
        self.follower = follower
        self.max_age_s = max_age_s
        self.warmup_s = warmup_s

    def view_state(self) -> str:
        return self.follower.view_state(self.max_age_s)

    async def _check_view(self) -> None:
        if not self.follower.has_view.is_set():
            # Just started: the first snapshot is normally milliseconds away.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.follower.has_view.wait(), timeout=5.0)
        if self.follower.age_s > self.max_age_s:
            raise Unavailable(
                f"no cluster view from the watcher for {self.follower.age_s:.0f} s",
                reason="CLUSTER_VIEW_STALE",
            )
        uptime = self.follower.watcher_uptime_s
        if not self.placer.edges and uptime < self.warmup_s:
            # A watcher that just (re)started knows no edge until they register again
            # (every few seconds): "not yet", which callers retry, not "none".
            raise Unavailable(
                f"the watcher started {uptime:.1f} s ago and no edge has registered with it yet",
                reason="CLUSTER_VIEW_WARMING",
            )

    def _place(self, item: placement_pb2.PlacementItem) -> placement_pb2.Placement:
        try:
            cands = self.placer.place(_request(item))
        except DSecError as err:
            self._count(0, err)
            return placement_pb2.Placement(error=item_status(err))
        self._count(1, None)
        return placement_pb2.Placement(
            candidates=[
                placement_pb2.Candidate(edge_id=c.edge_id, address=c.address, cloud=c.cloud)
                for c in cands
            ]
        )

    async def PlaceSandbox(
        self, request: placement_pb2.PlaceSandboxRequest, context: Any
    ) -> placement_pb2.PlaceSandboxResponse:
        await self._check_view()
        return placement_pb2.PlaceSandboxResponse(placement=self._place(request.item))

    async def PlaceSandboxes(
        self, request: placement_pb2.PlaceSandboxesRequest, context: Any
    ) -> placement_pb2.PlaceSandboxesResponse:
        await self._check_view()
        return placement_pb2.PlaceSandboxesResponse(
            placements=[self._place(i) for i in request.items]
        )

    async def PlaceSandboxGroups(
        self, request: placement_pb2.PlaceSandboxGroupsRequest, context: Any
    ) -> placement_pb2.PlaceSandboxGroupsResponse:
        if sum(g.count for g in request.groups) > MAX_GROUP_TOTAL:
            raise InvalidArgument(f"at most {MAX_GROUP_TOTAL} sandboxes per call")
        await self._check_view()
        resp = placement_pb2.PlaceSandboxGroupsResponse()
        table: dict[str, int] = {}
        for group in request.groups:
            cands, chosen, err = self.placer.place_group(
                _request(group.item), group.count, group.clump
            )
            mapping = []
            for c in cands:
                i = table.get(c.edge_id)
                if i is None:
                    i = table[c.edge_id] = len(resp.edges)
                    resp.edges.add(edge_id=c.edge_id, address=c.address, cloud=c.cloud)
                mapping.append(i)
            gp = resp.placements.add()
            gp.edge_indexes.extend([mapping[i] for i in chosen])
            if err is not None:
                item_status(err, gp.error)
            self._count(len(chosen), err, group.count - len(chosen))
        return resp

    def _count(self, placed: int, err: DSecError | None, refused: int = 1) -> None:
        """``placed`` items placed, and ``refused`` refused with ``err`` (None: none)."""
        if self.decisions is None:
            return
        if placed:
            self.decisions.add(placed, {"outcome": "placed", "reason": ""})
        if err is not None and refused > 0:
            self.decisions.add(refused, {"outcome": "refused", "reason": err.reason})

    async def GetPlacementStatus(
        self, request: placement_pb2.GetPlacementStatusRequest, context: Any
    ) -> placement_pb2.GetPlacementStatusResponse:
        edges = self.placer.edges.values()
        age = self.follower.age_s
        return placement_pb2.GetPlacementStatusResponse(
            view_state=placement_pb2.ViewState.Value("VIEW_STATE_" + self.view_state()),  # type: ignore[arg-type]
            watcher_connected=self.follower.connected,
            view_age_s=-1.0 if age == float("inf") else age,
            snapshot_max_age_s=self.max_age_s,
            edges=len(edges),
            healthy_edges=sum(1 for e in edges if e.healthy),
            overlay_entries=self.placer.overlay_entries(),
            placed_total=self.placer.placed_total,
        )

    async def report_view_health(self, health: Any, interval_s: float = 0.5) -> None:
        """Keeps the health of VIEW_HEALTH in step with the view: SERVING only when FRESH."""
        last = None
        while True:
            state = self.view_state()
            if state != last:
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if state == "FRESH"
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                await health.set(VIEW_HEALTH, status)
                if last is not None:
                    log_view_change(last, state, self.follower.age_s)
                last = state
            await asyncio.sleep(interval_s)

    async def ReportOutcome(
        self, request: placement_pb2.ReportOutcomeRequest, context: Any
    ) -> placement_pb2.ReportOutcomeResponse:
        if request.outcome in (
            placement_pb2.OUTCOME_REJECTED,
            placement_pb2.OUTCOME_UNREACHABLE,
            placement_pb2.OUTCOME_UNUSED,
        ):
            self.placer.forget(
                request.edge_id, request.cpu_millis, request.memory_mb, request.count or 1
            )
        return placement_pb2.ReportOutcomeResponse()
