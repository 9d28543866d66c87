"""The watcher's view of the cluster: edges, their health and load.

Rebuilt from registrations and probes; nothing is persisted, so a restarted
watcher is whole again within one re-registration interval.

Health, with the reason placement and operators see (the first that holds):
UNHEALTHY PROBES_FAILING (``unhealthy_after`` probes failed in a row), UNHEALTHY
VERSION_MISMATCH (another dsec major.minor than the watcher's), UNHEALTHY CLOCK_SKEW
(its clock differs from the watcher's by more than ``max_clock_skew_s``, beyond the
measurement's error), DRAINING (the operator's), else HEALTHY. Only HEALTHY edges are
placed on. The last three are facts of an edge that answers: it is not gone, its
sandboxes are polled, and it is HEALTHY again as soon as the fact goes away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation

from common.metrics import Metrics, counts_by
from common.version import DSEC_VERSION, compatible

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
    #: ``unhealthy_after`` probes failed in a row, none has succeeded since.
    probes_failing: bool = False
    draining: bool = False
    drain_reason: str = ""
    #: The edge's clock minus ours (last measured), the measurement's error bound, and
    #: whether the skew is beyond the bound even allowing for that error.
    clock_skew_s: float = 0.0
    clock_skew_error_s: float = 0.0
    clock_skewed: bool = False
    health_reason: str = ""
    health_detail: str = ""

    @property
    def version(self) -> str:
        return str(getattr(self.info, "version", ""))

    @property
    def address(self) -> str:
        return str(getattr(self.info, "address", ""))


class ClusterView:
    def __init__(
        self,
        unhealthy_after: int,
        forget_after_s: float,
        *,
        max_clock_skew_s: float = 30.0,
        dsec_version: str = DSEC_VERSION,
    ) -> None:
        self.edges: dict[str, EdgeEntry] = {}
        self.version = 0
        self.started_at = time.time()
        self.unhealthy_after = unhealthy_after
        self.forget_after_s = forget_after_s
        self.max_clock_skew_s = max_clock_skew_s
        self.dsec_version = dsec_version
        self._subscribers: set[asyncio.Queue[tuple[str, Any]]] = set()
        #: Set when an edge registers that no probe has found healthy yet (new, or back from
        #: UNHEALTHY: a restarted edge): the prober probes at once instead of at its interval,
        #: so placement uses the edge again within milliseconds of its return.
        self.probe_now = asyncio.Event()

    def observe(self, metrics: Metrics) -> None:
        """Edges by health (and why), read at each scrape."""

        def edges(_: CallbackOptions) -> list[Observation]:
            points = counts_by(
                self.edges.values(),
                lambda e: e.health,
                lambda e: e.health_reason,
                names=("health", "reason"),
            )
            return [Observation(n, labels) for labels, n in points]

        metrics.meter.create_observable_gauge(
            "dsec_watcher_edges", callbacks=[edges], description="Edges known, by health"
        )

    def _publish(self, kind: str, payload: Any) -> None:
        self.version += 1
        for q in list(self._subscribers):
            try:
                q.put_nowait((kind, payload))
            except asyncio.QueueFull:
                self._subscribers.discard(q)

    def holder(self, edge_id: str, address: str, incarnation: str) -> EdgeEntry | None:
        """The live edge that holds ``edge_id`` if a registration from ``address`` (of process
        ``incarnation``) would take it from another node: the holder is at another address,
        is another process, and answered its last probe (a registration made since counts as
        an answer). None when the registration is the same edge, or a restart of it."""
        e = self.edges.get(edge_id)
        if e is None or e.address == address or e.incarnation == incarnation:
            return None
        if e.probes_failing or e.consecutive_failures:
            return None
        return e

    def register(
        self,
        edge_id: str,
        info: Any,
        incarnation: str = "",
        sent_at: float | None = None,
    ) -> EdgeEntry:
        """An edge's registration (on start, then on its interval). One from a new process
        (another incarnation) is a restart: the failed probes counted so far were of the
        previous process, and would otherwise mark the new one UNHEALTHY moments after it
        returned (an edge back within ``unhealthy_after`` probes). ``sent_at`` (the edge's
        clock when it sent the registration) measures the skew of its clock; the time it
        spent on the way makes the edge look behind by that much, which the bound absorbs."""
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
        if sent_at:
            self._clock(entry, sent_at - now, 0.0)
        self._judge(entry)
        self._publish("changed", entry)
        return entry

    def _clock(self, e: EdgeEntry, skew_s: float, error_s: float) -> None:
        e.clock_skew_s = skew_s
        e.clock_skew_error_s = error_s
        e.clock_skewed = abs(skew_s) - error_s > self.max_clock_skew_s

    def _judge(self, e: EdgeEntry) -> None:
        """Health and its reason from what is known of the edge (see the module docstring);
        every change logged."""
        if e.probes_failing:
            health, reason = "UNHEALTHY", "PROBES_FAILING"
            detail = f"{e.consecutive_failures} probes failed in a row (the last: {e.last_error})"
        elif not compatible(e.version, self.dsec_version):
            health, reason = "UNHEALTHY", "VERSION_MISMATCH"
            detail = (
                f"the edge runs dsec {e.version or '(unknown)'}, the watcher {self.dsec_version}:"
                " major.minor must match"
            )
        elif e.clock_skewed:
            health, reason = "UNHEALTHY", "CLOCK_SKEW"
            detail = (
                f"the edge's clock is {abs(e.clock_skew_s):.1f} s "
                f"{'ahead of' if e.clock_skew_s > 0 else 'behind'} the watcher's "
                f"(+/- {e.clock_skew_error_s:.3f} s; at most {self.max_clock_skew_s:g} s)"
            )
        elif e.draining:
            health, reason, detail = "DRAINING", "DRAINING", e.drain_reason
        else:
            health, reason, detail = "HEALTHY", "", ""
        if health != e.health or reason != e.health_reason:
            level = logging.WARNING if health == "UNHEALTHY" else logging.INFO
            log.log(
                level,
                "edge %s is %s%s",
                e.edge_id,
                health,
                f" ({reason}: {detail})" if reason else "",
                extra={"edge_id": e.edge_id, "health_reason": reason},
            )
        e.health, e.health_reason, e.health_detail = health, reason, detail

    def probe_ok(
        self,
        edge_id: str,
        load: Any,
        by_project: dict[str, int],
        by_principal: dict[str, int],
        by_task: dict[str, int],
        draining: bool,
        latency_ms: float,
        *,
        drain_reason: str = "",
        clock_skew_s: float | None = None,
        clock_skew_error_s: float = 0.0,
    ) -> None:
        """A probe the edge answered; ``clock_skew_s``: its ``as_of`` minus the probe's
        midpoint by our clock, with half the round trip as the error."""
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
        entry.probes_failing = False
        entry.draining, entry.drain_reason = draining, drain_reason if draining else ""
        if clock_skew_s is not None:
            self._clock(entry, clock_skew_s, clock_skew_error_s)
        self._judge(entry)
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
        if entry.consecutive_failures >= self.unhealthy_after and not entry.probes_failing:
            entry.probes_failing = True
            self._judge(entry)
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
        """Edges whose probes fail (UNHEALTHY PROBES_FAILING) and whose last good probe (or
        registration) is older than ``after_s``. One UNHEALTHY for another reason answers."""
        now = time.time() if now is None else now
        return [
            e.edge_id
            for e in self.edges.values()
            if e.probes_failing and now - max(e.last_ok_at, e.registered_at) > after_s
        ]

    def subscribe(self) -> asyncio.Queue[tuple[str, Any]]:
        q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=10_000)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[tuple[str, Any]]) -> None:
        self._subscribers.discard(q)
