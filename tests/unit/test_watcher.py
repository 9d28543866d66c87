"""The watcher's view (counts, health, gone edges) and placement's judgement of
its own view (fresh, degraded, stale), without sockets."""

from __future__ import annotations

import time

from common.version import DSEC_VERSION
from dsec.types.v1 import types_pb2
from placement.follower import KEEPALIVE_S, SnapshotFollower
from placement.policy import Placer
from watcher.view import ClusterView


def edge_info(version: str = DSEC_VERSION, address: str = "127.0.0.1:7110") -> types_pb2.EdgeInfo:
    return types_pb2.EdgeInfo(version=version, address=address)


def test_counts_per_edge_principal_and_task_add_up() -> None:
    view = ClusterView(unhealthy_after=2, forget_after_s=300)
    view.register("e1", edge_info())
    view.register("e2", edge_info())
    view.probe_ok("e1", None, {"root/a": 2}, {"tok1": 2}, {"t": 1}, False, 1.0)
    view.probe_ok(
        "e2", None, {"root/a": 1, "root/b": 3}, {"tok1": 1, "tok2": 3}, {"t": 4}, False, 1.0
    )
    by_project, by_principal, by_task = view.totals()
    assert by_project == {"root/a": 3, "root/b": 3}
    assert by_principal == {"tok1": 3, "tok2": 3}
    assert by_task == {"t": 5}
    assert view.edges["e2"].by_principal == {"tok1": 1, "tok2": 3}


def test_an_edge_unhealthy_for_long_is_gone() -> None:
    view = ClusterView(unhealthy_after=2, forget_after_s=300)
    view.register("e1", edge_info())
    view.register("e2", edge_info())
    view.probe_failed("e1", "UNAVAILABLE")
    assert view.edges["e1"].health == "HEALTHY"  # one failure is not enough
    view.probe_failed("e1", "UNAVAILABLE")
    assert view.edges["e1"].health == "UNHEALTHY"
    assert view.gone(after_s=60) == []
    assert view.gone(after_s=60, now=time.time() + 61) == ["e1"]


def test_a_probe_of_an_edge_s_previous_process_does_not_count_against_the_new_one() -> None:
    view = ClusterView(unhealthy_after=1, forget_after_s=300)
    view.register("e1", edge_info())
    before = time.time()
    time.sleep(0.01)
    view.register("e1", edge_info())  # the edge restarted while a probe of the old one ran
    view.probe_failed("e1", "UNAVAILABLE", started_at=before)
    assert view.edges["e1"].health == "HEALTHY"
    view.probe_failed("e1", "UNAVAILABLE", started_at=time.time())
    assert view.edges["e1"].health == "UNHEALTHY"


def test_a_new_or_returning_edge_is_probed_at_once() -> None:
    """A registration the prober has not judged yet (a new edge, or an UNHEALTHY one back: a
    restarted edge) wakes the prober; a healthy edge's periodic re-registration does not."""
    view = ClusterView(unhealthy_after=1, forget_after_s=300)
    view.register("e1", edge_info())
    assert view.probe_now.is_set()
    view.probe_now.clear()
    view.register("e1", edge_info())  # healthy, re-registering on its interval
    assert not view.probe_now.is_set()
    view.probe_failed("e1", "UNAVAILABLE")
    assert view.edges["e1"].health == "UNHEALTHY"
    view.register("e1", edge_info())  # back
    assert view.probe_now.is_set()


def test_a_restarted_edge_is_not_judged_by_its_previous_process() -> None:
    """Failed probes count against one edge process: a registration from a new one (another
    incarnation) starts the count again and is probed at once; the same process
    re-registering on its interval does neither."""
    view = ClusterView(unhealthy_after=3, forget_after_s=300)
    view.register("e1", edge_info(), "inc-1")
    view.probe_now.clear()
    view.probe_failed("e1", "UNAVAILABLE")
    view.probe_failed("e1", "UNAVAILABLE")
    view.register("e1", edge_info(), "inc-1")  # the same process, on its interval
    assert view.edges["e1"].consecutive_failures == 2 and not view.probe_now.is_set()
    view.register("e1", edge_info(), "inc-2")  # back, before it was marked UNHEALTHY
    assert view.edges["e1"].consecutive_failures == 0 and view.probe_now.is_set()
    view.probe_failed("e1", "UNAVAILABLE")
    assert view.edges["e1"].health == "HEALTHY"
    view.probe_failed("e1", "UNAVAILABLE")
    view.probe_failed("e1", "UNAVAILABLE")
    assert view.edges["e1"].health == "UNHEALTHY"  # the new process's own failures count


def test_placement_judges_its_view() -> None:
    f = SnapshotFollower(Placer(), "unused")
    assert f.view_state(max_age_s=60) == "STALE"  # never heard from the watcher
    f.last_update = time.monotonic()
    f.connected = True
    assert f.view_state(max_age_s=60) == "FRESH"
    f.connected = False  # the stream broke: the last snapshot is still used
    assert f.view_state(max_age_s=60) == "DEGRADED"
    f.connected = True
    f.last_update = time.monotonic() - 3 * KEEPALIVE_S - 1  # a hung watcher
    assert f.view_state(max_age_s=60) == "DEGRADED"
    f.last_update = time.monotonic() - 61
    assert f.view_state(max_age_s=60) == "STALE"
