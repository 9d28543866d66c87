"""The watcher's view of the cluster: edges, their health and load.

Rebuilt from registrations and probes; nothing is persisted, so a restarted
watcher is whole again within one re-registration interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class EdgeEntry:
    edge_id: str
    info: Any  # dsec.types.v1.EdgeInfo as last registered (opaque to the view)
    registered_at: float
    incarnation: str = ""  # of the edge process that registered last ("" from older edges)
    health: str = "HEALTHY"  # HEALTHY, UNHEALTHY, DRAINING
    load: Any = None  # dsec.types.v1.EdgeLoad of the last good probe
    by_project: dict[str, int] = field(default_factory=dict)
    by_principal: dict[str, int] = field(default_factory=dict)
    by_task: dict[str, int] = field(default_factory=dict)
    last_probe_at: float = 0.0
    last_ok_at: float = 0.0
    consecutive_failures: int = 0
    last_error: str = ""
    probe_latency_ms: float = 0.0


class ClusterView:
    def __init__(self, unhealthy_after: int, forget_after_s: float) -> None:
        self.edges: dict[str, EdgeEntry] = {}
        self.version = 0
        self.started_at = time.time()
        self.unhealthy_after = unhealthy_after
        self.forget_after_s = forget_after_s
        self._subscribers: set[asyncio.Queue[tuple[str, Any]]] = set()
        #: Set when an edge registers that no probe has found healthy yet (new, or back from
        #: UNHEALTHY: a restarted edge): the prober probes at once instead of at its interval,
        #: so placement uses the edge again within milliseconds of its return.
        self.probe_now = asyncio.Event()

    def _publish(self, kind: str, payload: Any) -> None:
        self.version += 1
        for q in list(self._subscribers):
            try:
                q.put_nowait((kind, payload))
            except asyncio.QueueFull:
                self._subscribers.discard(q)

    def register(self, edge_id: str, info: Any, incarnation: str = "") -> EdgeEntry:
        """An edge's registration (on start, then on its interval). One from a new process
        (another incarnation) is a restart: the failed probes counted so far were of the
        previous process, and would otherwise mark the new one UNHEALTHY moments after it
        returned (an edge back within ``unhealthy_after`` probes)."""
        now = time.time()
        entry = self.edges.get(edge_id)
        if entry is None:
            entry = self.edges[edge_id] = EdgeEntry(
                edge_id, info, now, incarnation=incarnation, last_ok_at=now
            )
            self.probe_now.set()
        else:
            entry.info = info
            entry.registered_at = now
            if incarnation and incarnation != entry.incarnation:
                if entry.incarnation:
                    log.info(
                        "edge %s restarted (%d failed probes of its previous process forgotten)",
                        edge_id,
                        entry.consecutive_failures,
                        extra={"edge_id": edge_id, "incarnation": incarnation},
                    )
                entry.incarnation = incarnation
                entry.consecutive_failures = 0
                self.probe_now.set()
            if entry.health == "UNHEALTHY":
                self.probe_now.set()
        self._publish("changed", entry)
        return entry

    def probe_ok(
        self,
        edge_id: str,
        load: Any,
        by_project: dict[str, int],
        by_principal: dict[str, int],
        by_task: dict[str, int],
        draining: bool,
        latency_ms: float,
    ) -> None:
        entry = self.edges.get(edge_id)
        if entry is None:
            return
        now = time.time()
        entry.load = load
        entry.by_project = by_project
        entry.by_principal = by_principal
        entry.by_task = by_task
        entry.last_probe_at = entry.last_ok_at = now
        entry.consecutive_failures = 0
        entry.last_error = ""
        entry.probe_latency_ms = latency_ms
        if entry.health == "UNHEALTHY":
            log.info("edge %s is HEALTHY again", edge_id, extra={"edge_id": edge_id})
        entry.health = "DRAINING" if draining else "HEALTHY"
        # Published after every probe, changed or not: placement drops the
        # overlay entries a probe has accounted for only when it hears of it.
        self._publish("changed", entry)

    def probe_failed(self, edge_id: str, error: str, started_at: float | None = None) -> None:
        """A failed probe; one that started before the edge's latest registration was of the
        process before it (a restarted edge: it would mark the new one UNHEALTHY)."""
        entry = self.edges.get(edge_id)
        if entry is None:
            return
        if started_at is not None and started_at < entry.registered_at:
            return
        now = time.time()
        entry.last_probe_at = now
        entry.consecutive_failures += 1
        entry.last_error = error
        log.debug("probe %d of edge %s failed: %s", entry.consecutive_failures, edge_id, error)
        if entry.consecutive_failures >= self.unhealthy_after and entry.health != "UNHEALTHY":
            log.warning(
                "edge %s is UNHEALTHY: %d probes failed in a row (the last: %s)",
                edge_id,
                entry.consecutive_failures,
                error,
                extra={"edge_id": edge_id},
            )
            entry.health = "UNHEALTHY"
            self._publish("changed", entry)
        if now - max(entry.last_ok_at, entry.registered_at) > self.forget_after_s:
            del self.edges[edge_id]
            self._publish("removed", edge_id)

    def totals(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Live sandboxes across edges per project, per principal and per task."""
        by_project: dict[str, int] = {}
        by_principal: dict[str, int] = {}
        by_task: dict[str, int] = {}
        for e in self.edges.values():
            for k, v in e.by_project.items():
                by_project[k] = by_project.get(k, 0) + v
            for k, v in e.by_principal.items():
                by_principal[k] = by_principal.get(k, 0) + v
            for k, v in e.by_task.items():
                by_task[k] = by_task.get(k, 0) + v
        return by_project, by_principal, by_task

    def gone(self, after_s: float, now: float | None = None) -> list[str]:
        """Edges UNHEALTHY whose last good probe (or registration) is older than ``after_s``."""
        now = time.time() if now is None else now
        return [
            e.edge_id
            for e in self.edges.values()
            if e.health == "UNHEALTHY" and now - max(e.last_ok_at, e.registered_at) > after_s
        ]

    def subscribe(self) -> asyncio.Queue[tuple[str, Any]]:
        q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=10_000)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[tuple[str, Any]]) -> None:
        self._subscribers.discard(q)
