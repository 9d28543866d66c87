"""Keeps the placer's view current from the watcher's change stream."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common.channels import open_channel
from common.convert import from_ts
from dsec.types.v1 import types_pb2
from dsec.watcher.v1 import watcher_pb2, watcher_pb2_grpc
from placement.policy import EdgeView, Placer

log = logging.getLogger(__name__)

#: The watcher sends a keepalive this often on a quiet stream.
KEEPALIVE_S = 2.0
_KNOWN_BACKENDS = frozenset(types_pb2.Backend.values())


def edge_view(status: watcher_pb2.EdgeStatus) -> EdgeView:
    info, load = status.info, status.load
    return EdgeView(
        edge_id=info.edge_id,
        address=info.address,
        # A number this build does not know (a newer edge's backend, or a registration
        # nobody validated) is a backend no request can name: skipped, not a crashed loop.
        backends=frozenset(
            types_pb2.Backend.Name(b).removeprefix("BACKEND_")
            for b in info.backends
            if b in _KNOWN_BACKENDS
        ),
        labels=dict(info.labels),
        healthy=status.health == watcher_pb2.EDGE_HEALTH_HEALTHY,
        cpu_allocated=load.cpu_millis_allocated,
        cpu_capacity=load.cpu_millis_capacity or info.cpu_millis_capacity,
        memory_allocated=load.memory_mb_allocated,
        memory_capacity=load.memory_mb_capacity or info.memory_mb_capacity,
        gpus_free=load.gpus_free if status.HasField("load") else info.gpu_count,
        sandboxes=load.sandboxes,
        probed_at=from_ts(status.last_probe_at) or 0.0,
        warm=dict(load.warm_ready),
        health_reason=status.health_reason,
    )


class SnapshotFollower:
    def __init__(self, placer: Placer, watcher: str) -> None:
        self.placer = placer
        self.watcher = watcher
        self.last_update = 0.0  # monotonic time of the last message from the watcher
        self.connected = False
        self.has_view = asyncio.Event()  # set by the first snapshot
        #: monotonic time the watcher of the last snapshot started (its uptime_s)
        self.watcher_started = 0.0

    @property
    def age_s(self) -> float:
        return time.monotonic() - self.last_update if self.last_update else float("inf")

    @property
    def watcher_uptime_s(self) -> float:
        """How long the watcher behind the view has been up (inf before a snapshot)."""
        return time.monotonic() - self.watcher_started if self.has_view.is_set() else float("inf")

    def view_state(self, max_age_s: float) -> str:
        """FRESH (following the watcher), DEGRADED (watcher lost: placing on the
        last snapshot) or STALE (no snapshot, or older than ``max_age_s``)."""
        age = self.age_s
        if age > max_age_s:
            return "STALE"
        # Keepalives come every KEEPALIVE_S: three missed ones mean the watcher is gone
        # even if the stream has not failed yet (a hung watcher).
        if not self.connected or age > 3 * KEEPALIVE_S:
            return "DEGRADED"
        return "FRESH"

    async def run(self) -> None:
        channel = open_channel(self.watcher, "placement")
        stub = watcher_pb2_grpc.WatcherServiceStub(channel)
        try:
            while True:
                try:
                    stream = stub.WatchCluster(
                        watcher_pb2.WatchClusterRequest(
                            keepalive_interval_ms=int(KEEPALIVE_S * 1000)
                        )
                    )
                    async for msg in stream:
                        self._apply(msg)
                except grpc.aio.AioRpcError as exc:
                    if self.connected:
                        log.warning(
                            "watcher stream lost (%s); keeping the last snapshot", exc.code().name
                        )
                    self.connected = False
                await asyncio.sleep(0.5)
        finally:
            await channel.close()

    def _apply(self, msg: watcher_pb2.WatchClusterResponse) -> None:
        self.last_update = time.monotonic()
        self.connected = True
        kind = msg.WhichOneof("event")
        if kind == "snapshot":
            self.watcher_started = self.last_update - msg.snapshot.uptime_s
            self.placer.update([edge_view(e) for e in msg.snapshot.edges])
            self.has_view.set()
        elif kind == "edge_changed":
            self.placer.update_edge(edge_view(msg.edge_changed))
        elif kind == "edge_removed":
            self.placer.remove_edge(msg.edge_removed)
