"""The SDK's typed results of task-level operations, from the API server's messages."""

from __future__ import annotations

from dsec.apiserver.v1 import apiserver_pb2
from dsec.types.v1 import types_pb2
from libdsec import TaskResult
from libdsec.errors import SandboxTerminated, Unavailable


def _response() -> apiserver_pb2.PauseTaskResponse:
    resp = apiserver_pb2.PauseTaskResponse()
    ok = resp.results.add(sandbox_id="sb-e1-aaaaaa01", edge_id="e1")
    ok.sandbox.id = "sb-e1-aaaaaa01"
    ok.sandbox.state = types_pb2.SANDBOX_STATE_PAUSED
    ok.sandbox.spec.task_id = "job"
    ok.sandbox.spec.labels["episode"] = "0"
    resp.results.add(
        sandbox_id="sb-e1-aaaaaa02",
        edge_id="e1",
        error=types_pb2.ItemStatus(
            code=9,  # FAILED_PRECONDITION
            reason="SANDBOX_TERMINATED",
            message="sandbox sb-e1-aaaaaa02 has terminated (STOPPED: stopped by request)",
            metadata={"state": "TERMINATED", "termination_reason": "STOPPED"},
        ),
    )
    resp.edge_errors.add(
        edge_id="e2",
        error=types_pb2.ItemStatus(code=14, reason="EDGE_UNAVAILABLE", message="edge: unreachable"),
    )
    return resp


def test_each_sandbox_gets_its_info_or_its_typed_error() -> None:
    r = TaskResult.from_pb(_response())
    assert len(r) == 2 and not r.ok
    first, second = list(r)
    assert first.ok and first.state == "PAUSED" and first.error is None
    assert first.info is not None and first.info.labels == {"episode": "0"}
    assert not second.ok and second.state is None and second.info is None
    assert isinstance(second.error, SandboxTerminated)
    assert second.error.reason == "SANDBOX_TERMINATED"
    assert second.error.metadata == {"state": "TERMINATED", "termination_reason": "STOPPED"}
    assert r.failed == [second]
    assert [i.id for i in r.sandboxes] == ["sb-e1-aaaaaa01"]


def test_an_edge_that_did_not_answer_is_its_own_entry() -> None:
    r = TaskResult.from_pb(_response())
    [edge] = r.edge_errors
    assert edge.edge_id == "e2" and isinstance(edge.error, Unavailable)
    assert edge.error.reason == "EDGE_UNAVAILABLE"


def test_a_task_without_sandboxes_is_an_empty_ok_result() -> None:
    r = TaskResult.from_pb(apiserver_pb2.StopTaskResponse())
    assert r.ok and len(r) == 0 and r.failed == [] and r.sandboxes == []
