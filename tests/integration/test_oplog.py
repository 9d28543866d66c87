"""Exactly once, provenance and replay: the per-sandbox operation log (edge/oplog.py,
edge/operations.py, libdsec/_oplog.py), on a real cluster with two API servers.

Every test counts how many times a command really ran by what it leaves in the sandbox (a line
appended to a file per run), so "ran once" is observed, not inferred from a response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from common.auth import auth_metadata
from dsec.apiserver.v1 import apiserver_pb2_grpc
from dsec.types.v1 import types_pb2
from dsecctl.cluster import LocalCluster
from libdsec import Client, Sandbox
from libdsec.aio import AsyncClient
from libdsec.errors import (
    InvalidArgument,
    NotFound,
    OperationIdReused,
    OutcomeUnknown,
)
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith, container_edge

pytestmark = pytest.mark.images("busybox")

EDGE = "edge-opl"


@pytest.fixture(scope="module")
def container_cluster(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    # A small body cap, so that the cap test fills it with a few commands.
    edge = container_edge("opl", {"DSEC_EDGE_OPLOG_MAX_MB": "1", "DSEC_EDGE_OPLOG_COPY_KB": "128"})
    with cluster_with("opl", edges=[edge], apiservers=2) as c:
        yield c


@pytest.fixture
def second(container_cluster: LocalCluster) -> Iterator[Client]:
    """A client of the other API server instance."""
    with Client(
        container_cluster.process("apiserver1").address, token=container_cluster.token
    ) as c:
        yield c


def runs(sb: Sandbox, path: str = "/tmp/runs") -> int:
    """How many times the counted command ran (lines it appended)."""
    return int(sb.run(f"touch {path}; wc -l < {path}").stdout.strip())


COUNTED = "echo ran >> /tmp/runs; sleep {s}; echo result-$(wc -l < /tmp/runs)"


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except Exception as exc:  # reported by the test that reads it
            out["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


def test_the_same_operation_id_sent_twice_at_once_runs_once(
    make_sandbox: Callable[..., Sandbox], second: Client
) -> None:
    sb = make_sandbox()
    other = second.get(sb.id)
    t, first = in_thread(lambda: sb.run(COUNTED.format(s=2), operation_id="twice-at-once"))
    wait_for(lambda: runs(sb) == 1, timeout_s=10)
    again = other.run(COUNTED.format(s=2), operation_id="twice-at-once")  # via the other server
    t.join(30)
    assert first["value"].stdout == again.stdout == b"result-1\n", (first, again)
    assert first["value"].exec_id == again.exec_id
    # After the end: the logged result, and still one run.
    late = sb.run(COUNTED.format(s=2), operation_id="twice-at-once")
    assert (late.stdout, late.exit_code) == (b"result-1\n", 0)
    assert runs(sb) == 1
    entry = next(op for op in sb.log() if op.operation_id == "twice-at-once")
    assert (entry.kind, entry.state, entry.exit_code) == ("exec", "SUCCEEDED", 0)
    assert entry.principal_id  # the API server named the caller


def test_a_retry_after_an_api_server_sigkill_mid_command_runs_once(
    container_cluster: LocalCluster, make_sandbox: Callable[..., Sandbox], second: Client
) -> None:
    sb = make_sandbox()
    # The SDK's own call, through the first API server, which dies while the command runs.
    t, first = in_thread(lambda: sb.run(COUNTED.format(s=4), operation_id="api-kill"))
    wait_for(lambda: runs(sb) == 1, timeout_s=10)
    container_cluster.kill("apiserver")
    try:
        # Through the other API server: the running command is joined, not started again.
        via_other = second.get(sb.id).run(COUNTED.format(s=4), operation_id="api-kill")
        assert via_other.stdout == b"result-1\n"
    finally:
        container_cluster.restart("apiserver")
    # The SDK's call rides through: it retries the same id once the server is back.
    t.join(60)
    assert "error" not in first, first
    assert first["value"].stdout == b"result-1\n"
    assert runs(sb) == 1


def test_a_retry_from_a_new_sdk_process_after_a_kill_runs_once(
    container_cluster: LocalCluster, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox()
    script = (
        "import sys; from libdsec import Client\n"
        "c = Client(sys.argv[1], token=sys.argv[2]); sb = c.get(sys.argv[3])\n"
        "print(sb.run(sys.argv[4], operation_id='trainer-step-7').stdout.decode(), end='')\n"
    )
    args = [
        sys.executable,
        "-c",
        script,
        container_cluster.apiserver,
        container_cluster.token,
        sb.id,
        COUNTED.format(s=3),
    ]
    trainer = subprocess.Popen(args, stdout=subprocess.PIPE)
    try:
        wait_for(lambda: runs(sb) == 1, timeout_s=20)
        trainer.kill()  # SIGKILL: no goodbye, no cancel sent
        trainer.wait(10)
        # The trainer comes back and repeats its step with the same id.
        again = subprocess.run(args, capture_output=True, timeout=60, check=True)
    finally:
        trainer.kill()
    assert again.stdout == b"result-1\n"
    assert runs(sb) == 1


def test_an_edge_sigkill_mid_command_answers_outcome_unknown_never_a_second_run(
    container_cluster: LocalCluster, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox()
    t, first = in_thread(lambda: sb.run(COUNTED.format(s=3), operation_id="edge-kill"))
    wait_for(lambda: runs(sb) == 1, timeout_s=10)
    container_cluster.kill(EDGE)
    container_cluster.restart(EDGE)
    t.join(90)
    with pytest.raises(OutcomeUnknown) as err:
        sb.run(COUNTED.format(s=3), operation_id="edge-kill")
    assert err.value.metadata["operation_id"] == "edge-kill"
    assert "exec_id" not in err.value.metadata or err.value.metadata["exec_id"].startswith("ex-")
    # The first caller got no second run either: an unknown outcome, or its result.
    assert "value" not in first or first["value"].stdout == b"result-1\n", first
    assert runs(sb) == 1
    entry = next(op for op in sb.log() if op.operation_id == "edge-kill")
    assert entry.state == "OUTCOME_UNKNOWN"


def test_reused_and_malformed_ids_are_refused_naming_them(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox()
    sb.run("echo one", operation_id="step-1")
    with pytest.raises(OperationIdReused) as err:
        sb.run("echo two", operation_id="step-1")
    assert err.value.code.name == "FAILED_PRECONDITION"
    assert err.value.metadata["operation_id"] == "step-1" and "step-1" in err.value.message
    with pytest.raises(OperationIdReused):  # another kind of call under the same id
        sb.files.write("/tmp/x", "x", operation_id="step-1")
    with pytest.raises(InvalidArgument) as bad:
        sb.run("true", operation_id="x" * 129)
    assert bad.value.reason == "INVALID_OPERATION_ID"
    with pytest.raises(InvalidArgument) as bad:
        sb.run("true", operation_id="has space")
    assert bad.value.reason == "INVALID_OPERATION_ID"
    assert [op.operation_id for op in sb.log()] == ["step-1"]  # nothing refused was logged


def test_file_calls_streams_and_uploads_run_once_by_id(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox()
    for _ in range(2):
        sb.files.write("/tmp/log", "a\n", append=True, operation_id="append-1")
        sb.files.upload(b"payload", "/tmp/up", operation_id="upload-1")
    assert sb.files.read("/tmp/log") == b"a\n"
    with pytest.raises(OperationIdReused):
        sb.files.upload(b"other bytes", "/tmp/up", operation_id="upload-1")
    events = [list(sb.stream(COUNTED.format(s=0), operation_id="stream-1")) for _ in range(2)]
    outs = [b"".join(e.data for e in evs if hasattr(e, "data")) for evs in events]
    assert outs[0] == outs[1] == b"result-1\n"
    started = [sb.start("sleep 30", operation_id="bg-1").exec_id for _ in range(2)]
    assert started[0] == started[1]
    assert len([p for p in sb.processes() if p.running and p.operation_id == "bg-1"]) == 1
    kinds = [(op.kind, op.operation_id) for op in sb.log() if not op.generated_id]
    assert kinds[:4] == [
        ("write_file", "append-1"),
        ("upload_file", "upload-1"),
        ("exec_stream", "stream-1"),
        ("exec_stream", "bg-1"),
    ]


def test_a_cancelled_run_and_a_stream_left_early_kill_their_command(
    container_cluster: LocalCluster, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox()
    for _ in sb.stream("sleep 77", operation_id="left-early"):
        break  # leaves the stream: the command dies with it
    wait_for(lambda: not any(p.running for p in sb.processes() if "77" in p.command), 10)

    async def cancelled_run() -> None:
        async with AsyncClient(container_cluster.apiserver, token=container_cluster.token) as c:
            asb = await c.get(sb.id)
            run = asyncio.ensure_future(asb.run("sleep 66", operation_id="cancelled"))
            await asyncio.sleep(1.0)
            run.cancel()  # the SDK kills it (SignalExec by operation id)
            with contextlib.suppress(asyncio.CancelledError):
                await run
            await asyncio.sleep(0.5)  # the kill is sent in the background

    asyncio.run(cancelled_run())
    wait_for(lambda: not any(p.running for p in sb.processes() if "66" in p.command), 10)
    entry = wait_for(
        lambda: next(op for op in sb.log() if op.operation_id == "cancelled" and op.ended_at)
    )
    assert (entry.state, entry.error_reason) == ("FAILED", "KILLED")
    # By its operation id, a sync run under way can only be killed: another signal is refused.
    t, out = in_thread(lambda: sb.run("sleep 2; echo done", operation_id="sync-term"))
    time.sleep(0.5)
    with grpc.insecure_channel(container_cluster.apiserver) as channel:
        stub = apiserver_pb2_grpc.ExecServiceStub(channel)
        term = types_pb2.SignalExecRequest(sandbox_id=sb.id, operation_id="sync-term", signal=15)
        with pytest.raises(grpc.RpcError) as err:
            stub.SignalExec(term, metadata=auth_metadata(container_cluster.token), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "signal 9" in str(err.value.details())
    t.join(30)
    assert out["value"].stdout == b"done\n"  # refused: the run went on


def test_replay_of_a_20_operation_session_reproduces_files_and_outputs(
    client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox()
    sb.files.mkdir("/work/src")
    for i in range(6):
        sb.files.write(f"/work/src/f{i}.txt", f"line {i}\n" * (i + 1))
        sb.run(f"wc -l /work/src/f{i}.txt; cat /work/src/f*.txt | md5sum")
    sb.files.move("/work/src/f0.txt", "/work/src/moved.txt")
    sb.files.chmod("/work/src/moved.txt", 0o600)
    sb.files.remove("/work/src/f1.txt")
    sb.files.upload(b"\x00\x01binary", "/work/bin.dat")
    with sb.session() as sh:
        sh.run("cd /work/src && export N=7")
        sh.run("ls; echo $N; stat -c %a moved.txt")
    ops = sb.log()
    assert len(ops) >= 20 and [op.seq for op in ops] == list(range(1, len(ops) + 1))
    report = client.replay(sb.id, labels={"test": "replay"})
    try:
        replayed = client.get(report.sandbox_id)
        assert report.reproduced, report.first_divergence
        assert len([s for s in report.steps if not s.skipped]) == len(ops)
        listing = "ls -l /work/src | cut -c1-10,30-; md5sum /work/src/* /work/bin.dat"
        assert replayed.run(listing).stdout == sb.run(listing).stdout
        # A command whose output cannot repeat is reported as the first divergence.
        sb.run("cat /proc/sys/kernel/random/uuid")
        upto = sb.log()[-1].seq
        diverged = client.replay(sb.id, upto=upto, labels={"test": "replay"})
        try:
            first = diverged.first_divergence
            assert first is not None and first.seq == upto and "stdout differs" in first.diff
        finally:
            client.get(diverged.sandbox_id).stop()
    finally:
        client.get(report.sandbox_id).stop()


def test_the_export_and_the_cli_show_the_log(
    container_cluster: LocalCluster, make_sandbox: Callable[..., Sandbox], tmp_path: Any
) -> None:
    sb = make_sandbox()
    sb.run("echo hello", operation_id="greet")
    sb.files.write("/tmp/a", "a")
    out = tmp_path / "trajectory.jsonl"
    assert sb.export_log(out) == 2
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(x["seq"], x["kind"], x["schema"]) for x in lines] == [
        (1, "exec", "dsec.operation/v1"),
        (2, "write_file", "dsec.operation/v1"),
    ]
    assert lines[0]["summary"] == "echo hello" and lines[0]["exit_code"] == 0
    env = {"DSEC_HOME": str(container_cluster.home), "PATH": "/usr/bin:/bin"}
    cli = [sys.executable, "-m", "dsecctl", "sandbox", "log", sb.id]
    text = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert "greet" in text.stdout and "echo hello" in text.stdout and "write_file" in text.stdout
    js = subprocess.run([*cli, "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert [json.loads(x)["operation_id"] for x in js.stdout.splitlines()][:1] == ["greet"]
    # --follow prints what comes next, and ends when the sandbox ends.
    follow = subprocess.Popen([*cli, "--follow"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        sb.run("echo later", operation_id="later")
        sb.stop()
        tail, _ = follow.communicate(timeout=30)
    finally:
        follow.kill()
    assert "later" in tail and follow.returncode == 0


def test_lifecycle_calls_are_logged_in_order_with_their_caller(
    client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox(task_id="oplog-lifecycle")
    sb.run("echo before")
    sb.pause()
    sb.resume()
    client.pause_task("oplog-lifecycle")
    sb.run("echo after")  # resumes it
    sb.stop()
    ops = sb.log()
    assert [op.kind for op in ops] == [
        "exec",
        "pause_sandbox",
        "resume_sandbox",
        "pause_sandbox",  # the task's pause, on this sandbox
        "exec",
        "stop_sandbox",
    ]
    assert all(op.state == "SUCCEEDED" and op.principal_id for op in ops), ops
    assert len({op.principal_id for op in ops}) == 1


def test_the_cap_drops_the_oldest_bodies_and_keeps_every_entry(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox()
    for i in range(6):  # ~300 KiB of output each, over the edge's 1 MiB cap
        sb.run(f"head -c 300000 /dev/zero | tr '\\0' '{i}'", operation_id=f"big-{i}")
    ops = sb.log(with_bodies=True)
    assert [op.operation_id for op in ops] == [f"big-{i}" for i in range(6)]
    assert ops[0].bodies_dropped and not ops[0].stdout and ops[0].stdout_digest
    assert not ops[-1].bodies_dropped and len(ops[-1].stdout) == 300000
    assert sum(len(op.stdout) + len(op.request) for op in ops) <= 1 << 20
    # A retry of an entry whose output was dropped still runs nothing, and says so.
    repeat = sb.run("head -c 300000 /dev/zero | tr '\\0' '0'", operation_id="big-0")
    assert repeat.truncated and repeat.exit_code == 0 and runs(sb) == 0


def test_a_sandbox_whose_log_is_gone_cannot_be_replayed(
    client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox()
    sb.run("true")
    sb.delete()
    with pytest.raises(NotFound) as err:
        client.replay(sb.id)
    assert sb.id in err.value.message
