"""The create queue's serving order (apiserver/queue.py FairShare): weighted fair share
across projects, fair share and priority across a project's tasks, arrival order inside a
task, no credit for time spent idle, and the same order for the same arrivals."""

from __future__ import annotations

import pytest

from apiserver.queue import (
    FairShare,
    _Blocked,
    _first_run,
    _request,
    checked_priority,
    checked_wait_s,
)
from dsec.apiserver.v1 import apiserver_pb2
from dsec.iam.v1 import iam_pb2
from dsec.types.v1 import types_pb2
from libdsec.errors import InvalidArgument, NoEligibleEdge, QuotaExceeded


def entries(
    spec: list[tuple[str, str, int]],
) -> list[iam_pb2.QueueEntry]:
    """(project, task, priority) in arrival order."""
    return [
        iam_pb2.QueueEntry(
            queue_id=f"q{i}",
            project_id=p,
            principal_id=p,
            task_id=t,
            priority=prio,
            seq=i,
        )
        for i, (p, t, prio) in enumerate(spec, 1)
    ]


def names(es: list[iam_pb2.QueueEntry]) -> list[str]:
    return [f"{e.project_id}{e.task_id}" for e in es]


def test_equal_projects_alternate_whatever_the_arrival_order() -> None:
    es = entries([("a", "", 0)] * 5 + [("b", "", 0)] * 5)
    order = FairShare().order(es, 10)
    assert names(order) == ["a", "b"] * 5
    assert [e.seq for e in order if e.project_id == "a"] == [1, 2, 3, 4, 5]  # FIFO inside
    assert FairShare().order(es, 10) == order  # deterministic


def test_weights_give_shares_in_proportion() -> None:
    es = entries([("a", "", 0)] * 30 + [("b", "", 0)] * 30)
    first = names(FairShare().order(es, 30, {}, {"a": 2.0}))
    assert first.count("a") == 20 and first.count("b") == 10


def test_tasks_share_a_project_and_priority_goes_first() -> None:
    es = entries([("p", "t1", 0)] * 4 + [("p", "t2", 0)] * 4 + [("p", "t3", 5)] * 2)
    assert names(FairShare().order(es, 10)) == ["pt3", "pt3"] + ["pt1", "pt2"] * 4


def test_a_project_holding_more_waits_until_the_others_catch_up() -> None:
    """Fair share of the cluster, not of the queue: a (holding 6 already, e.g. its burst took
    the free room before b came) waits until b holds as many; then they alternate."""
    es = entries([("a", "", 0)] * 10 + [("b", "", 0)] * 10)
    order = names(FairShare().order(es, 14, {"a": 6, "b": 0}))
    assert order == ["b"] * 6 + ["a", "b"] * 4
    # Weighted: with weight 2, a's 6 count as 3.
    assert names(FairShare().order(es, 3, {"a": 6, "b": 0}, {"a": 2.0})) == ["b", "b", "b"]


def test_a_task_that_starts_waiting_earns_no_credit_for_idle_time() -> None:
    fair = FairShare()
    t1 = entries([("p", "t1", 0)] * 10)
    fair.placed(fair.order(t1, 6))  # t1 alone for a while: 6 placed
    later = entries([("p", "t2", 0)] * 4)
    for e in later:
        e.seq += 10  # arrived after t1's
    assert names(fair.order(t1[6:] + later, 8)) == ["pt1", "pt2"] * 4


def _sized(e: iam_pb2.QueueEntry, cpu: int, mem: int) -> iam_pb2.QueueEntry:
    spec = types_pb2.SandboxSpec(backend=types_pb2.BACKEND_CONTAINER)
    spec.resources.cpu_millis, spec.resources.memory_mb = cpu, mem
    e.request = apiserver_pb2.CreateSandboxRequest(spec=spec).SerializeToString()
    return e


def test_a_run_is_one_project_and_what_found_no_room_holds_only_as_large() -> None:
    es = entries([("a", "", 0), ("a", "", 0), ("b", "", 0), ("a", "", 0)])
    pairs = [(_sized(e, 1000, 512), _request(e)) for e in es]
    assert [e.queue_id for e, _ in _first_run(pairs)] == ["q1", "q2"]
    assert [e.queue_id for e, _ in _first_run(pairs[2:])] == ["q3"]
    blocked = _Blocked()
    big = _sized(iam_pb2.QueueEntry(project_id="c"), 1000, 4096)
    blocked.add(big, _request(big), NoEligibleEdge("full"))
    small = _sized(iam_pb2.QueueEntry(project_id="d"), 1000, 512)
    bigger = _sized(iam_pb2.QueueEntry(project_id="d"), 2000, 8192)
    assert not blocked.holds(small, _request(small))  # a smaller ask is still tried
    assert blocked.holds(bigger, _request(bigger))
    blocked.add(small, _request(small), QuotaExceeded("d at its quota"))
    tiny = _sized(iam_pb2.QueueEntry(project_id="d"), 10, 16)
    assert blocked.holds(tiny, _request(tiny))  # the whole project waits for its quota


@pytest.mark.parametrize("bad", [-1.0, 86_401.0, float("nan"), float("inf")])
def test_bad_wait_and_priority_are_refused_naming_them(bad: float) -> None:
    with pytest.raises(InvalidArgument, match="wait_s"):
        checked_wait_s(bad)
    with pytest.raises(InvalidArgument, match="priority"):
        checked_priority(1001)
    assert checked_wait_s(0) == 0 and checked_priority(-1000) == -1000
