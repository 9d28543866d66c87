"""Probes every registered edge on an interval, each with a timeout."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from common.channels import open_channel
from dsec.edge.v1 import edge_pb2, edge_pb2_grpc
from watcher.ledger import SandboxLedger
from watcher.reconciler import Reconciler
from watcher.view import ClusterView, EdgeEntry

log = logging.getLogger(__name__)


class Prober:
    def __init__(
        self,
        view: ClusterView,
        interval_s: float,
        timeout_s: float,
        reconciler: Reconciler | None = None,
        ledger: SandboxLedger | None = None,
    ) -> None:
        self.view = view
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.reconciler = reconciler
        self.ledger = ledger
        #: edge id -> ((address, incarnation), channel)
        self._channels: dict[str, tuple[tuple[str, str], grpc.aio.Channel]] = {}

    def stub(self, entry: EdgeEntry) -> edge_pb2_grpc.EdgeServiceStub:
        """The edge's stub over this watcher's one channel to it. A restarted edge (another
        incarnation) gets a new channel with a connection of its own: the old one may be
        waiting out gRPC's reconnect backoff (up to 2 s) from while the edge was down, which
        fails every probe of the edge that is back meanwhile (at once, with UNAVAILABLE)."""
        key = (entry.info.address, entry.incarnation)
        cached = self._channels.get(entry.edge_id)
        if cached is None or cached[0] != key:
            if cached is not None:
                asyncio.get_running_loop().create_task(cached[1].close())
            cached = (key, open_channel(key[0], "watcher", own_connection=True))
            self._channels[entry.edge_id] = cached
        return edge_pb2_grpc.EdgeServiceStub(cached[1])

    async def probe(self, edge_id: str) -> None:
        entry = self.view.edges.get(edge_id)
        if entry is None:
            return
        stub = self.stub(entry)
        with_ids = self.reconciler is not None and self.reconciler.wants_ids(edge_id)
        started_at = time.time()
        start = time.perf_counter()
        try:
            resp = await stub.GetNodeStatus(
                edge_pb2.GetNodeStatusRequest(include_sandbox_ids=with_ids),
                timeout=self.timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            self.view.probe_failed(
                edge_id, f"{exc.code().name}: {exc.details()}", started_at=started_at
            )
            return
        ended_at = time.time()
        skew = None
        if resp.HasField("as_of"):  # taken while the edge answered: within our round trip
            skew = resp.as_of.seconds + resp.as_of.nanos / 1e9 - (started_at + ended_at) / 2
        self.view.probe_ok(
            edge_id,
            resp.load,
            dict(resp.sandboxes_by_project),
            dict(resp.sandboxes_by_principal),
            dict(resp.sandboxes_by_task),
            resp.draining,
            (time.perf_counter() - start) * 1000,
            drain_reason=resp.drain_reason,
            clock_skew_s=skew,
            clock_skew_error_s=max(0.0, ended_at - started_at) / 2,
        )
        if with_ids and self.reconciler is not None:
            self.reconciler.report(edge_id, list(resp.live_sandbox_ids), started_at)
            if self.ledger is not None:
                as_of = resp.as_of.seconds + resp.as_of.nanos / 1e9
                self.ledger.retain(edge_id, resp.live_sandbox_ids, as_of)

    async def run(self) -> None:
        try:
            while True:
                started = time.monotonic()
                edges = list(self.view.edges)
                if edges:
                    await asyncio.gather(*(self.probe(e) for e in edges))
                for gone in set(self._channels) - set(self.view.edges):
                    await self._channels.pop(gone)[1].close()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self.view.probe_now.wait(),
                        max(0.0, self.interval_s - (time.monotonic() - started)),
                    )
                self.view.probe_now.clear()
        finally:
            for _, ch in self._channels.values():
                await ch.close()
