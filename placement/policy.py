"""Power-of-k placement with a local overlay and cloud bursting.

Filter: healthy edges that offer the backend, have the GPUs, and carry every
node_selector label. A backend no registered edge offers (healthy or not) is refused as
such (FAILED_PRECONDITION, BACKEND_NOT_OFFERED: retrying cannot help), not as capacity. Sample k at random; rank by load (the larger of cpu and
memory allocation ratio, after overcommit). The load is the watcher's last
snapshot plus this instance's own placements made since that edge was last
probed, so a burst spreads out instead of piling onto the edge that looked
emptiest a second ago. Instances never coordinate; edges have the final say.

The overlay is kept per edge as running sums over a time-ordered queue of
placements, so a decision costs O(edges) however many placements are pending;
a burst (:meth:`Placer.place_group`) is decided in one pass over arrays.

Warm sandboxes: an edge reports how many warm container sandboxes of each image it has ready
(edge/backends/warm.py). A create such a sandbox can serve (``Request.warm_image``) is placed by the same
power-of-k rule, but among the eligible edges that still have one of its image, counting down
this instance's own placements since each edge's probe; only when none has one does it fall back
to all eligible edges. A claimed warm sandbox starts ~3x faster than a cold one here.

Bursting: once on-prem allocation passes ``burst_threshold`` (default 0.8),
eligible requests go to edges labelled ``location=cloud``; cloud edges are
otherwise used only when no on-prem edge fits.
"""

from __future__ import annotations

import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from libdsec.errors import BackendNotOffered, DSecError, ExceedsEveryEdge, NoEligibleEdge


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
    #: warm container sandboxes ready at the probe, per image
    warm: dict[str, int] = field(default_factory=dict)
    #: Why it is not healthy, as the watcher says (DRAINING, CLOCK_SKEW, ...; "" = unknown).
    health_reason: str = ""

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
    #: the image, when a warm sandbox of it could serve this create ("" = it could not)
    warm_image: str = ""


@dataclass(frozen=True)
class Candidate:
    edge_id: str
    address: str
    cloud: bool


class EdgeOverlay:
    """This instance's placements on one edge that its last probe may not count yet."""

    __slots__ = ("cpu", "entries", "gpus", "memory", "n")

    def __init__(self) -> None:
        self.entries: deque[tuple[float, int, int, int]] = deque()  # (wall time, cpu, mem, gpus)
        self.cpu = self.memory = self.gpus = self.n = 0

    def add(self, at: float, cpu: int, memory: int, gpus: int, count: int = 1) -> None:
        for _ in range(count):
            self.entries.append((at, cpu, memory, gpus))
        self.cpu += cpu * count
        self.memory += memory * count
        self.gpus += gpus * count
        self.n += count

    def drop_until(self, t: float) -> None:
        """Forgets placements made at or before ``t`` (a probe after them counts them)."""
        e = self.entries
        while e and e[0][0] <= t:
            _, cpu, mem, gpus = e.popleft()
            self.cpu -= cpu
            self.memory -= mem
            self.gpus -= gpus
            self.n -= 1

    def remove_one(self, cpu: int, memory: int) -> bool:
        for i in range(len(self.entries) - 1, -1, -1):
            _, c, m, g = self.entries[i]
            if c == cpu and m == memory:
                del self.entries[i]
                self.cpu -= c
                self.memory -= m
                self.gpus -= g
                self.n -= 1
                return True
        return False


class WarmTaken:
    """This instance's placements on one edge that take a warm sandbox, not yet seen by a probe:
    a time-ordered queue with running counts per image (a lookup costs O(1), like the overlay)."""

    __slots__ = ("entries", "per_image")

    def __init__(self) -> None:
        self.entries: deque[tuple[float, str]] = deque()
        self.per_image: Counter[str] = Counter()

    def add(self, at: float, image: str, count: int = 1) -> None:
        self.entries.extend([(at, image)] * count)
        self.per_image[image] += count

    def drop_until(self, t: float) -> None:
        e = self.entries
        while e and e[0][0] <= t:
            self.per_image[e.popleft()[1]] -= 1


class Placer:
    def __init__(
        self,
        *,
        k: int = 2,
        max_candidates: int = 3,
        burst_threshold: float = 0.8,
        overlay_ttl_s: float = 5.0,
        overlay_grace_s: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        self.k = k
        self.max_candidates = max_candidates
        self.burst_threshold = burst_threshold
        #: An overlay entry never outlives this (the watcher may have counted it silently).
        self.overlay_ttl_s = overlay_ttl_s
        #: A probe counts a placement only if taken this long after it (the
        #: sandbox reaches the edge a little after it is placed).
        self.overlay_grace_s = overlay_grace_s
        self.rng = rng or random.Random()
        self.edges: dict[str, EdgeView] = {}
        self.overlay: dict[str, EdgeOverlay] = {}
        #: per edge, our placements there that take a warm sandbox since its probe
        self.warm_taken: dict[str, WarmTaken] = {}
        self.snapshot_at = 0.0
        self.placed_total = 0

    # ------------------------------------------------------------- inputs

    def update(self, edges: list[EdgeView]) -> None:
        """A fresh snapshot: overlay entries the edges have since reported are dropped."""
        self.edges = {e.edge_id: e for e in edges}
        self.snapshot_at = time.time()
        for edge_id in list(self.overlay):
            if edge_id not in self.edges:
                del self.overlay[edge_id]
        for e in edges:
            self._age(e)

    def update_edge(self, edge: EdgeView) -> None:
        self.edges[edge.edge_id] = edge
        self._age(edge)

    def _age(self, edge: EdgeView) -> None:
        taken = self.warm_taken.get(edge.edge_id)
        if taken is not None:
            taken.drop_until(
                max(edge.probed_at - self.overlay_grace_s, time.time() - self.overlay_ttl_s)
            )
        ov = self.overlay.get(edge.edge_id)
        if ov is not None:
            ov.drop_until(
                max(edge.probed_at - self.overlay_grace_s, time.time() - self.overlay_ttl_s)
            )

    def remove_edge(self, edge_id: str) -> None:
        self.edges.pop(edge_id, None)
        self.overlay.pop(edge_id, None)
        self.warm_taken.pop(edge_id, None)

    def warm_left(self, e: EdgeView, image: str) -> int:
        """Warm sandboxes of `image` on `e` that our placements since its probe did not take."""
        have = e.warm.get(image, 0) if image else 0
        if have <= 0:
            return 0
        taken = self.warm_taken.get(e.edge_id)
        return max(0, have - taken.per_image[image]) if taken is not None else have

    def _take_warm(self, edge_id: str, image: str, count: int) -> None:
        taken = self.warm_taken.get(edge_id)
        if taken is None:
            taken = self.warm_taken[edge_id] = WarmTaken()
        taken.add(time.time(), image, count)

    def record(self, edge_id: str, cpu: int, memory: int, gpus: int = 0, count: int = 1) -> None:
        ov = self.overlay.get(edge_id)
        if ov is None:
            ov = self.overlay[edge_id] = EdgeOverlay()
        ov.add(time.time(), cpu, memory, gpus, count)
        self.placed_total += count

    def forget(self, edge_id: str, cpu: int, memory: int, count: int = 1) -> None:
        """Placements we recorded that will not land (the edge refused, or the caller
        never sent them): take them back out of the overlay."""
        ov = self.overlay.get(edge_id)
        if ov is not None:
            for _ in range(count):
                if not ov.remove_one(cpu, memory):
                    break

    def overlay_entries(self) -> int:
        return sum(ov.n for ov in self.overlay.values())

    # ------------------------------------------------------------ decision

    def _effective(self, e: EdgeView) -> tuple[int, int, int, int]:
        ov = self.overlay.get(e.edge_id)
        if ov is None or not ov.n:
            return e.cpu_allocated, e.memory_allocated, e.gpus_free, e.sandboxes
        if ov.entries[0][0] < time.time() - self.overlay_ttl_s:
            # The watcher publishes only what it probes, so an entry it already
            # counted may never be dropped by a probe we hear of: age it out.
            ov.drop_until(time.time() - self.overlay_ttl_s)
        return (
            e.cpu_allocated + ov.cpu,
            e.memory_allocated + ov.memory,
            e.gpus_free - ov.gpus,
            e.sandboxes + ov.n,
        )

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

    def _pool(self, eligible: list[EdgeView]) -> list[EdgeView]:
        onprem = [e for e in eligible if not e.cloud]
        cloud = [e for e in eligible if e.cloud]
        if cloud and (not onprem or self.onprem_utilization() >= self.burst_threshold):
            return cloud
        return onprem

    def not_offered(self, req: Request) -> DSecError | None:
        """The error when no registered edge (healthy or not) could ever take the request: none
        offers the backend, or none that does (and matches the node selector) is large enough
        even empty. Retrying or queueing cannot help, unlike edges that have no room or health
        right now. With no edge registered at all the cluster may be starting: that stays
        NoEligibleEdge."""
        if not self.edges:
            return None
        if any(req.backend in e.backends for e in self.edges.values()):
            return self._exceeds_every_edge(req)
        offered = sorted({b.lower() for e in self.edges.values() for b in e.backends})
        return BackendNotOffered(
            f"no edge of the cluster offers backend {req.backend.lower()}"
            f" ({len(self.edges)} edges offer: {', '.join(offered) or 'nothing'})",
            metadata={"backend": req.backend},
        )

    def _exceeds_every_edge(self, req: Request) -> ExceedsEveryEdge | None:
        matching = [
            e
            for e in self.edges.values()
            if req.backend in e.backends
            and all(e.labels.get(k) == v for k, v in req.node_selector.items())
            and e.cpu_capacity > 0  # a registered edge not probed yet: its size is unknown
            and e.memory_capacity > 0
        ]
        if not matching or any(
            req.cpu_millis <= e.cpu_capacity and req.memory_mb <= e.memory_capacity
            for e in matching
        ):
            return None  # (no edge matches the selector: labels may change, it stays retryable)
        cpu = max(e.cpu_capacity for e in matching)
        mem = max(e.memory_capacity for e in matching)
        return ExceedsEveryEdge(
            f"the sandbox asks for {req.cpu_millis}m cpu and {req.memory_mb} MB; the largest of"
            f" the {len(matching)} edges that offer {req.backend.lower()} has {cpu}m cpu and"
            f" {mem} MB",
            metadata={"backend": req.backend},
        )

    def place(self, req: Request) -> list[Candidate]:
        """Ranked candidates (best first); records the first in the overlay."""
        err = self.not_offered(req)
        if err is not None:
            raise err
        eligible, why = self._eligible(req)
        if not eligible:
            raise NoEligibleEdge(f"no eligible edge: {why}", metadata={"backend": req.backend})
        pool = self._pool(eligible)
        warm = [e for e in pool if self.warm_left(e, req.warm_image) > 0]
        first = warm or pool  # edges with a warm sandbox for it come first
        sample = self.rng.sample(first, min(self.k, len(first)))
        sample.sort(key=self.score)
        rest = [e for e in pool if e not in sample]
        self.rng.shuffle(rest)
        ordered = (sample + rest)[: self.max_candidates]
        best = ordered[0]
        self.record(best.edge_id, req.cpu_millis, req.memory_mb, req.gpu_count)
        if warm:
            self._take_warm(best.edge_id, req.warm_image, 1)
        return [Candidate(e.edge_id, e.address, e.cloud) for e in ordered]

    def place_group(
        self, req: Request, count: int, clump: int = 1
    ) -> tuple[list[Candidate], list[int], DSecError | None]:
        """Places ``count`` identical sandboxes, one power-of-k decision per
        ``clump`` of them (1 = per sandbox).

        Returns a table of edges, the index into it of the edge chosen for
        each placed sandbox (in order) and, if fewer than ``count`` could be
        placed, the error of the rest. Loads (and the burst threshold) are
        updated between decisions, exactly as ``count`` calls of :meth:`place`
        would, but over arrays instead of objects. A clump lets a small batch
        land on a few edges (one edge call each) instead of one per sandbox;
        the imbalance it adds is at most ``clump`` sandboxes per edge.
        """
        clump = max(1, clump)
        not_offered = self.not_offered(req)
        if not_offered is not None:
            return [], [], not_offered
        eligible, why, snapshot_only = self._eligible_ex(req)
        if not eligible:
            return (
                [],
                [],
                NoEligibleEdge(f"no eligible edge: {why}", metadata={"backend": req.backend}),
            )
        cands = [Candidate(e.edge_id, e.address, e.cloud) for e in eligible]
        eff = [
            (e.cpu_allocated, e.memory_allocated, e.gpus_free, e.sandboxes)
            if snapshot_only
            else self._effective(e)
            for e in eligible
        ]
        cpu = [x[0] for x in eff]
        mem = [x[1] for x in eff]
        gpus = [x[2] for x in eff]
        cap_cpu = [max(e.cpu_capacity, 1) for e in eligible]
        cap_mem = [max(e.memory_capacity, 1) for e in eligible]
        cloud = [e.cloud for e in eligible]
        rc, rm, rg = req.cpu_millis, req.memory_mb, req.gpu_count
        # On-prem utilization, kept incrementally (same formula as onprem_utilization()).
        op_cap = op_used = 0.0
        for e in self.edges.values():
            if e.healthy and not e.cloud:
                c, m, _, _ = self._effective(e)
                op_cap += max(e.cpu_capacity, 1) + max(e.memory_capacity, 1)
                op_used += c * max(e.memory_capacity, 1) / max(e.cpu_capacity, 1) + m

        def fits(i: int) -> bool:
            return cpu[i] + rc <= cap_cpu[i] and mem[i] + rm <= cap_mem[i] and gpus[i] >= rg

        # Warm sandboxes left per edge for this request; edges with some are chosen first.
        warm = [self.warm_left(e, req.warm_image) for e in eligible]
        warm_taken = [0] * len(eligible)

        onprem_pool = [i for i in range(len(eligible)) if not cloud[i]]
        cloud_pool = [i for i in range(len(eligible)) if cloud[i]]
        chosen: list[int] = []
        k = self.k
        rand = self.rng.random
        sample = self.rng.sample
        error: DSecError | None = None
        while len(chosen) < count:
            use_cloud = bool(cloud_pool) and (
                not onprem_pool or (op_cap and op_used / op_cap >= self.burst_threshold)
            )
            pool = cloud_pool if use_cloud else onprem_pool
            n = len(pool)
            if n and any(warm):
                warm_pool = [i for i in pool if warm[i] > 0]
                if warm_pool:
                    pool, n = warm_pool, len(warm_pool)
            if n == 0:
                error = NoEligibleEdge(
                    f"no eligible edge: {len(self.edges)} edges: not enough free capacity"
                    f" for the rest of the burst ({len(chosen)} of {count} placed)",
                    metadata={"backend": req.backend},
                )
                break
            if k == 2 and n > 1:
                a = int(rand() * n)
                b = int(rand() * (n - 1))
                if b >= a:
                    b += 1
                ia, ib = pool[a], pool[b]
                sa = max(cpu[ia] / cap_cpu[ia], mem[ia] / cap_mem[ia])
                sb = max(cpu[ib] / cap_cpu[ib], mem[ib] / cap_mem[ib])
                best = ia if sa <= sb else ib
            else:
                picks = sample(pool, min(k, n))
                best = min(picks, key=lambda i: max(cpu[i] / cap_cpu[i], mem[i] / cap_mem[i]))
            for _ in range(min(clump, count - len(chosen))):
                chosen.append(best)
                cpu[best] += rc
                mem[best] += rm
                gpus[best] -= rg
                if warm[best] > 0:
                    warm[best] -= 1
                    warm_taken[best] += 1
                if not cloud[best]:
                    op_used += rc * cap_mem[best] / cap_cpu[best] + rm
                if not fits(best):
                    for p in (onprem_pool, cloud_pool):
                        if best in p:
                            p.remove(best)
                    break
        counts: dict[int, int] = {}
        for i in chosen:
            counts[i] = counts.get(i, 0) + 1
        for i, n in counts.items():
            self.record(cands[i].edge_id, rc, rm, rg, n)
            if warm_taken[i]:
                self._take_warm(cands[i].edge_id, req.warm_image, warm_taken[i])
        return cands, chosen, error

    def _eligible(self, req: Request) -> tuple[list[EdgeView], str]:
        edges, why, _ = self._eligible_ex(req)
        return edges, why

    def _eligible_ex(self, req: Request) -> tuple[list[EdgeView], str, bool]:
        """Eligible edges, why the others are not, and whether only the snapshot's loads
        were used: when our overlay is all that makes every edge look full (placements
        still on their way, or that never landed), the edges decide instead."""
        if not self.edges:
            return [], "no edges are registered", False
        reasons: dict[str, int] = {}
        out = []
        full_by_overlay = []
        for e in self.edges.values():
            if e.edge_id in req.exclude:
                why = "already tried"
            elif not e.healthy:
                r = e.health_reason
                why = "draining" if r == "DRAINING" else f"unhealthy ({r})" if r else "unhealthy"
            elif req.backend not in e.backends:
                why = f"does not offer {req.backend}"
            elif any(e.labels.get(k) != v for k, v in req.node_selector.items()):
                why = "labels do not match node_selector"
            elif not self._fits(e, req):
                why = "not enough free capacity"
                if (
                    e.cpu_allocated + req.cpu_millis <= e.cpu_capacity
                    and e.memory_allocated + req.memory_mb <= e.memory_capacity
                    and e.gpus_free >= req.gpu_count
                ):
                    full_by_overlay.append(e)
            else:
                out.append(e)
                continue
            reasons[why] = reasons.get(why, 0) + 1
        detail = ", ".join(f"{n} {why}" for why, n in sorted(reasons.items()))
        if not out and full_by_overlay:
            return full_by_overlay, f"{len(self.edges)} edges: {detail}", True
        return out, f"{len(self.edges)} edges: {detail}", False
