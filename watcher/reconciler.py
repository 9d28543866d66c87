"""Quota reconciliation: IAM's reservations against what the edges report.

Edges release the quota of sandboxes that end on them, but a release can be
lost (an edge killed before it told IAM, an API server that died between the
reservation and the edge call). So, per edge:

- alive: every ``interval_s`` the prober fetches the edge's live sandbox ids;
  IAM releases that edge's reservations made before ``probe time - grace_s``
  that the edge no longer reports (a younger one may still be on its way);
- gone (UNHEALTHY for ``gone_after_s``, or holding reservations while unknown
  to this watcher for that long, e.g. killed while the watcher was down):
  IAM releases every reservation on it older than ``grace_s``.

Nothing is kept durably: after a restart, a still-dead edge is found again
through IAM's list of edges holding reservations.
"""

from __future__ import annotations

import asyncio
import logging
import time

from common.channels import DEFAULT_DEADLINE_S, open_channel
from common.convert import ts
from dsec.iam.v1 import iam_pb2, iam_pb2_grpc
from watcher.view import ClusterView

log = logging.getLogger(__name__)


class Reconciler:
    def __init__(
        self,
        view: ClusterView,
        iam_target: str,
        *,
        interval_s: float,
        grace_s: float,
        gone_after_s: float,
    ) -> None:
        self.view = view
        self.iam_target = iam_target
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.gone_after_s = gone_after_s
        #: edge id -> (live sandbox ids, wall time the probe started), filled by the prober.
        self.reports: dict[str, tuple[list[str], float]] = {}
        self._last_fetch: dict[str, float] = {}
        self._unknown_since: dict[str, float] = {}
        self._wake = asyncio.Event()
        self.released_total = 0

    # ------------------------------------------------------------- prober side

    def wants_ids(self, edge_id: str) -> bool:
        """Whether the next probe of ``edge_id`` should fetch its live sandbox ids."""
        return time.monotonic() - self._last_fetch.get(edge_id, 0.0) >= self.interval_s

    def report(self, edge_id: str, live: list[str], probed_at: float) -> None:
        self._last_fetch[edge_id] = time.monotonic()
        self.reports[edge_id] = (live, probed_at)
        self._wake.set()

    # --------------------------------------------------------------- the loop

    async def run(self) -> None:
        channel = open_channel(self.iam_target, "watcher")
        iam = iam_pb2_grpc.IamServiceStub(channel)
        next_gone_check = 0.0
        try:
            while True:
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)
                except TimeoutError:
                    pass
                self._wake.clear()
                reports, self.reports = self.reports, {}
                for edge_id, (live, probed_at) in reports.items():
                    await self._reconcile(iam, edge_id, live, probed_at - self.grace_s)
                if time.monotonic() >= next_gone_check:
                    next_gone_check = time.monotonic() + self.interval_s
                    await self._release_gone(iam)
        finally:
            await channel.close()

    async def _reconcile(
        self, iam: iam_pb2_grpc.IamServiceStub, edge_id: str, live: list[str], as_of: float
    ) -> int:
        try:
            resp = await iam.ReconcileQuota(
                iam_pb2.ReconcileQuotaRequest(
                    edge_id=edge_id, live_sandbox_ids=live, as_of=ts(as_of)
                ),
                timeout=DEFAULT_DEADLINE_S,
            )
        except Exception as exc:  # IAM down: the next round tries again
            log.warning("quota reconciliation of edge %s failed: %s", edge_id, exc)
            return 0
        if resp.released:
            self.released_total += resp.released
            log.info(
                "reconciliation released %d reservations of edge %s",
                resp.released,
                edge_id,
                extra={"edge_id": edge_id, "released": resp.released},
            )
        return resp.released  # type: ignore[no-any-return]

    async def _release_gone(self, iam: iam_pb2_grpc.IamServiceStub) -> None:
        now = time.time()
        gone = set(self.view.gone(self.gone_after_s, now))
        try:
            held = await iam.ListReservedEdges(
                iam_pb2.ListReservedEdgesRequest(), timeout=DEFAULT_DEADLINE_S
            )
        except Exception as exc:
            log.warning("listing reserved edges failed: %s", exc)
            held = None
        if held is not None:
            mono = time.monotonic()
            unknown = {e for e in held.reservations_by_edge if e not in self.view.edges}
            for e in list(self._unknown_since):
                if e not in unknown:
                    del self._unknown_since[e]
            for e in unknown:
                since = self._unknown_since.setdefault(e, mono)
                if mono - since >= self.gone_after_s:
                    gone.add(e)
            gone &= set(held.reservations_by_edge)
        for edge_id in sorted(gone):
            n = await self._reconcile(iam, edge_id, [], now - self.grace_s)
            if n:
                log.warning(
                    "edge %s is gone: released %d reservations",
                    edge_id,
                    n,
                    extra={"edge_id": edge_id, "released": n},
                )
