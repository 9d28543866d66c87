"""Node management without sockets: the watcher's registration checks (clock skew, version,
an id a live edge holds) and health reasons, placement's refusal of DRAINING and of UNHEALTHY
(CLOCK_SKEW) edges, the edge's drain state on disk (durable, fail closed) and dsec's version."""

from __future__ import annotations

import asyncio
import time
import tomllib
from pathlib import Path

import pytest

from common.version import DSEC_VERSION, compatible, major_minor
from dsec.types.v1 import types_pb2
from dsec.watcher.v1 import watcher_pb2
from edge.backends import NullBackend
from edge.drain import DrainFile, DrainState
from edge.manager import Capacity, SandboxManager
from libdsec.errors import EdgeCapacity, NoEligibleEdge
from placement.follower import edge_view
from placement.policy import Placer, Request
from watcher.servicer import edge_status_pb
from watcher.view import ClusterView

ROOT = Path(__file__).resolve().parents[2]


def info(edge_id: str = "e1", version: str = DSEC_VERSION, address: str = "10.0.0.1:7110"):
    return types_pb2.EdgeInfo(
        edge_id=edge_id,
        address=address,
        version=version,
        backends=[types_pb2.BACKEND_CONTAINER],
        cpu_millis_capacity=8000,
        memory_mb_capacity=8192,
    )


def ok(view: ClusterView, edge_id: str = "e1", **kw: object) -> None:
    view.probe_ok(edge_id, None, {}, {}, {}, bool(kw.pop("draining", False)), 1.0, **kw)  # type: ignore[arg-type]


def test_dsec_version_is_the_package_s_and_only_major_minor_must_match() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert DSEC_VERSION == project["version"]
    assert major_minor("1.2.3") == (1, 2) and major_minor("1.2") == (1, 2)
    assert major_minor("") is None and major_minor("one.two") is None
    assert compatible("0.1.9", "0.1.0") and not compatible("0.2.0", "0.1.0")
    assert not compatible("", "0.1.0")  # unknown: fail closed


def test_a_skewed_clock_is_unhealthy_until_a_probe_finds_it_right() -> None:
    view = ClusterView(unhealthy_after=3, forget_after_s=300, max_clock_skew_s=30)
    e = view.register("e1", info(), "i1", sent_at=time.time() + 45)
    assert (e.health, e.health_reason) == ("UNHEALTHY", "CLOCK_SKEW")
    assert 44 < e.clock_skew_s < 46 and "ahead of" in e.health_detail
    # Within the bound once the probe's round trip is allowed for: not skewed.
    ok(view, clock_skew_s=-30.4, clock_skew_error_s=0.5)
    assert (e.health, e.health_reason) == ("HEALTHY", "")
    ok(view, clock_skew_s=-31.0, clock_skew_error_s=0.5)
    assert (e.health, e.health_reason) == ("UNHEALTHY", "CLOCK_SKEW")
    assert "behind" in e.health_detail
    # It answers: neither gone nor lost, however long it stays skewed.
    assert view.gone(after_s=1, now=time.time() + 3600) == []
    ok(view, clock_skew_s=0.01, clock_skew_error_s=0.001)
    assert e.health == "HEALTHY"
    pb = edge_status_pb(e)
    assert pb.health == watcher_pb2.EDGE_HEALTH_HEALTHY and pb.clock_skew_s == pytest.approx(0.01)


def test_another_major_minor_is_unhealthy_and_failing_probes_come_first() -> None:
    view = ClusterView(unhealthy_after=1, forget_after_s=300, dsec_version="0.1.0")
    e = view.register("e1", info(version="0.2.0"), "i1")
    assert (e.health, e.health_reason) == ("UNHEALTHY", "VERSION_MISMATCH")
    assert "0.2.0" in e.health_detail and "0.1.0" in e.health_detail
    view.probe_failed("e1", "UNAVAILABLE: gone")
    assert e.health_reason == "PROBES_FAILING" and "UNAVAILABLE: gone" in e.health_detail
    view.register("e1", info(version="0.1.4"), "i2")  # upgraded and restarted
    ok(view)
    assert (e.health, e.health_reason) == ("HEALTHY", "")


def test_draining_carries_the_operator_s_reason_and_placement_skips_it() -> None:
    view = ClusterView(unhealthy_after=3, forget_after_s=300)
    view.register("e1", info("e1"), "i1")
    view.register("e2", info("e2", address="10.0.0.2:7110"), "i2")
    ok(view, "e1", draining=True, drain_reason="disk swap")
    ok(view, "e2")
    e1 = view.edges["e1"]
    assert (e1.health, e1.health_reason, e1.health_detail) == ("DRAINING", "DRAINING", "disk swap")
    placer = Placer()
    placer.update([edge_view(edge_status_pb(e)) for e in view.edges.values()])
    for _ in range(5):
        assert [c.edge_id for c in placer.place(Request("CONTAINER", 100, 64))] == ["e2"]
    ok(view, "e2", clock_skew_s=99.0)  # the only other edge: UNHEALTHY (CLOCK_SKEW)
    placer.update([edge_view(edge_status_pb(e)) for e in view.edges.values()])
    with pytest.raises(NoEligibleEdge) as refused:
        placer.place(Request("CONTAINER", 100, 64))
    assert "1 draining" in refused.value.message
    # Drained and skewed: UNHEALTHY for the skew, and still known to be drained.
    ok(view, "e1", draining=True, drain_reason="disk swap", clock_skew_s=-99.0)
    pb = edge_status_pb(view.edges["e1"])
    assert (pb.health, pb.health_reason) == (watcher_pb2.EDGE_HEALTH_UNHEALTHY, "CLOCK_SKEW")
    assert pb.draining and pb.drain_reason == "disk swap"
    assert "1 unhealthy (CLOCK_SKEW)" in refused.value.message


def test_an_id_held_by_a_live_edge_elsewhere_is_taken_only_by_its_restart() -> None:
    view = ClusterView(unhealthy_after=2, forget_after_s=300)
    view.register("e1", info(address="10.0.0.1:7110"), "i1")
    ok(view)
    assert view.holder("e1", "10.0.0.9:7110", "other") is view.edges["e1"]
    assert view.holder("e1", "10.0.0.1:7110", "other") is None  # same address: a restart
    assert view.holder("e1", "10.0.0.9:7110", "i1") is None  # same process, moved
    assert view.holder("e2", "10.0.0.9:7110", "other") is None  # nobody holds it
    view.probe_failed("e1", "UNAVAILABLE")  # the holder missed its last probe
    assert view.holder("e1", "10.0.0.9:7110", "other") is None


def test_the_drain_state_is_kept_and_an_unreadable_one_drains(tmp_path: Path) -> None:
    f = DrainFile(tmp_path)
    assert f.load() == DrainState()
    f.save(DrainState(True, "maintenance", 123.0))
    assert DrainFile(tmp_path).load() == DrainState(True, "maintenance", 123.0)
    (tmp_path / "drain.json").write_text("{not json")
    broken = DrainFile(tmp_path).load()
    assert broken.draining and "unreadable" in broken.reason


def test_a_drained_manager_admits_nothing_and_a_failed_save_changes_nothing(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        m = SandboxManager("e1", tmp_path, Capacity(8000, 8192, 10), [NullBackend()])
        state = await m.set_draining(True, "maintenance")
        assert state.draining and state.since > 0
        again = SandboxManager("e1", tmp_path, Capacity(8000, 8192, 10), [NullBackend()])
        assert again.draining and again.drain_state.reason == "maintenance"
        with pytest.raises(EdgeCapacity) as refused:
            again.admission.admit(again_spec())
        assert "draining" in refused.value.message
        # An unwritable state dir: the undrain fails and the edge stays drained.
        (tmp_path / "drain.json").unlink()
        (tmp_path / "drain.json").mkdir()
        with pytest.raises(OSError):
            await again.set_draining(False, "")
        assert again.draining
        (tmp_path / "drain.json").rmdir()
        undrained = await again.set_draining(False, "")
        assert not undrained.draining and not again.draining and undrained.since == 0.0

    asyncio.run(run())


def again_spec():  # type: ignore[no-untyped-def]
    from edge.model import SandboxSpec

    return SandboxSpec(backend="CONTAINER", image="busybox", cpu_millis=100, memory_mb=64)
