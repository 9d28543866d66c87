"""Power-of-k placement with a local overlay and cloud bursting.

Filter: healthy edges that offer the backend, have the GPUs, and carry every
node_selector label. Sample k at random; rank by load (the larger of cpu and
memory allocation ratio, after overcommit). The load is the watcher's last
snapshot plus this instance's own placements made since that edge was last
probed, so a burst spreads out instead of piling onto the edge that looked
emptiest a second ago. Instances never coordinate; edges have the final say.

Bursting: once on-prem allocation passes ``burst_threshold`` (default 0.8),
eligible requests go to edges labelled ``location=cloud``; cloud edges are
otherwise used only when no on-prem edge fits.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from libdsec.errors import NoEligibleEdge


@dataclass
class EdgeView:
    edge_id: str
    address: str
    backends: frozenset[str]
    labels: dict[str, str]
    healthy: bool
    cpu_allocated: int
    cpu_capacity: int
    memory_allocated: int
    memory_capacity: int
    gpus_free: int
    sandboxes: int
    probed_at: float

    @property
    def cloud(self) -> bool:
        return self.labels.get("location") == "cloud"


@dataclass(frozen=True)
class Request:
    backend: str
    cpu_millis: int
    memory_mb: int
    gpu_count: int = 0
    node_selector: dict[str, str] = field(default_factory=dict)
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Candidate:
    edge_id: str
    address: str
    cloud: bool


@dataclass
class _Pending:
    at: float
    cpu: int
    memory: int
    gpus: int


class Placer:
    def __init__(
        self,
        *,
        k: int = 2,
        max_candidates: int = 3,
        burst_threshold: float = 0.8,
        overlay_ttl_s: float = 5.0,
        rng: random.Random | None = None,
    ) -> None:
        self.k = k
        self.max_candidates = max_candidates
        self.burst_threshold = burst_threshold
        self.overlay_ttl_s = overlay_ttl_s
        self.rng = rng or random.Random()
        self.edges: dict[str, EdgeView] = {}
        self.overlay: dict[str, list[_Pending]] = {}
        self.snapshot_at = 0.0

    # ------------------------------------------------------------- inputs

    def update(self, edges: list[EdgeView]) -> None:
        """A fresh snapshot: overlay entries the edges have since reported are dropped."""
        self.edges = {e.edge_id: e for e in edges}
        self.snapshot_at = time.time()
        now = time.monotonic()
        for edge_id in list(self.overlay):
            e = self.edges.get(edge_id)
            kept = [
                p
                for p in self.overlay[edge_id]
                if e is not None and p.at > e.probed_at and now - _mono(p.at) < self.overlay_ttl_s
            ]
            if kept:
                self.overlay[edge_id] = kept
            else:
                del self.overlay[edge_id]

    def update_edge(self, edge: EdgeView) -> None:
        self.edges[edge.edge_id] = edge
        if edge.edge_id in self.overlay:
            self.overlay[edge.edge_id] = [
                p for p in self.overlay[edge.edge_id] if p.at > edge.probed_at
            ]

    def remove_edge(self, edge_id: str) -> None:
        self.edges.pop(edge_id, None)
        self.overlay.pop(edge_id, None)

    def record(self, edge_id: str, cpu: int, memory: int, gpus: int = 0) -> None:
        self.overlay.setdefault(edge_id, []).append(_Pending(time.time(), cpu, memory, gpus))

    def forget(self, edge_id: str, cpu: int, memory: int) -> None:
        """An edge rejected a placement we recorded: take it back out of the overlay."""
        pending = self.overlay.get(edge_id)
        if not pending:
            return
        for i in range(len(pending) - 1, -1, -1):
            if pending[i].cpu == cpu and pending[i].memory == memory:
                del pending[i]
                return

    # ------------------------------------------------------------ decision

    def _effective(self, e: EdgeView) -> tuple[int, int, int, int]:
        cpu, mem, gpus, n = e.cpu_allocated, e.memory_allocated, 0, e.sandboxes
        pending = self.overlay.get(e.edge_id)
        if pending and time.time() - pending[0].at > self.overlay_ttl_s:
            # The watcher publishes only changes, so an entry it already counted
            # may never be dropped by a probe: age it out.
            cutoff = time.time() - self.overlay_ttl_s
            pending[:] = [p for p in pending if p.at > cutoff]
        for p in pending or ():
            cpu += p.cpu
            mem += p.memory
            gpus += p.gpus
            n += 1
        return cpu, mem, e.gpus_free - gpus, n

    def score(self, e: EdgeView) -> float:
        cpu, mem, _, _ = self._effective(e)
        return max(cpu / max(e.cpu_capacity, 1), mem / max(e.memory_capacity, 1))

    def _fits(self, e: EdgeView, req: Request) -> bool:
        cpu, mem, gpus, _ = self._effective(e)
        return (
            cpu + req.cpu_millis <= e.cpu_capacity
            and mem + req.memory_mb <= e.memory_capacity
            and gpus >= req.gpu_count
        )

    def onprem_utilization(self) -> float:
        cap = used = 0.0
        for e in self.edges.values():
            if e.healthy and not e.cloud:
                cpu, mem, _, _ = self._effective(e)
                cap += max(e.cpu_capacity, 1) + max(e.memory_capacity, 1)
                used += cpu * max(e.memory_capacity, 1) / max(e.cpu_capacity, 1) + mem
        return used / cap if cap else 0.0

    def place(self, req: Request) -> list[Candidate]:
        """Ranked candidates (best first); records the first in the overlay."""
        eligible, why = self._eligible(req)
        if not eligible:
            raise NoEligibleEdge(f"no eligible edge: {why}", metadata={"backend": req.backend})
        onprem = [e for e in eligible if not e.cloud]
        cloud = [e for e in eligible if e.cloud]
        pool = onprem
        if cloud and (not onprem or self.onprem_utilization() >= self.burst_threshold):
            pool = cloud
        sample = self.rng.sample(pool, min(self.k, len(pool)))
        sample.sort(key=self.score)
        rest = [e for e in pool if e not in sample]
        self.rng.shuffle(rest)
        ordered = (sample + rest)[: self.max_candidates]
        best = ordered[0]
        self.record(best.edge_id, req.cpu_millis, req.memory_mb, req.gpu_count)
        return [Candidate(e.edge_id, e.address, e.cloud) for e in ordered]

    def _eligible(self, req: Request) -> tuple[list[EdgeView], str]:
        if not self.edges:
            return [], "no edges are registered"
        reasons: dict[str, int] = {}
        out = []
        for e in self.edges.values():
            if e.edge_id in req.exclude:
                why = "already tried"
            elif not e.healthy:
                why = "unhealthy"
            elif req.backend not in e.backends:
                why = f"does not offer {req.backend}"
            elif any(e.labels.get(k) != v for k, v in req.node_selector.items()):
                why = "labels do not match node_selector"
            elif not self._fits(e, req):
                why = "not enough free capacity"
            else:
                out.append(e)
                continue
            reasons[why] = reasons.get(why, 0) + 1
        detail = ", ".join(f"{n} {why}" for why, n in sorted(reasons.items()))
        return out, f"{len(self.edges)} edges: {detail}"


def _mono(wall: float) -> float:
    """Converts a wall-clock time to the monotonic clock (for overlay aging)."""
    return time.monotonic() - (time.time() - wall)
