"""gRPC adapter of placement."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from dsec.placement.v1 import placement_pb2
from dsec.types.v1 import types_pb2
from libdsec.errors import DSecError, Unavailable
from placement.follower import SnapshotFollower
from placement.policy import Placer, Request


def _request(item: placement_pb2.PlacementItem) -> Request:
    spec = item.spec
    backend = (
        types_pb2.Backend.Name(spec.backend).removeprefix("BACKEND_")
        if spec.backend
        else "CONTAINER"
    )
    return Request(
        backend=backend,
        cpu_millis=spec.resources.cpu_millis or 1000,
        memory_mb=spec.resources.memory_mb or 512,
        gpu_count=spec.resources.gpu_count,
        node_selector=dict(spec.node_selector),
        exclude=frozenset(item.exclude_edges),
    )


class PlacementServicer:
    def __init__(self, placer: Placer, follower: SnapshotFollower, max_age_s: float) -> None:
        self.placer = placer
        self.follower = follower
        self.max_age_s = max_age_s

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

    def _place(self, item: placement_pb2.PlacementItem) -> placement_pb2.Placement:
        try:
            cands = self.placer.place(_request(item))
        except DSecError as err:
            return placement_pb2.Placement(
                error_code=err.code.value[0], error_reason=err.reason, error_message=err.message
            )
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

    async def ReportOutcome(
        self, request: placement_pb2.ReportOutcomeRequest, context: Any
    ) -> placement_pb2.ReportOutcomeResponse:
        if request.outcome in (placement_pb2.OUTCOME_REJECTED, placement_pb2.OUTCOME_UNREACHABLE):
            self.placer.forget(request.edge_id, request.cpu_millis, request.memory_mb)
        return placement_pb2.ReportOutcomeResponse()
