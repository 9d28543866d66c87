from __future__ import annotations

import random
import time

import pytest

from libdsec.errors import NoEligibleEdge
from placement.policy import EdgeView, Placer, Request


def edge(
    i: int,
    *,
    backends: tuple[str, ...] = ("CONTAINER",),
    cloud: bool = False,
    cpu: int = 0,
    cap: int = 8000,
    healthy: bool = True,
    labels: dict[str, str] | None = None,
) -> EdgeView:
    lab = dict(labels or {})
    if cloud:
        lab["location"] = "cloud"
    return EdgeView(
        f"e{i}",
        f"127.0.0.1:{9000 + i}",
        frozenset(backends),
        lab,
        healthy,
        cpu,
        cap,
        0,
        64_000,
        0,
        0,
        time.time(),
    )


def test_power_of_k_with_overlay_spreads_a_burst_evenly() -> None:
    """The overlay makes a burst between snapshots spread out (max/mean near 1);
    uniform random placement, measured on the same edges, is far more uneven."""
    edges = [edge(i, cap=10**9) for i in range(16)]
    placer = Placer(k=2, rng=random.Random(1))
    placer.update(edges)
    counts: dict[str, int] = {}
    for _ in range(4096):
        best = placer.place(Request("CONTAINER", 1000, 1))[0]
        counts[best.edge_id] = counts.get(best.edge_id, 0) + 1
    rng = random.Random(1)
    uniform: dict[str, int] = {}
    for _ in range(4096):
        e = rng.choice(edges).edge_id
        uniform[e] = uniform.get(e, 0) + 1
    mean = 4096 / 16
    assert max(counts.values()) / mean <= 1.1
    assert max(uniform.values()) / mean > max(counts.values()) / mean


def test_filters_name_why_nothing_fits() -> None:
    placer = Placer(rng=random.Random(0))
    with pytest.raises(NoEligibleEdge, match="no edges are registered"):
        placer.place(Request("CONTAINER", 100, 100))
    placer.update(
        [
            edge(0, backends=("FNCALL",)),
            edge(1, healthy=False),
            edge(2, cpu=7900, labels={"zone": "b"}),
            edge(3, labels={"zone": "a"}),
        ]
    )
    with pytest.raises(NoEligibleEdge) as info:
        placer.place(Request("CONTAINER", 1000, 100, node_selector={"zone": "b"}))
    msg = str(info.value)
    assert (
        "does not offer CONTAINER" in msg
        and "unhealthy" in msg
        and "not enough free capacity" in msg
    )
    assert "labels do not match" in msg
    assert (
        placer.place(Request("CONTAINER", 1000, 100, node_selector={"zone": "a"}))[0].edge_id
        == "e3"
    )


def test_candidates_exclude_edges_that_rejected() -> None:
    placer = Placer(k=2, max_candidates=3, rng=random.Random(0))
    placer.update([edge(i) for i in range(5)])
    cands = placer.place(Request("CONTAINER", 100, 100, exclude=frozenset({"e0", "e1"})))
    assert len(cands) == 3 and not {c.edge_id for c in cands} & {"e0", "e1"}


def test_cloud_bursting_past_the_threshold() -> None:
    placer = Placer(k=2, burst_threshold=0.8, rng=random.Random(0))
    placer.update([edge(0, cpu=1000), edge(1, cpu=1000), edge(9, cloud=True)])
    assert all(not placer.place(Request("CONTAINER", 100, 1))[0].cloud for _ in range(10))
    placer.update([edge(0, cpu=7000), edge(1, cpu=7000), edge(9, cloud=True)])
    assert placer.onprem_utilization() >= 0.4  # cpu and memory averaged
    placer.burst_threshold = 0.4
    assert placer.place(Request("CONTAINER", 100, 1))[0].cloud


def test_a_fresh_snapshot_drops_overlay_entries_it_already_counts() -> None:
    placer = Placer(k=1, rng=random.Random(0))
    placer.update([edge(0)])
    placer.place(Request("CONTAINER", 2000, 1))
    assert placer.score(placer.edges["e0"]) == pytest.approx(2000 / 8000)
    time.sleep(0.01)
    placer.update([edge(0, cpu=2000)])  # probed after the placement: it is in the snapshot now
    assert placer.score(placer.edges["e0"]) == pytest.approx(2000 / 8000)
