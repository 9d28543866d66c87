"""The watcher's ledger (watcher/ledger.py): what each edge last reported, and the sandboxes of
edges declared lost (domain code: plain values stand in for the protobuf messages it keeps)."""

from __future__ import annotations

import pytest

from watcher import ledger as ledger_module
from watcher.ledger import Reported, SandboxLedger


def rep(
    sid: str,
    project: str = "root/a",
    *,
    task: str = "",
    created: float = 10.0,
    terminated: bool = False,
    **labels: str,
) -> Reported:
    return Reported(sid, project, task, labels, created, terminated, {"id": sid})


def test_polls_keep_what_is_live_and_a_full_poll_replaces_it() -> None:
    led = SandboxLedger(1.0, 60.0)
    assert led.wants_poll("e") and led.poll_since("e") is None  # first: a full poll
    led.polled("e", [rep("a"), rep("b")], "T1", 20.0, full=True)
    assert led.poll_since("e") == "T1" and not led.wants_poll("e")
    led.polled("e", [rep("c"), rep("a", terminated=True)], "T2", 30.0, full=False)
    assert set(led.edges["e"].live) == {"b", "c"} and led.reported("e") == 2
    led.polled("e", [rep("d")], "T3", 40.0, full=True)
    assert set(led.edges["e"].live) == {"d"}


def test_live_ids_drop_what_ended_and_reveal_a_gap() -> None:
    led = SandboxLedger(1.0, 60.0)
    led.polled("e", [rep("a", created=10), rep("b", created=35)], "T", 40.0, full=True)
    led.retain("e", ["a", "b", "x"], as_of=38.0)  # x: no poll returned it, yet it is older
    assert led.poll_since("e") is None  # a gap: the next poll is full
    led.polled("e", [rep("a", created=10), rep("b", created=35)], "T", 40.0, full=True)
    led.retain("e", [], as_of=30.0)  # b is younger than the ids: kept; a ended
    assert set(led.edges["e"].live) == {"b"} and led.poll_since("e") == "T"
    led.retain("e", ["b", "later"], as_of=45.0)  # created after the last poll: no gap
    assert led.poll_since("e") == "T"


def test_a_lost_edge_s_sandboxes_are_found_by_filters_and_expire() -> None:
    led = SandboxLedger(1.0, 60.0)
    led.polled(
        "e",
        [
            rep("a", "root/a", task="t", role="judge"),
            rep("b", "root/a/sub", task="t"),
            rep("c", "root/ab", task="t"),
        ],
        "T",
        20.0,
        full=True,
    )
    led.polled("f", [rep("z", "root/a")], "T", 20.0, full=True)
    assert led.declare_lost("e", now=100.0) == 3
    assert led.declare_lost("e", now=101.0) == 0 and led.is_declared("e")
    assert led.lost_edges == {"e": 100.0} and led.reported("e") == 0

    def ids(**kw: object) -> set[str]:
        return {lost.reported.sandbox_id for lost in led.find(**kw)}  # type: ignore[arg-type]

    assert ids() == {"a", "b", "c"}
    assert ids(project_prefix="root/a") == {"a", "b"}  # its subtree, not the sibling root/ab
    assert ids(task_id="t", labels={"role": "judge"}) == {"a"}
    assert ids(sandbox_ids=["b", "z", "nope"]) == {"b"}
    assert ids(edge_id="f") == set()
    assert led.find(sandbox_ids=["a"])[0].lost_at == 100.0
    led.expire(now=159.0)
    assert ids() == {"a", "b", "c"}
    led.expire(now=161.0)
    assert ids() == set() and led.lost_edges == {}


def test_a_lost_edge_that_comes_back_has_its_survivors_stopped_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    led = SandboxLedger(1.0, 3600.0)
    led.polled("e", [rep("a"), rep("b")], "T", 20.0, full=True)
    led.declare_lost("e", now=100.0)
    assert led.survivors("e") == []  # not back yet
    led.back("e")
    assert not led.is_declared("e") and led.lost_edges == {}
    assert led.poll_since("e") is None  # back: a full poll
    led.polled("e", [rep("a"), rep("new")], "T2", 200.0, full=True)  # it still runs a
    assert led.has_survivors("e") and led.survivors("e") == ["a"]
    assert led.survivors("e") == []  # asked once...
    monkeypatch.setattr(ledger_module, "RESTOP_AFTER_S", 0.0)
    assert led.survivors("e") == ["a"]  # ...and again if it still runs after a while
    led.polled("e", [rep("a", terminated=True)], "T3", 210.0, full=False)
    assert not led.has_survivors("e")
    assert {lost.reported.sandbox_id for lost in led.find()} == {"a", "b"}  # still lost
