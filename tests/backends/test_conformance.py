"""One suite, every real backend: lifecycle, exec, files, limits, restart, failure and the
declared capabilities, through the public SDK against a real cluster (see targets.BACKENDS).

Backend-specific knowledge is confined to each backend's entry in targets.py (how the test finds
the sandbox's runtime process from the host, to kill it); everything else is what any caller
sees.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from libdsec import Exited, NetworkPolicy, Output, Sandbox
from libdsec.errors import (
    BackendCapabilityMissing,
    DSecError,
    PathNotFound,
    SandboxTerminated,
)
from tests.backends.conftest import Target
from tests.helpers import wait_for

Make = Callable[..., Sandbox]


def _ended(sb: Sandbox, timeout_s: float = 30.0) -> tuple[str | None, str]:
    info = wait_for(lambda: (i := sb.refresh()).state == "TERMINATED" and i, timeout_s=timeout_s)
    return info.termination_reason, info.termination_message


# ------------------------------------------------------------------ lifecycle


def test_create_run_stop(make: Make, target: Target) -> None:
    sb = make()
    assert sb.info.state == "RUNNING" and sb.info.edge_id == target.edge_id
    assert sb.run("echo up").text == "up\n"
    stopped = sb.stop()
    assert stopped.state == "TERMINATED" and stopped.termination_reason == "STOPPED"
    assert sb.stop().termination_reason == "STOPPED"  # idempotent
    with pytest.raises(SandboxTerminated) as info:
        sb.run("true")
    assert info.value.metadata["termination_reason"] == "STOPPED"


def test_ttl_and_idle_timeout_end_sandboxes_with_their_reason(make: Make) -> None:
    short = make(ttl_s=3)
    idle = make(idle_timeout_s=3)
    assert _ended(short)[0] == "TTL"
    assert _ended(idle)[0] == "IDLE"


def test_a_call_longer_than_the_idle_timeout_is_activity(make: Make) -> None:
    """A command that runs longer than the idle timeout (a slow build, a slow sandbox) does not
    get its sandbox reaped under it: the idle time counts from the call's end."""
    sb = make(idle_timeout_s=2)
    r = sb.run("sleep 5; echo done", timeout_s=30)
    assert r.exit_code == 0 and r.text == "done\n"
    assert sb.refresh().state == "RUNNING"
    assert _ended(sb)[0] == "IDLE"  # and once idle, it is reaped


# ------------------------------------------------------------------ exec


def test_run_output_exit_code_stdin_and_timeout(make: Make) -> None:
    sb = make()
    r = sb.run("echo out; echo err >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr) == (7, b"out\n", b"err\n")
    assert sb.run("cat", stdin=b"from stdin").stdout == b"from stdin"
    t0 = time.monotonic()
    slow = sb.run("sleep 60", timeout_s=1)
    assert slow.timed_out and time.monotonic() - t0 < 15
    # The timed-out command is gone, not left running.
    assert "sleep 60" not in sb.run("ps -o args").text


def test_stream_ends_with_the_exit_status(make: Make) -> None:
    sb = make()
    events = list(sb.stream("for i in 1 2 3; do echo $i; sleep 0.1; done; exit 2"))
    out = b"".join(e.data for e in events if isinstance(e, Output) and e.stream == "stdout")
    assert out == b"1\n2\n3\n"
    assert isinstance(events[-1], Exited) and events[-1].status.exit_code == 2


def test_background_commands_reattach_wait_and_kill(make: Make) -> None:
    sb = make()
    done = sb.start("sleep 0.3; echo finished")
    again = sb.process(done.exec_id)
    finished = again.wait(timeout_s=20)
    assert not finished.running and finished.exit is not None and finished.exit.exit_code == 0
    forever = sb.start("sleep 600")
    assert sb.process(forever.exec_id).wait(timeout_s=0.1).running
    assert forever.kill(signal.SIGKILL)
    ended = forever.wait(timeout_s=20)
    assert not ended.running and ended.exit is not None and ended.exit.signal == signal.SIGKILL


def test_sessions_keep_state_and_pty_is_a_terminal(make: Make) -> None:
    sb = make()
    with sb.session() as sh:
        sh.run("cd /tmp && export STAGE=two")
        assert sh.run("pwd; echo $STAGE").text == "/tmp\ntwo\n"
    assert sb.run("tty", pty=True).text.startswith("/dev/pts/")


def test_output_is_capped_and_says_so(make: Make) -> None:
    sb = make()
    r = sb.run("yes | head -c 3000000", max_output_bytes=65536)
    # Head and tail kept, with a marker between them saying how much was dropped.
    assert r.truncated and len(r.stdout) <= 65536 + 64 and b"bytes truncated" in r.stdout
    assert sb.refresh().violations.get("output_truncations", 0) >= 1


# ------------------------------------------------------------------ files


def test_files_round_trip_and_missing_paths_are_typed(make: Make, tmp_path: Path) -> None:
    sb = make()
    sb.files.mkdir("/work/d")
    sb.files.write("/work/d/a.txt", "alpha")
    assert sb.files.read("/work/d/a.txt") == b"alpha"
    assert sb.files.stat("/work/d/a.txt").size == 5
    sb.files.move("/work/d/a.txt", "/work/d/b.txt")
    assert [Path(f.path).name for f in sb.files.list("/work/d")] == ["b.txt"]
    sb.files.remove("/work/d/b.txt")
    assert not sb.files.exists("/work/d/b.txt")
    with pytest.raises(PathNotFound):
        sb.files.read("/work/nope")
    # Streamed both ways: 8 MiB of random bytes arrive intact.
    blob = os.urandom(8 << 20)
    src, dst = tmp_path / "up.bin", tmp_path / "down.bin"
    src.write_bytes(blob)
    sb.files.upload(str(src), "/work/big.bin")
    assert sb.run("wc -c < /work/big.bin").text.strip() == str(len(blob))
    assert sb.files.download("/work/big.bin", str(dst)) == len(blob)
    assert dst.read_bytes() == blob


def test_http_to_a_port_inside(make: Make, target: Target) -> None:
    sb = make()
    sb.files.write("/www/index.html", "served from inside")
    sb.start(target.backend.http_server.format(port=8000, dir="/www"))
    r = wait_for(lambda: _http_or_none(sb, 8000), timeout_s=30)
    assert r.status == 200 and r.body == b"served from inside"


def _http_or_none(sb: Sandbox, port: int):  # type: ignore[no-untyped-def]
    try:
        return sb.http(port, "/index.html")
    except DSecError:
        return None


# ------------------------------------------------------------------ limits


def test_memory_limit_kills_the_bomb_and_counts_it(make: Make, target: Target) -> None:
    sb = make(memory_mb=target.backend.min_memory_mb)
    r = sb.run("tail /dev/zero", timeout_s=60)  # buffers one endless "line"
    # killed by SIGKILL: seen directly, or as the status of a shell (dash) that ran it
    assert r.signal == signal.SIGKILL or r.exit_code == 128 + signal.SIGKILL, r
    info = wait_for(lambda: (i := sb.refresh()).violations.get("oom_kills", 0) >= 1 and i)
    assert info.state == "RUNNING" and sb.run("echo alive").text == "alive\n"


def test_pids_limit_holds(make: Make) -> None:
    sb = make(pids_max=48)
    sb.run("for i in $(seq 100); do sleep 30 & done; sleep 1", timeout_s=30)
    info = wait_for(lambda: (i := sb.refresh()).violations.get("pids_limit_hits", 0) > 0 and i)
    assert info.violations["pids_limit_hits"] > 0


def test_disk_limit_ends_the_writer_disk_quota(make: Make, target: Target) -> None:
    sb = make(disk_mb=target.backend.small_disk_mb)
    fill = target.backend.fill_mb
    try:
        r = sb.run(f"dd if=/dev/zero of=/work/fill bs=1M count={fill} 2>&1", timeout_s=600)
        assert b"No space left" in r.stdout, r
    except SandboxTerminated as err:
        # The edge may end the sandbox before the writer's answer comes back (a VM's disk
        # guard sees the disk full while dd still runs): the call then ends with the reason.
        assert "DISK_QUOTA" in str(err), err
    assert _ended(sb)[0] == "DISK_QUOTA"


# ------------------------------------------------------------------ failure and restart


def test_a_dying_runtime_ends_the_sandbox_and_every_stream(make: Make, target: Target) -> None:
    sb = make()
    neighbour = make()
    events: list[object] = []
    failure: list[BaseException] = []

    def follow() -> None:
        try:
            for ev in sb.stream("echo started; sleep 600"):
                events.append(ev)
        except BaseException as exc:  # the stream must end with a clear error, not hang
            failure.append(exc)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    wait_for(lambda: any(isinstance(e, Output) for e in events), timeout_s=10)
    for pid in target.backend.init_pids(target.cluster, sb.id):
        os.kill(pid, signal.SIGKILL)
    reader.join(timeout=30)
    assert not reader.is_alive(), "the stream of a dead sandbox hung"
    assert failure and isinstance(failure[0], DSecError), (failure, events)
    reason, message = _ended(sb)
    assert reason == target.backend.runtime_death, message
    assert neighbour.run("echo fine").text == "fine\n"


def test_sandboxes_outlive_an_edge_restart(make: Make, target: Target) -> None:
    sb = make()
    sb.files.write("/work/kept.txt", "before the restart")
    bg = sb.start("sleep 600")
    edge = next(p.name for p in target.cluster.processes if p.name.startswith("edge"))
    target.cluster.kill(edge, signal.SIGKILL)  # a crash: nothing is cleaned up on the way out
    target.cluster.restart(edge)
    wait_for(lambda: _running(sb), timeout_s=30)
    assert sb.files.read("/work/kept.txt") == b"before the restart"
    assert sb.process(bg.exec_id).wait(timeout_s=0.1).running
    # ... and the restarted edge takes creates again once the watcher has seen it healthy.
    wait_for(lambda: _created(make), timeout_s=30)


def _created(make: Make) -> bool:
    try:
        return make().run("true").exit_code == 0
    except DSecError:
        return False


def _running(sb: Sandbox) -> bool:
    try:
        return sb.refresh().state == "RUNNING" and sb.run("true").exit_code == 0
    except DSecError:
        return False


# ------------------------------------------------------------------ capabilities


def test_declared_capabilities_work_and_the_others_are_unimplemented(
    make: Make, target: Target, tmp_path: Path
) -> None:
    sb = make()
    sb.files.write("/work/note.txt", "x")
    checks: dict[str, Callable[[], object]] = {
        "pause": lambda: (sb.pause(), sb.resume()),
        "pack_diff": lambda: sb.pack_diff(f"conformance-{target.backend.name}:{os.getpid()}"),
        "trusted_exec": lambda: sb.run("cat /work/note.txt", trusted=True),
        "network_policy": lambda: sb.update_network_policy(NetworkPolicy()),
        "modified_files": lambda: sb.modified_files(),
    }
    for capability, call in checks.items():
        if capability in target.backend.capabilities:
            call()
        else:
            with pytest.raises(BackendCapabilityMissing) as info:
                call()
            assert info.value.metadata["capability"] == capability
    assert sb.refresh().state == "RUNNING"
    assert (
        sb.run("cat /work/note.txt", trusted="trusted_exec" in target.backend.capabilities).text
        == "x"
    )
    if "pack_diff" in target.backend.capabilities:
        target.client.delete_environment(f"conformance-{target.backend.name}:{os.getpid()}")


def test_fork_copies_the_sandbox_at_one_instant_and_the_children_diverge(
    make: Make, target: Target
) -> None:
    """Every backend that forks: the children have the source's files as they were at the
    fork, each diverges on its own, the source runs on unchanged (what the kind adds, the
    processes of a memory fork, is tested per backend)."""
    sb = make()
    sb.run("mkdir -p /work && echo before > /work/state.txt")
    if "fork" not in target.backend.capabilities:
        with pytest.raises(BackendCapabilityMissing) as info:
            sb.fork(1)
        assert info.value.metadata["capability"] == "fork"
        return
    group = sb.fork(2, labels={"branch": "b"})
    children = group.sandboxes
    try:
        assert group.errors == [] and len(children) == 2
        assert group.kind == target.backend.fork_kind and group.stall_s >= 0
        for i, child in enumerate(children):
            info = child.refresh()
            assert info.state == "RUNNING" and info.forked_from == sb.id
            assert info.edge_id == sb.info.edge_id and info.labels["branch"] == "b"
            assert child.run("cat /work/state.txt").text == "before\n"
            child.run(f"echo child{i} > /work/state.txt && touch /work/only-{i}")
        sb.run("echo after > /work/state.txt")
        for i, child in enumerate(children):
            assert child.run("cat /work/state.txt").text == f"child{i}\n"
            assert child.run(f"ls /work/only-{1 - i}").exit_code != 0  # no sibling's file
        assert sb.run("cat /work/state.txt; ls /work").text == "after\nstate.txt\n"
        assert sb.refresh().state == "RUNNING"
    finally:
        for child in children:
            child.stop()
