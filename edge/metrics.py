"""The edge's metrics (common/metrics.py serves them): what a node holds and what happened.

Two kinds:

- **Events**, counted as they happen by the manager (:class:`EdgeMetrics` is its
  ``metrics``): sandboxes started (by backend, and whether a warm sandbox served the create)
  with the start's duration, admission refusals by reason, endings by backend and reason,
  pauses and resumes with their durations and the bytes a pause gave back.
- **Levels**, read at each scrape: the node status the edge answers ``GetNodeStatus`` with
  (one source for `dsec status` and the metrics: committed CPU and memory against capacity,
  warm and FnCall pools, paused sandboxes, the swap area), sandboxes by backend and state,
  the disk reserve, and the name gate's and resolver's refusals (totals kept by the network
  manager, so they do not fall when a sandbox ends).

Labels: backend, state, reason, image and pool name (both from the operator's
configuration), never a sandbox id or a project.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from opentelemetry.metrics import CallbackOptions, Observation

from common.metrics import LATENCY_BUCKETS_S, Metrics, counts_by
from dsec.edge.v1 import edge_pb2

if TYPE_CHECKING:
    from edge.admission import Capacity
    from edge.backends.contract import PauseOutcome
    from edge.disk_guard import DiskGuard
    from edge.model import SandboxRecord
    from edge.network.manager import NetworkManager


class EdgeMetrics:
    """The edge's instruments; the manager reports events to it (see the module doc)."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        records: Callable[[], Iterable[SandboxRecord]],
        capacity: Capacity,
        node_status: Callable[[], Awaitable[edge_pb2.GetNodeStatusResponse]],
        disk_guard: DiskGuard | None = None,
        network: NetworkManager | None = None,
    ) -> None:
        m = metrics.meter
        self._records = records
        self._capacity_of = capacity
        self._node_status = node_status
        self._disk = disk_guard
        self._network = network
        self._status = edge_pb2.GetNodeStatusResponse()
        metrics.before_scrape(self.refresh)

        self.started = m.create_counter(
            "dsec_edge_sandboxes_started",
            description="Sandboxes started, by backend and start (warm: a warm sandbox served it)",
        )
        self.start_duration = m.create_histogram(
            "dsec_edge_start_duration_seconds",
            unit="s",
            description="From admission to RUNNING on the edge, by backend and start",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.refusals = m.create_counter(
            "dsec_edge_admission_refusals", description="Creates the edge refused, by reason"
        )
        self.terminations = m.create_counter(
            "dsec_edge_terminations", description="Sandboxes ended, by backend and reason"
        )
        self.pauses = m.create_counter("dsec_edge_pauses", description="Pauses, by backend")
        self.pause_duration = m.create_histogram(
            "dsec_edge_pause_duration_seconds",
            unit="s",
            description="A pause's duration, by backend",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.pause_freed = m.create_counter(
            "dsec_edge_pause_freed_bytes",
            unit="By",
            description="Memory pauses gave back to the node, by backend",
        )
        self.resumes = m.create_counter(
            "dsec_edge_resumes", description="Resumes, by backend and outcome (ok, failed)"
        )
        self.resume_duration = m.create_histogram(
            "dsec_edge_resume_duration_seconds",
            unit="s",
            description="A resume's duration, by backend",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        gauges: list[tuple[str, str, Callable[[CallbackOptions], Iterable[Observation]]]] = [
            ("dsec_edge_sandboxes", "Sandboxes now, by backend and state", self._sandboxes),
            ("dsec_edge_capacity", "The node's capacity, by resource", self._capacity),
            ("dsec_edge_committed", "What live sandboxes hold, by resource", self._committed),
            ("dsec_edge_draining", "1 while the node takes no new sandbox", self._draining),
            ("dsec_edge_paused_released_mb", "MiB paused sandboxes gave back", self._released),
            ("dsec_edge_swap_bytes", "The edge's swap area: size, used", self._swap),
            ("dsec_edge_swapped_bytes", "Paused sandboxes' memory swapped/saved", self._swapped),
            ("dsec_edge_warm", "Warm sandboxes per image: target, ready", self._warm),
            ("dsec_edge_fncall_pool", "FnCall pools: containers and jobs waiting", self._fncall),
            (
                "dsec_edge_disk_free_bytes",
                "Free bytes of the filesystems it writes",
                self._disk_free,
            ),
            ("dsec_edge_disk_reserve_bytes", "Free bytes the edge keeps", self._disk_reserve),
        ]
        for name, description, callback in gauges:
            m.create_observable_gauge(name, callbacks=[callback], description=description)
        counters: list[tuple[str, str, Callable[[CallbackOptions], Iterable[Observation]]]] = [
            ("dsec_edge_warm_claims", "Creates served by a warm sandbox, per image", self._claims),
            ("dsec_edge_warm_misses", "Eligible creates that found none ready", self._misses),
            ("dsec_edge_fncall_jobs", "FnCall steps run, per pool", self._fn_jobs),
            ("dsec_edge_fncall_recycled", "FnCall containers replaced", self._fn_recycled),
            ("dsec_edge_name_gate_refusals", "Connections the name gate refused", self._gate),
            ("dsec_edge_dns_refusals", "Names the sandbox resolver refused", self._dns),
        ]
        for name, description, callback in counters:
            m.create_observable_counter(name, callbacks=[callback], description=description)

    async def refresh(self) -> None:
        """Before a scrape: the node status now (its swap figures are read in a thread). The
        disk figures are the disk guard's last sample (it samples several times a second)."""
        self._status = await self._node_status()

    # ------------------------------------------------------------------ events

    def sandbox_started(self, rec: SandboxRecord, backend: str, started: float) -> None:
        labels = {"backend": backend, "start": "warm" if rec.runtime.get("warm") else "cold"}
        self.started.add(1, labels)
        self.start_duration.record(time.monotonic() - started, labels)

    def refused(self, reason: str) -> None:
        self.refusals.add(1, {"reason": reason or "UNKNOWN"})

    def ended(self, rec: SandboxRecord, backend: str) -> None:
        self.terminations.add(1, {"backend": backend, "reason": rec.termination_reason})

    def paused(self, backend: str, outcome: PauseOutcome) -> None:
        self.pauses.add(1, {"backend": backend})
        self.pause_duration.record(outcome.seconds, {"backend": backend})
        if outcome.freed_bytes > 0:
            self.pause_freed.add(outcome.freed_bytes, {"backend": backend})

    def resumed(self, backend: str, started: float, ok: bool) -> None:
        self.resumes.add(1, {"backend": backend, "outcome": "ok" if ok else "failed"})
        if ok:
            self.resume_duration.record(time.monotonic() - started, {"backend": backend})

    # ------------------------------------------------------------------ levels

    def _sandboxes(self, _: CallbackOptions) -> Iterable[Observation]:
        points = counts_by(
            (r for r in self._records() if r.live),
            lambda r: r.spec.backend,
            lambda r: r.state,
            names=("backend", "state"),
        )
        return [Observation(n, labels) for labels, n in points]

    def _capacity(self, _: CallbackOptions) -> Iterable[Observation]:
        c = self._capacity_of
        return [
            Observation(c.cpu_millis, {"resource": "cpu_millis"}),
            Observation(c.memory_mb, {"resource": "memory_mb"}),
            Observation(c.max_sandboxes, {"resource": "sandboxes"}),
            Observation(c.gpus, {"resource": "gpus"}),
        ]

    def _committed(self, _: CallbackOptions) -> Iterable[Observation]:
        load = self._status.load
        return [
            Observation(load.cpu_millis_allocated, {"resource": "cpu_millis"}),
            Observation(load.memory_mb_allocated, {"resource": "memory_mb"}),
            Observation(load.sandboxes, {"resource": "sandboxes"}),
            Observation(self._capacity_of.gpus - load.gpus_free, {"resource": "gpus"}),
        ]

    def _draining(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(int(self._status.draining))]

    def _released(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._status.pause.released_mb)]

    def _swap(self, _: CallbackOptions) -> Iterable[Observation]:
        p = self._status.pause
        return [
            Observation(p.swap_size_bytes, {"kind": "size"}),
            Observation(p.swap_used_bytes, {"kind": "used"}),
        ]

    def _swapped(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._status.pause.swapped_bytes)]

    def _warm(self, _: CallbackOptions) -> Iterable[Observation]:
        out = []
        for image, w in sorted(self._status.warm.items()):
            out += [
                Observation(w.target, {"image": image, "kind": "target"}),
                Observation(w.ready, {"image": image, "kind": "ready"}),
            ]
        return out

    def _claims(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(w.claimed, {"image": i}) for i, w in sorted(self._status.warm.items())]

    def _misses(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(w.missed, {"image": i}) for i, w in sorted(self._status.warm.items())]

    def _fncall(self, _: CallbackOptions) -> Iterable[Observation]:
        out = []
        for pool, p in sorted(self._status.fncall.items()):
            for kind in ("size", "workers", "idle", "starting", "waiting"):
                out.append(Observation(getattr(p, kind), {"pool": pool, "kind": kind}))
        return out

    def _fn_jobs(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(p.jobs, {"pool": n}) for n, p in sorted(self._status.fncall.items())]

    def _fn_recycled(self, _: CallbackOptions) -> Iterable[Observation]:
        fncall = sorted(self._status.fncall.items())
        return [Observation(p.recycled, {"pool": n}) for n, p in fncall]

    def _disk_free(self, _: CallbackOptions) -> Iterable[Observation]:
        if self._disk is None:
            return []
        return [
            Observation(fs.free_bytes, {"path": str(fs.path)}) for fs in self._disk.last.values()
        ]

    def _disk_reserve(self, _: CallbackOptions) -> Iterable[Observation]:
        return [] if self._disk is None else [Observation(self._disk.reserve_bytes)]

    def _gate(self, _: CallbackOptions) -> Iterable[Observation]:
        return [] if self._network is None else [Observation(self._network.gate_refusals)]

    def _dns(self, _: CallbackOptions) -> Iterable[Observation]:
        return [] if self._network is None else [Observation(self._network.dns_refusals)]
