"""The dashboard's pieces without a cluster (apiserver/dashboard.py, apiserver/statelog.py): the
state log's changes, bounds and scoping, the JSON views, the event framing and the page's
security headers.

Against a real cluster, in the browser too: tests/integration/test_dashboard.py."""

from __future__ import annotations

import json

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from apiserver.config import ApiServerConfig
from apiserver.dashboard import PAGE, csp, recent, sandbox_json, sse
from apiserver.routing import within
from apiserver.statelog import StateLog
from common.config import ConfigError, load
from dsec.types.v1 import types_pb2


def seen(log: StateLog, sandbox_id: str, state: str, project: str = "root/a", task: str = "t"):
    return log.observe(at=1.0, sandbox_id=sandbox_id, project_id=project, task_id=task, state=state)


def test_a_repeat_is_not_a_change() -> None:
    log = StateLog()
    first = seen(log, "sb-1", "RUNNING")
    assert first is not None and first.previous == "" and first.state == "RUNNING"
    assert seen(log, "sb-1", "RUNNING") is None  # a watch is at least once
    paused = seen(log, "sb-1", "PAUSED")
    assert paused is not None and (paused.previous, paused.state) == ("RUNNING", "PAUSED")
    assert [c.state for c in log.history(lambda p: True)] == ["RUNNING", "PAUSED"]


def test_history_is_scoped_to_the_callers_subtree_and_task() -> None:
    log = StateLog()
    seen(log, "sb-a", "RUNNING", project="root/a", task="t1")
    seen(log, "sb-ab", "RUNNING", project="root/a/b", task="t2")
    seen(log, "sb-ax", "RUNNING", project="root/ax", task="t1")  # a sibling with a prefix name
    mine = log.history(lambda p: within(p, "root/a"))
    assert [c.sandbox_id for c in mine] == ["sb-a", "sb-ab"]
    assert [c.sandbox_id for c in log.history(lambda p: within(p, "root/a"), "t1")] == ["sb-a"]
    assert [c.sandbox_id for c in log.history(lambda p: within(p, "root/a/b"))] == ["sb-ab"]


def test_the_log_is_bounded() -> None:
    log = StateLog(max_changes=3, max_sandboxes=2)
    for i in range(5):
        seen(log, f"sb-{i}", "RUNNING")
    assert len(log) == 3
    assert [c.sandbox_id for c in log.history(lambda p: True)] == ["sb-2", "sb-3", "sb-4"]
    # sb-0's last state was forgotten (only 2 kept): seen again, it is first seen again
    again = seen(log, "sb-0", "RUNNING")
    assert again is not None and again.previous == ""
    with pytest.raises(ValueError):
        StateLog(max_changes=0)


def test_a_seeded_state_is_the_previous_of_the_first_change() -> None:
    log = StateLog()
    log.seed("sb-1", "RUNNING")
    assert len(log) == 0
    assert seen(log, "sb-1", "RUNNING") is None
    paused = seen(log, "sb-1", "PAUSED")
    assert paused is not None and paused.previous == "RUNNING"
    log.seed("sb-1", "RUNNING")  # older than what was observed: ignored
    resumed = seen(log, "sb-1", "RUNNING")
    assert resumed is not None and resumed.previous == "PAUSED"


def test_start_forgets_and_says_since_when() -> None:
    log = StateLog()
    seen(log, "sb-1", "RUNNING")
    log.start(123.0)
    assert log.since == 123.0 and len(log) == 0
    assert seen(log, "sb-1", "RUNNING") is not None


def _stamp(seconds: float) -> Timestamp:
    t = Timestamp()
    t.FromNanoseconds(int(seconds * 1e9))
    return t


def test_sandbox_json_names_states_and_reasons() -> None:
    sb = types_pb2.Sandbox(
        id="sb-e0-1",
        project_id="root/a",
        state=types_pb2.SANDBOX_STATE_TERMINATED,
        edge_id="e0",
        created_at=_stamp(100.0),
        spec=types_pb2.SandboxSpec(
            image="busybox", task_id="t", resources=types_pb2.Resources(cpu_millis=500)
        ),
        termination=types_pb2.Termination(
            reason=types_pb2.TERMINATION_REASON_STOPPED, message="stopped", at=_stamp(160.5)
        ),
    )
    view = sandbox_json(sb)
    assert view["state"] == "TERMINATED" and view["termination_reason"] == "STOPPED"
    assert view["created_at"] == 100.0 and view["terminated_at"] == 160.5
    assert view["started_at"] is None and view["queue_position"] is None
    assert view["task_id"] == "t" and view["cpu_millis"] == 500 and view["backend"] == "unspecified"
    running = sandbox_json(types_pb2.Sandbox(id="x", state=types_pb2.SANDBOX_STATE_RUNNING))
    assert running["termination_reason"] is None and running["terminated_at"] is None
    # a state newer than this server's protos: its number, not an error
    assert sandbox_json(types_pb2.Sandbox(id="y", state=99))["state"] == "99"  # type: ignore[arg-type]


def test_recent_keeps_live_ones_and_the_latest_ends() -> None:
    sbs = [
        {"id": "live-old", "state": "RUNNING", "created_at": 1.0, "terminated_at": None},
        {"id": "old", "state": "TERMINATED", "created_at": 0.0, "terminated_at": 1.0},
        {"id": "live-new", "state": "PAUSED", "created_at": 5.0, "terminated_at": None},
        {"id": "new", "state": "TERMINATED", "created_at": 0.0, "terminated_at": 3.0},
        {"id": "mid", "state": "TERMINATED", "created_at": 0.0, "terminated_at": 2.0},
    ]
    assert [s["id"] for s in recent(sbs, 5, 2)] == ["live-old", "live-new", "new", "mid"]
    assert [s["id"] for s in recent(sbs, 1, 0)] == ["live-new"]


def test_events_are_one_json_line_each() -> None:
    frame = sse("sandbox", {"text": "two\nlines"})
    name, data, end = frame.split("\n", 2)
    assert name == "event: sandbox" and end == "\n"
    assert json.loads(data.removeprefix("data: ")) == {"text": "two\nlines"}


def test_the_page_runs_only_its_own_inline_code() -> None:
    policy = csp("n0nce")
    assert "script-src 'nonce-n0nce'" in policy and "default-src 'none'" in policy
    assert "connect-src 'self'" in policy and "unsafe-inline" not in policy
    # every script and style of the page carries the nonce; nothing is loaded from elsewhere
    assert PAGE.count("<script") == PAGE.count('<script nonce="{{nonce}}">') == 1
    assert PAGE.count("<style") == PAGE.count('<style nonce="{{nonce}}">') == 1
    assert "http://" not in PAGE and "https://" not in PAGE and "innerHTML" not in PAGE


def test_the_feeds_idle_time_is_read_and_checked() -> None:
    cfg = load(ApiServerConfig, "APISERVER", {"DSEC_APISERVER_DASHBOARD_IDLE_S": "30"})
    assert cfg.dashboard_idle_s == 30.0
    for bad in ("0", "nan", "-5"):
        with pytest.raises(ConfigError, match="DSEC_APISERVER_DASHBOARD_IDLE_S"):
            load(ApiServerConfig, "APISERVER", {"DSEC_APISERVER_DASHBOARD_IDLE_S": bad})
