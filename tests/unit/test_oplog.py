"""The operation log's store (edge/oplog.py) on a real SQLite file: reservation and reuse,
the body cap, recovery after an edge died, retention, persistence across reopening."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.types.v1 import types_pb2
from edge.oplog import (
    FAILED,
    OUTCOME_UNKNOWN,
    RUNNING,
    SUCCEEDED,
    OpLog,
    Reserved,
    request_digest,
)
from libdsec.errors import InvalidArgument, OperationIdReused

SB = "sb-e0-0001"


def exec_request(command: str, op_id: str = "") -> types_pb2.ExecRequest:
    return types_pb2.ExecRequest(sandbox_id=SB, command=command, operation_id=op_id)


def new(log: OpLog, request: types_pb2.ExecRequest, kind: str = "exec") -> types_pb2.Operation:
    got = log.reserve(SB, kind, request, principal_id="p-1")
    assert isinstance(got, Reserved)
    return got.entry


def test_an_id_is_reserved_once_and_a_repeat_gets_the_entry(tmp_path: Path) -> None:
    log = OpLog(tmp_path / "oplog.db")
    entry = new(log, exec_request("make", "step-1"))
    assert (entry.seq, entry.state, entry.principal_id, entry.summary) == (
        1,
        RUNNING,
        "p-1",
        "make",
    )
    entry.exit.exit_code = 0
    log.finish(SB, entry, SUCCEEDED)
    again = log.reserve(SB, "exec", exec_request("make", "step-1"))
    assert isinstance(again, types_pb2.Operation) and again.state == SUCCEEDED
    with pytest.raises(OperationIdReused) as err:
        log.reserve(SB, "exec", exec_request("make install", "step-1"))
    assert err.value.metadata == {"operation_id": "step-1", "seq": "1"}
    with pytest.raises(OperationIdReused):  # the same fields under another call
        log.reserve(SB, "exec_stream", exec_request("make", "step-1"))
    # The id is not part of the digest: a retry is the same request.
    assert request_digest("exec", exec_request("a", "x")) == request_digest(
        "exec", exec_request("a")
    )


def test_calls_without_an_id_get_their_own(tmp_path: Path) -> None:
    log = OpLog(tmp_path / "oplog.db")
    ids = {new(log, exec_request("true")).operation_id for _ in range(50)}
    assert len(ids) == 50
    assert all(e.generated_id for e in log.page(SB)[0])


@pytest.mark.parametrize("bad", ["", "x" * 129, "a b", "ünï", "a;b"])
def test_malformed_ids_are_invalid_argument(tmp_path: Path, bad: str) -> None:
    log = OpLog(tmp_path / "oplog.db")
    if not bad:  # empty: the edge makes one (not an error)
        assert new(log, exec_request("true", bad)).generated_id
        return
    with pytest.raises(InvalidArgument) as err:
        log.reserve(SB, "exec", exec_request("true", bad))
    assert err.value.reason == "INVALID_OPERATION_ID"
    assert log.page(SB)[0] == []


def test_the_cap_drops_the_oldest_bodies_and_keeps_every_entry(tmp_path: Path) -> None:
    log = OpLog(tmp_path / "oplog.db", max_bytes=100_000)
    for i in range(8):
        entry = new(log, exec_request(f"cmd {i}", f"op-{i}"))
        entry.stdout = bytes([65 + i]) * 30_000
        log.finish(SB, entry, SUCCEEDED)
    entries, more = log.page(SB, with_bodies=True)
    assert not more and [e.operation_id for e in entries] == [f"op-{i}" for i in range(8)]
    kept = sum(len(e.stdout) + len(e.request) for e in entries)
    assert kept <= 100_000
    assert [e.bodies_dropped for e in entries] == [True] * 5 + [False] * 3
    assert entries[0].summary == "cmd 0" and entries[-1].stdout == b"H" * 30_000


def test_entries_running_when_the_edge_died_become_outcome_unknown(tmp_path: Path) -> None:
    log = OpLog(tmp_path / "oplog.db")
    done = new(log, exec_request("a", "done"))
    log.finish(SB, done, SUCCEEDED)
    running = new(log, exec_request("b", "running"))
    running.exec_id = "ex-1"
    log.update(SB, running)
    log.close()  # the edge goes; "running" is still RUNNING on disk
    log = OpLog(tmp_path / "oplog.db")
    assert log.recover() == 1
    entry = log.get(SB, "running")
    assert entry is not None and entry.state == OUTCOME_UNKNOWN
    assert entry.error.reason == "OUTCOME_UNKNOWN" and entry.error.metadata["exec_id"] == "ex-1"
    assert log.get(SB, "done").state == SUCCEEDED  # type: ignore[union-attr]
    # Numbering goes on after the reopen.
    assert new(log, exec_request("c", "next")).seq == 3


def test_an_ended_sandbox_s_log_is_kept_for_the_retention_then_swept(tmp_path: Path) -> None:
    log = OpLog(tmp_path / "oplog.db", retention_s=100)
    new(log, exec_request("a"))
    log.ended(SB, at=1000.0)
    assert log.sweep(now=1050.0) == [] and log.has_log(SB)
    assert log.sweep(now=1101.0) == [SB] and not log.has_log(SB)
    at_end = OpLog(tmp_path / "other.db", retention_s=0)
    new(at_end, exec_request("a"))
    at_end.ended(SB)
    assert not at_end.has_log(SB)


def test_a_failed_entry_keeps_its_error(tmp_path: Path) -> None:
    log = OpLog(tmp_path / "oplog.db")
    entry = new(log, exec_request("a", "f"))
    entry.error.reason = "PATH_NOT_FOUND"
    log.finish(SB, entry, FAILED)
    got = log.get(SB, "f")
    assert got is not None and got.state == FAILED and got.error.reason == "PATH_NOT_FOUND"
    assert got.HasField("ended_at")


def test_a_lifecycle_call_without_an_id_field_is_logged_under_the_edge_s(tmp_path: Path) -> None:
    from dsec.edge.v1 import edge_pb2

    log = OpLog(tmp_path / "oplog.db")
    for request in (edge_pb2.PauseSandboxRequest(sandbox_id=SB), edge_pb2.StopSandboxRequest()):
        got = log.reserve(SB, "pause_sandbox", request)
        assert isinstance(got, Reserved) and got.entry.generated_id
    fork = log.reserve(SB, "fork_sandbox", edge_pb2.ForkSandboxRequest(child_ids=["sb-a", "sb-b"]))
    assert isinstance(fork, Reserved) and fork.entry.summary == "sb-a sb-b"


def test_a_stream_s_record_keeps_head_and_tail_and_digests_all() -> None:
    import hashlib

    from edge.operations import StreamRecord

    entry = types_pb2.Operation()
    record = StreamRecord(entry, copy_bytes=100)
    data = bytes(range(256)) * 40  # 10,240 bytes in chunks of 37
    for i in range(0, len(data), 37):
        record.observe(types_pb2.ExecEvent(stdout=types_pb2.OutputChunk(data=data[i : i + 37])))
    record.close()
    assert entry.stdout.startswith(data[:50]) and entry.stdout.endswith(data[-50:])
    assert b"[... 10140 bytes not kept ...]" in entry.stdout
    assert entry.stdout_bytes == len(data)
    assert entry.stdout_digest == hashlib.sha256(data).hexdigest()
    small = types_pb2.Operation()
    record = StreamRecord(small, copy_bytes=100)
    record.observe(types_pb2.ExecEvent(stderr=types_pb2.OutputChunk(data=b"x" * 80)))
    record.close()
    assert small.stderr == b"x" * 80  # under the copy size: whole, no marker
