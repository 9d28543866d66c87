"""Keeps the ledger (watcher/ledger.py): polls each edge for what it holds, declares gone edges
lost, and stops what a lost edge still runs when it comes back.

A poll is an ``EdgeService/WatchSandboxes`` with ``replay_only``: the sandboxes created,
started or ended since the previous poll (by the edge's clock), in batches, then the keepalive
whose ``at`` starts the next one; the first poll (and one after a gap) asks for every live
sandbox; as summaries (``summary``: identity, owner, state, times, task, labels: what a lost
sandbox is reported with). Per sandbox that is one summary when it appears and one when it
ends, in batches, off the create path (a stream following every change would cost the edge a
message per change).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from dsec.edge.v1 import edge_pb2
from dsec.types.v1 import types_pb2
from watcher.ledger import Reported, SandboxLedger
from watcher.prober import Prober
from watcher.view import ClusterView

log = logging.getLogger(__name__)

LIVE_STATES = [
    types_pb2.SANDBOX_STATE_PENDING,
    types_pb2.SANDBOX_STATE_STARTING,
    types_pb2.SANDBOX_STATE_RUNNING,
    types_pb2.SANDBOX_STATE_PAUSED,
    types_pb2.SANDBOX_STATE_STOPPING,
]
#: A full poll of a big edge converts every live sandbox (~20 us each: 1 s for 50,000).
POLL_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 30.0


def seconds(value: object) -> float:
    return value.seconds + value.nanos / 1e9  # type: ignore[attr-defined, no-any-return]


def reported(sb: types_pb2.Sandbox) -> Reported:
    return Reported(
        sandbox_id=sb.id,
        project_id=sb.project_id,
        task_id=sb.spec.task_id,
        labels=dict(sb.spec.labels),
        created_at=seconds(sb.created_at),
        terminated=sb.state == types_pb2.SANDBOX_STATE_TERMINATED,
        sandbox=sb,
    )


class SandboxPoller:
    def __init__(
        self, view: ClusterView, ledger: SandboxLedger, prober: Prober, *, gone_after_s: float
    ) -> None:
        self.view = view
        self.ledger = ledger
        self.prober = prober
        self.gone_after_s = gone_after_s
        #: per edge, its poll (and stop of survivors) in flight: a slow edge holds no other back
        self._busy: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        try:
            while True:
                started = time.monotonic()
                await self.round()
                await asyncio.sleep(
                    max(0.0, self.ledger.poll_interval_s - (time.monotonic() - started))
                )
        finally:
            for task in self._busy.values():
                task.cancel()
            await asyncio.gather(*self._busy.values(), return_exceptions=True)

    async def round(self) -> None:
        now = time.time()
        self.ledger.expire(now)
        gone = set(self.view.gone(self.gone_after_s, now))
        forgotten = set(self.ledger.edges) - set(self.view.edges)
        for edge_id in sorted(gone | forgotten):
            if not self.ledger.is_declared(edge_id):
                n = self.ledger.declare_lost(edge_id, now)
                log.warning(
                    "edge %s is lost: %d sandboxes it last reported are TERMINATED (EDGE_LOST)",
                    edge_id,
                    n,
                    extra={"edge_id": edge_id, "lost": n},
                )
            if edge_id in forgotten:
                self.ledger.forget_edge(edge_id)
        answering = [
            e.edge_id
            for e in self.view.edges.values()
            if not e.probes_failing and e.edge_id not in gone
        ]
        for edge_id in answering:
            if self.ledger.is_declared(edge_id):
                self.ledger.back(edge_id)
                log.warning("lost edge %s answers again", edge_id, extra={"edge_id": edge_id})
        for edge_id, task in list(self._busy.items()):
            if edge_id not in answering:
                task.cancel()  # a poll of an edge that stopped answering: it would only hang
            if task.done():
                del self._busy[edge_id]
                if not task.cancelled() and task.exception() is not None:
                    log.error("poll of edge %s failed", edge_id, exc_info=task.exception())
        for edge_id in answering:
            if edge_id not in self._busy and (
                self.ledger.wants_poll(edge_id) or self.ledger.has_survivors(edge_id)
            ):
                self._busy[edge_id] = asyncio.create_task(self._visit(edge_id))

    async def _visit(self, edge_id: str) -> None:
        if self.ledger.wants_poll(edge_id):
            await self.poll(edge_id)
        await self.stop_survivors(edge_id)

    async def poll(self, edge_id: str) -> None:
        entry = self.view.edges.get(edge_id)
        if entry is None:
            return
        stub = self.prober.stub(entry)
        since = self.ledger.poll_since(edge_id)
        request = edge_pb2.WatchSandboxesRequest(replay_only=True, summary=True)
        if since is None:
            request.changed_since.FromSeconds(0)  # epoch: everything live
            request.states.extend(LIVE_STATES)
        else:
            request.changed_since.CopyFrom(since)
        got: list[Reported] = []
        at = None
        try:
            async for msg in stub.WatchSandboxes(request, timeout=POLL_TIMEOUT_S):
                if msg.HasField("replayed"):
                    got.extend(reported(sb) for sb in msg.replayed.sandboxes)
                elif msg.HasField("keepalive"):
                    at = msg.keepalive.at
        except grpc.aio.AioRpcError as exc:
            log.info("poll of edge %s failed: %s", edge_id, exc.code().name)
            return
        if at is not None:
            self.ledger.polled(edge_id, got, at, seconds(at), full=since is None)

    async def stop_survivors(self, edge_id: str) -> None:
        """What a returned lost edge still runs is stopped, with the reason callers were told."""
        ids = self.ledger.survivors(edge_id)
        entry = self.view.edges.get(edge_id)
        if not ids or entry is None:
            return
        stub = self.prober.stub(entry)
        log.warning(
            "stopping %d sandboxes that lost edge %s still runs",
            len(ids),
            edge_id,
            extra={"edge_id": edge_id},
        )

        async def stop(sid: str) -> None:
            try:
                await stub.StopSandbox(
                    edge_pb2.StopSandboxRequest(
                        sandbox_id=sid, reason=types_pb2.TERMINATION_REASON_EDGE_LOST
                    ),
                    timeout=STOP_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as exc:  # asked again later (RESTOP_AFTER_S)
                log.warning("stop of %s on edge %s failed: %s", sid, edge_id, exc.code().name)

        await asyncio.gather(*(stop(s) for s in ids))
