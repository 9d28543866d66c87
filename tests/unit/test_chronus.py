"""chronus, the real engine, as a subprocess (`python -m chronus --fd N`)
driven over its framed socket with insandbox.wire (dict form)."""

from __future__ import annotations

import contextlib
import http.server
import itertools
import os
import queue
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from insandbox import wire
from insandbox.proc import descendants, proc_table

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024


class ChronusClient:
    """Multiplexes streams over one channel; one queue of frames per stream."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._ids = itertools.count(1, 2)
        self._queues: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                frame = wire.read_message(self.sock)
            except OSError:
                return
            if frame is None:
                return
            q = self._queues.get(frame.get("stream_id", 0))
            if q is not None:
                q.put(frame)

    def open(self, request: dict[str, Any]) -> int:
        sid = next(self._ids)
        self._queues[sid] = queue.Queue()
        self.send(sid, {"request": request})
        return sid

    def send(self, sid: int, body: dict[str, Any]) -> None:
        with self._lock:
            wire.write_message(self.sock, {"stream_id": sid, **body})

    def next(self, sid: int, timeout: float = 20) -> dict[str, Any]:
        return self._queues[sid].get(timeout=timeout)

    def responses(self, sid: int, timeout: float = 20) -> Iterator[dict[str, Any]]:
        """Responses until the end; raises CallError on a non-zero end."""
        while True:
            frame = self.next(sid, timeout)
            if "end" in frame:
                del self._queues[sid]
                end = frame["end"]
                if end.get("code", 0):
                    raise CallError(end)
                return
            yield frame["response"]

    def call(self, request: dict[str, Any], timeout: float = 20) -> list[dict[str, Any]]:
        return list(self.responses(self.open(request), timeout))

    def one(self, request: dict[str, Any], timeout: float = 20) -> dict[str, Any]:
        (resp,) = self.call(request, timeout)
        ((_, value),) = resp.items()
        return value

    def run(self, command: str, **kw: Any) -> dict[str, Any]:
        return self.one({"exec": {"command": command, **kw}}, kw.get("timeout_s", 0) + 20)


class CallError(Exception):
    def __init__(self, end: dict[str, Any]) -> None:
        super().__init__(f"{end.get('code')} {end.get('reason')}: {end.get('message')}")
        self.code = end.get("code")
        self.reason = end.get("reason")


def start_chronus(work: Path) -> tuple[ChronusClient, subprocess.Popen[bytes]]:
    """The real chronus as a subprocess on a socketpair, as aether runs it."""
    ours, theirs = socket.socketpair()
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        DSEC_CHRONUS_RUNTIME_DIR=str(work / "run"),
        DSEC_CHRONUS_WORKDIR=str(work),
        DSEC_TEST_MARK="sandbox-env",
    )
    # Like an agent in a sandbox, chronus and its commands lack CAP_SYS_PTRACE.
    no_ptrace = ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace"]
    proc = subprocess.Popen(
        [
            *(no_ptrace if shutil.which("setpriv") else []),
            *(sys.executable, "-S", "-m", "chronus", "--fd", str(theirs.fileno())),
        ],
        pass_fds=[theirs.fileno()],
        env=env,
        cwd=work,
        start_new_session=True,
    )
    theirs.close()
    return ChronusClient(ours), proc


def stop_chronus(client: ChronusClient, proc: subprocess.Popen[bytes]) -> None:
    """Kills chronus and everything it started."""
    tree = descendants({proc.pid}, proc_table())
    client.sock.close()
    proc.kill()
    proc.wait()
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def chronus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChronusClient, int, Path]]:
    work = tmp_path_factory.mktemp("chronus")
    client, proc = start_chronus(work)
    try:
        yield client, proc.pid, work
    finally:
        stop_chronus(client, proc)


@pytest.fixture
def client(chronus: tuple[ChronusClient, int, Path]) -> ChronusClient:
    return chronus[0]


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def gone(pid: int) -> bool:
    """Exited (absent, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def eventually(pred: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return bool(pred())


# ----------------------------------------------------------------- exec


def test_exec_captures_output_and_exit_code(client: ChronusClient) -> None:
    r = client.run("echo out; echo err >&2; exit 3")
    assert r["stdout"] == b"out\n" and r["stderr"] == b"err\n"
    assert r["exit"]["exit_code"] == 3
    assert not r["exit"].get("timed_out")
    assert r["exec_id"].startswith("ex-")


def test_exec_argv_env_cwd(client: ChronusClient, tmp_path: Path) -> None:
    r = client.one(
        {
            "exec": {
                "argv": ["sh", "-c", 'echo "$DSEC_TEST_MARK $EXTRA"; pwd'],
                "env": {"EXTRA": "a b"},
                "cwd": str(tmp_path),
            }
        }
    )
    assert r["stdout"] == f"sandbox-env a b\n{tmp_path}\n".encode()
    # the agents' own variables never reach commands
    r = client.run("env | grep -c '^DSEC_CHRONUS_' || true")
    assert r["stdout"] == b"0\n"


def test_exactly_one_of_command_and_argv(client: ChronusClient) -> None:
    for bad in (
        {},
        {"command": "true", "argv": ["true"]},
        {"argv": ["echo", "a\0b"]},  # exec cannot carry a NUL byte
        {"command": "echo a\0b"},
        {"argv": ["true"], "env": {"X": "a\0b"}},
    ):
        with pytest.raises(CallError) as exc:
            client.one({"exec": bad})
        assert (exc.value.code, exc.value.reason) == (3, "INVALID_ARGUMENT")


def test_missing_program_exits_127_with_error(client: ChronusClient) -> None:
    r = client.one({"exec": {"argv": ["/nonexistent/prog"]}})
    assert r["exit"]["exit_code"] == 127
    assert "No such file" in r["exit"]["error"]
    r = client.one({"exec": {"argv": ["true"], "cwd": "/nonexistent-dir"}})
    assert r["exit"]["exit_code"] == 127 and "chdir" in r["exit"]["error"]


def test_timeout_kills_whole_process_group(client: ChronusClient) -> None:
    t0 = time.monotonic()
    r = client.run("sleep 100 & echo $!; sleep 100", timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    ex = r["exit"]
    assert ex["timed_out"] is True and ex["exit_code"] == -1 and ex["signal"] == signal.SIGKILL
    grandchild = int(r["stdout"].split()[0])
    assert eventually(lambda: gone(grandchild)), "the background sleep survived the timeout"


def test_timeout_also_kills_processes_that_left_the_group(client: ChronusClient) -> None:
    # setsid --fork escapes both the process group and the session; it is
    # still a descendant when the timeout fires, so it dies too.
    r = client.run("sh -c 'echo $$; exec sleep 100' & sleep 100", timeout_s=0.5)
    escaped = int(r["stdout"].split()[0])
    assert r["exit"]["timed_out"]
    assert eventually(lambda: gone(escaped))


def test_non_zero_exit_is_not_a_timeout(client: ChronusClient) -> None:
    r = client.run("exit 124", timeout_s=5)
    assert r["exit"]["exit_code"] == 124 and not r["exit"].get("timed_out")
    r = client.run("kill -TERM $$")
    assert r["exit"]["exit_code"] == -1 and r["exit"]["signal"] == signal.SIGTERM
    assert not r["exit"].get("timed_out")


def test_stdin_is_fed_then_closed(client: ChronusClient) -> None:
    r = client.one({"exec": {"command": "wc -c", "stdin": b"x" * 300_000}})
    assert r["stdout"].strip() == b"300000"


def test_background_grandchild_does_not_hold_the_call(client: ChronusClient) -> None:
    t0 = time.monotonic()
    r = client.run("sleep 30 & echo started")
    assert r["stdout"] == b"started\n" and time.monotonic() - t0 < 2
    client.run("pkill -f 'sleep 30' || true")


PIDS_ROOT = Path("/sys/fs/cgroup/pids")


def _settled_count(path: Path, quiet_s: float = 0.3, timeout_s: float = 5.0) -> int:
    """The value of a counter file once it has not changed for quiet_s."""
    deadline = time.monotonic() + timeout_s
    last, since = int(path.read_text()), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = int(path.read_text())
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


@pytest.mark.skipif(
    not (PIDS_ROOT / "cgroup.procs").exists() or os.geteuid() != 0,
    reason="needs root and the cgroup v1 pids controller at /sys/fs/cgroup/pids",
)
def test_a_call_at_the_pids_limit_fails_alone(tmp_path: Path) -> None:
    """At the sandbox's pids limit a new call gets no thread: it fails with RESOURCE_EXHAUSTED
    (PIDS_LIMIT) and chronus serves the next one (it used to exit, which ended every stream:
    CHRONUS_RESTARTED, seen under a fork bomb). A real pids cgroup, full."""
    cg = PIDS_ROOT / f"dsec-test-{os.getpid()}-chronus"
    cg.mkdir()
    client, proc = start_chronus(tmp_path)
    try:
        (cg / "cgroup.procs").write_text(str(proc.pid))
        assert client.run("echo ready")["stdout"] == b"ready\n"
        # The previous call's thread may still be exiting: full at the count it settles at
        # (a slot it frees later gives the next call a thread, whose fork then fails: the
        # same typed error)
        settled = _settled_count(cg / "pids.current")
        (cg / "pids.max").write_text(str(settled))
        with pytest.raises(CallError) as full:
            client.run("echo never")
        assert (full.value.code, full.value.reason) == (8, "PIDS_LIMIT"), full.value
        (cg / "pids.max").write_text("max")
        assert client.run("echo again")["stdout"] == b"again\n"
        assert proc.poll() is None
    finally:
        stop_chronus(client, proc)
        for pid in (cg / "cgroup.procs").read_text().split():  # none left, normally
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        eventually(lambda: not (cg / "cgroup.procs").read_text().split())
        cg.rmdir()


# ------------------------------------------------------------ streaming


def stream_events(client: ChronusClient, request: dict[str, Any]) -> list[dict[str, Any]]:
    return [r["exec_event"] for r in client.call(request)]


def test_stream_order_and_keepalives(client: ChronusClient) -> None:
    events = stream_events(
        client,
        {
            "exec_stream": {
                "command": "echo one; sleep 0.4; echo two >&2; sleep 0.1; echo three",
                "keepalive_interval_ms": 100,
            }
        },
    )
    kinds = [next(iter(e)) for e in events]
    assert kinds[0] == "started" and kinds[-1] == "exit"
    assert "keepalive" in kinds
    data = [
        (k, e[k]["data"], e[k].get("offset", 0))
        for k, e in zip(kinds, events, strict=True)
        if k in ("stdout", "stderr")
    ]
    assert data == [("stdout", b"one\n", 0), ("stderr", b"two\n", 0), ("stdout", b"three\n", 4)]
    assert events[-1]["exit"].get("exit_code", 0) == 0


def test_output_cap_keeps_head_and_tail_and_memory_bounded(
    chronus: tuple[ChronusClient, int, Path],
) -> None:
    client, pid, _ = chronus
    before = rss(pid)
    r = client.run("yes", timeout_s=2.5, max_output_bytes=MIB)
    ex = r["exit"]
    assert ex["timed_out"] and ex["stdout_truncated"]
    assert ex["stdout_bytes"] > 50 * MIB  # yes produced far more than was kept
    assert r["stdout"].startswith(b"y\ny\n") and r["stdout"].endswith(b"y\n")
    assert b"bytes truncated" in r["stdout"]
    assert MIB <= len(r["stdout"]) < MIB + 200
    assert rss(pid) - before < 16 * MIB, "capture grew with the output"


def test_streaming_stops_forwarding_past_the_cap(client: ChronusClient) -> None:
    cap = 256 * 1024
    events = stream_events(
        client,
        {"exec_stream": {"command": "head -c 3000000 /dev/zero", "max_output_bytes": cap}},
    )
    forwarded = sum(len(e["stdout"]["data"]) for e in events if "stdout" in e)
    assert forwarded == cap
    ex = events[-1]["exit"]
    assert ex["stdout_truncated"] and ex["stdout_bytes"] == 3_000_000


# ------------------------------------------- background, attach, wait, signal


def test_background_attach_wait_signal(client: ChronusClient) -> None:
    (resp,) = client.call(
        {
            "exec_stream": {
                "command": "for i in 1 2 3; do echo line$i; done; sleep 30",
                "background": True,
            }
        }
    )
    started = resp["exec_event"]["started"]
    exec_id = started["exec_id"]
    assert started["pid"] > 0

    def listed() -> dict[str, Any]:
        infos = client.one({"list_execs": {}})["execs"]
        return next(i for i in infos if i["exec_id"] == exec_id)

    assert listed()["status"] == 1  # RUNNING
    assert eventually(
        lambda: client.one({"wait_exec": {"exec_id": exec_id, "timeout_s": 0.01}}) is not None
    )
    # attach from offset 6 ("line1\n" already seen): replay, then live
    sid = client.open(
        {"attach_exec": {"exec_id": exec_id, "stdout_offset": 6, "keepalive_interval_ms": 100}}
    )
    assert "started" in client.next(sid)["response"]["exec_event"]
    got = b""
    while got != b"line2\nline3\n":
        ev = client.next(sid)["response"]["exec_event"]
        if "stdout" in ev:
            assert ev["stdout"].get("offset", 0) == 6 + len(got)
            got += ev["stdout"]["data"]
    # wait with a timeout while it runs: RUNNING
    info = client.one({"wait_exec": {"exec_id": exec_id, "timeout_s": 0.2}})["info"]
    assert info["status"] == 1
    assert client.one({"signal_exec": {"exec_id": exec_id, "signal": signal.SIGTERM}})["delivered"]
    info = client.one({"wait_exec": {"exec_id": exec_id}})["info"]
    assert info["status"] == 2 and info["exit"]["signal"] == signal.SIGTERM
    # the attached stream ends with the exit
    while True:
        frame = client.next(sid)
        if "end" in frame:
            break
        last = frame["response"]["exec_event"]
    assert "exit" in last
    assert not client.one({"signal_exec": {"exec_id": exec_id, "signal": 9}}).get("delivered")
    # after exit, attach replays everything held, then the exit
    events = stream_events(client, {"attach_exec": {"exec_id": exec_id}})
    assert (
        b"".join(e["stdout"]["data"] for e in events if "stdout" in e) == b"line1\nline2\nline3\n"
    )


def test_unknown_exec_is_not_found(client: ChronusClient) -> None:
    for req in ({"wait_exec": {"exec_id": "ex-nope"}}, {"attach_exec": {"exec_id": "ex-nope"}}):
        with pytest.raises(CallError) as exc:
            client.call(req)
        assert (exc.value.code, exc.value.reason) == (5, "EXEC_NOT_FOUND")


def test_interactive_stdin_resize_close(client: ChronusClient) -> None:
    sid = client.open({"exec_input": {"start": {"command": "read a; echo got:$a; cat"}}})
    assert "started" in client.next(sid)["response"]["exec_event"]
    client.send(sid, {"request": {"exec_input": {"stdin": b"hello\n"}}})
    assert client.next(sid)["response"]["exec_event"]["stdout"]["data"] == b"got:hello\n"
    client.send(sid, {"request": {"exec_input": {"stdin": b"more"}}})
    client.send(sid, {"request": {"exec_input": {"close_stdin": True}}})
    out = b""
    for resp in client.responses(sid):
        ev = resp["exec_event"]
        if "stdout" in ev:
            out += ev["stdout"]["data"]
        if "exit" in ev:
            assert ev["exit"].get("exit_code", 0) == 0
    assert out == b"more"


def test_pty(client: ChronusClient) -> None:
    r = client.one(
        {
            "exec": {
                "command": "tty; stty size; echo err >&2",
                "pty": True,
                "pty_size": {"rows": 33, "cols": 101},
            }
        }
    )
    lines = r["stdout"].decode().split("\r\n")
    assert lines[0].startswith("/dev/pts/")
    assert lines[1] == "33 101"
    assert "err" in lines[2]  # stderr is merged into the terminal
    # resize of an interactive pty
    sid = client.open({"exec_input": {"start": {"command": "read x; stty size", "pty": True}}})
    client.next(sid)
    client.send(sid, {"request": {"exec_input": {"resize": {"rows": 7, "cols": 9}}}})
    client.send(sid, {"request": {"exec_input": {"stdin": b"\n"}}})
    out = b"".join(
        r["exec_event"]["stdout"]["data"]
        for r in client.responses(sid)
        if "stdout" in r["exec_event"]
    )
    assert b"7 9" in out


def test_cancel_kills_a_foreground_command(client: ChronusClient) -> None:
    sid = client.open({"exec_stream": {"command": "echo $$; sleep 60"}})
    assert "started" in client.next(sid)["response"]["exec_event"]
    pid = int(client.next(sid)["response"]["exec_event"]["stdout"]["data"])
    client.send(sid, {"cancel": {}})
    assert eventually(lambda: gone(pid))


# ------------------------------------------------------------- sessions


def new_session(client: ChronusClient, **kw: Any) -> str:
    return client.one({"create_session": kw})["session"]["session_id"]


def test_session_state_persists(client: ChronusClient, tmp_path: Path) -> None:
    s = new_session(client)
    assert (
        client.run(f"cd {tmp_path} && export FOO='a b' && f() {{ echo fn:$1; }}", session_id=s)[
            "exit"
        ].get("exit_code", 0)
        == 0
    )
    r = client.run('pwd; echo "$FOO"; f x', session_id=s)
    assert r["stdout"] == f"{tmp_path}\na b\nfn:x\n".encode()
    info = next(i for i in client.one({"list_sessions": {}})["sessions"] if i["session_id"] == s)
    assert info["cwd"] == str(tmp_path) and info["shell"].endswith("sh")
    client.one({"close_session": {"session_id": s}})


def test_sessions_are_independent(client: ChronusClient) -> None:
    a, b = new_session(client), new_session(client)
    client.run("X=from-a; cd /", session_id=a)
    r = client.run('echo "[$X]"; pwd', session_id=b)
    assert r["stdout"].startswith(b"[]\n") and r["stdout"] != b"[]\n/\n"
    for s in (a, b):
        client.one({"close_session": {"session_id": s}})


def test_session_multiline_quotes_heredoc_and_errors(client: ChronusClient) -> None:
    s = new_session(client)
    script = """
x='it'"'"'s "quoted" $HOME `x`'
printf '%s\\n' "$x"
cat <<'EOF'
literal $x
EOF
for i in 1 2; do
  echo "loop $i"
done
echo err >&2
exit_code_test() { return 7; }
exit_code_test
"""
    r = client.run(script, session_id=s)
    assert r["stdout"] == b'it\'s "quoted" $HOME `x`\nliteral $x\nloop 1\nloop 2\n'
    assert r["stderr"] == b"err\n" and r["exit"]["exit_code"] == 7
    # a syntax error fails the call, not the session
    r = client.run("if then fi", session_id=s)
    assert r["exit"]["exit_code"] == 2 and b"syntax error" in r["stderr"]
    assert client.run("echo alive", session_id=s)["stdout"] == b"alive\n"
    # stdin, per-call env, argv
    assert client.run("cat", session_id=s, stdin=b"in\n")["stdout"] == b"in\n"
    assert client.run('echo "$ONLY"', session_id=s, env={"ONLY": "once"})["stdout"] == b"once\n"
    assert client.run('echo "[$ONLY]"', session_id=s)["stdout"] == b"[]\n"
    r = client.one({"exec": {"argv": ["printf", "%s|", "a b", "c'd"], "session_id": s}})
    assert r["stdout"] == b"a b|c'd|"
    client.one({"close_session": {"session_id": s}})


def test_session_timeout_keeps_session_usable(client: ChronusClient) -> None:
    s = new_session(client)
    client.run("export KEEP=yes", session_id=s)
    t0 = time.monotonic()
    r = client.run("sleep 100 & echo $!; sleep 100; echo never", session_id=s, timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    assert r["exit"]["timed_out"] and r["exit"]["exit_code"] == -1
    assert b"never" not in r["stdout"]
    straggler = int(r["stdout"].split()[0])
    assert eventually(lambda: gone(straggler)), "a job started by the timed-out call survived"
    # a builtin loop runs in the shell itself: interrupted, the shell survives
    r = client.run("while :; do :; done", session_id=s, timeout_s=0.3)
    assert r["exit"]["timed_out"]
    assert client.run('echo "$KEEP"', session_id=s)["stdout"] == b"yes\n"
    client.one({"close_session": {"session_id": s}})


def test_session_background_service_survives_calls(client: ChronusClient) -> None:
    s = new_session(client)
    r = client.run("sleep 60 & echo $!", session_id=s)
    pid = int(r["stdout"])
    assert client.run("echo next", session_id=s)["stdout"] == b"next\n"
    assert not gone(pid)
    client.one({"close_session": {"session_id": s}})
    assert eventually(lambda: gone(pid)), "close_session left the session's job running"


def test_session_exit_and_errors(client: ChronusClient) -> None:
    s = new_session(client)
    r = client.run("exit 5", session_id=s)
    assert r["exit"]["exit_code"] == 5 and "exited" in r["exit"]["error"]
    with pytest.raises(CallError) as exc:
        client.run("true", session_id=s)
    assert (exc.value.code, exc.value.reason) == (5, "SESSION_NOT_FOUND")
    with pytest.raises(CallError) as exc:
        client.one({"close_session": {"session_id": "se-nope"}})
    assert exc.value.reason == "SESSION_NOT_FOUND"


def test_restore_session_keeps_the_id_cwd_and_env(client: ChronusClient, tmp_path: Path) -> None:
    """A fork's child recreates its source's session under the same id (the edge's call)."""
    sid = "se-1f00d"
    req = {"session": {"cwd": str(tmp_path), "env": {"FOO": "a b"}}, "session_id": sid}
    info = client.one({"restore_session": req})["session"]
    assert info["session_id"] == sid and info["cwd"] == str(tmp_path)
    r = client.run('pwd; echo "$FOO"', session_id=sid)
    assert r["stdout"] == f"{tmp_path}\na b\n".encode()
    with pytest.raises(CallError) as exc:
        client.one({"restore_session": req})
    assert (exc.value.code, exc.value.reason) == (6, "SESSION_EXISTS")
    for bad in ("../x", "se-", "se-XYZ", "ex-12"):
        with pytest.raises(CallError) as exc:
            client.one({"restore_session": {"session": {}, "session_id": bad}})
        assert (exc.value.code, exc.value.reason) == (3, "INVALID_SESSION_ID")
    assert new_session(client) != sid
    client.one({"close_session": {"session_id": sid}})


def test_session_busy_and_background(client: ChronusClient) -> None:
    s = new_session(client)
    (resp,) = client.call(
        {"exec": {"command": "sleep 0.5; echo bg", "session_id": s, "background": True}}
    )
    exec_id = resp["exec_result"]["exec_id"]
    with pytest.raises(CallError) as exc:
        client.run("true", session_id=s)
    assert (exc.value.code, exc.value.reason) == (9, "SESSION_BUSY")
    info = client.one({"wait_exec": {"exec_id": exec_id}})["info"]
    assert info["exit"].get("exit_code", 0) == 0 and info["session_id"] == s
    assert client.run("echo free", session_id=s)["stdout"] == b"free\n"
    client.one({"close_session": {"session_id": s}})


# ---------------------------------------------------------------- files


def test_what_a_write_upload_or_mkdir_for_a_user_creates_is_that_users(
    client: ChronusClient, tmp_path: Path
) -> None:
    """E2B's rule (its envd chowns): the file or directory and the parents the call makes
    belong to the named user and its group; parents that were there stay as they were."""
    nobody = (65534, 65534)  # this host's /etc/passwd: nobody:x:65534:65534
    base = tmp_path / "home"
    base.mkdir()
    f = base / "new" / "deeper" / "f.txt"
    info = client.one(
        {"write_file": {"path": str(f), "data": b"x", "make_parents": True, "user": "nobody"}}
    )["info"]
    assert (info["uid"], info["gid"]) == nobody
    for made in (f, f.parent, f.parent.parent):
        assert (made.stat().st_uid, made.stat().st_gid) == nobody, made
    assert (base.stat().st_uid, base.stat().st_gid) == (0, 0)  # there before: untouched
    # Over an existing root-owned file (an atomic replace), and appending to one.
    g = base / "g.txt"
    g.write_text("root's")
    client.one({"write_file": {"path": str(g), "data": b"mine", "user": "65534"}})
    assert (g.read_text(), g.stat().st_uid) == ("mine", 65534)
    h = base / "h.txt"
    h.write_text("a")
    client.one({"write_file": {"path": str(h), "data": b"b", "append": True, "user": "nobody"}})
    assert (h.read_text(), h.stat().st_uid) == ("ab", 65534)
    d = base / "d1" / "d2"
    client.one({"make_dir": {"path": str(d), "parents": True, "user": "nobody"}})
    assert [p.stat().st_uid for p in (d, d.parent)] == [65534, 65534]
    client.one({"make_dir": {"path": str(base / "d3"), "user": "nobody"}})
    assert (base / "d3").stat().st_uid == 65534
    up = base / "up" / "u.bin"
    header = {"path": str(up), "size_bytes": 4, "make_parents": True, "user": "nobody"}
    sid = client.open({"upload_file": {"header": header}})
    for chunk in (b"ab", b"cd"):
        client.send(sid, {"request": {"upload_file": {"chunk": chunk}}})
    client.send(sid, {"half_close": {}})
    (resp,) = client.responses(sid)
    assert resp["upload_file"]["info"]["uid"] == 65534
    assert (up.read_bytes(), up.stat().st_uid, up.parent.stat().st_uid) == (b"abcd", 65534, 65534)
    # Without a user: chronus's own (root), as before.
    client.one({"write_file": {"path": str(base / "r.txt"), "data": b"r"}})
    assert (base / "r.txt").stat().st_uid == 0
    with pytest.raises(CallError) as exc:
        client.one({"write_file": {"path": str(base / "x"), "data": b"", "user": "no-such"}})
    assert (exc.value.code, exc.value.reason) == (3, "USER_NOT_FOUND")
    assert not (base / "x").exists()


def test_file_ops(client: ChronusClient, tmp_path: Path) -> None:
    p = tmp_path / "d" / "f.txt"
    with pytest.raises(CallError) as exc:
        client.one({"write_file": {"path": str(p), "data": b"x"}})
    assert exc.value.reason == "PATH_NOT_FOUND"
    info = client.one(
        {"write_file": {"path": str(p), "data": b"hello", "make_parents": True, "mode": 0o600}}
    )["info"]
    assert info["size_bytes"] == 5 and info["mode"] == 0o600 and info["type"] == 1
    client.one({"write_file": {"path": str(p), "data": b" world", "append": True}})
    r = client.one({"read_file": {"path": str(p), "offset": 6, "length": 3}})
    assert r["data"] == b"wor" and not r.get("eof")
    r = client.one({"read_file": {"path": str(p)}})
    assert r["data"] == b"hello world" and r["eof"] and r["info"]["mode"] == 0o600
    client.one({"write_file": {"path": str(p), "data": b"new"}})  # atomic replace keeps the mode
    assert p.read_bytes() == b"new" and (p.stat().st_mode & 0o777) == 0o600
    assert not [x for x in p.parent.iterdir() if x.name.startswith(".")]

    with pytest.raises(CallError) as exc:
        client.one({"read_file": {"path": str(tmp_path / "missing")}})
    assert (exc.value.code, exc.value.reason) == (5, "PATH_NOT_FOUND")
    with pytest.raises(CallError) as exc:
        client.one({"read_file": {"path": str(p), "length": 5 * MIB}})
    assert exc.value.code == 3

    listing = client.one({"list_dir": {"path": str(p.parent)}})
    assert [e["path"] for e in listing["entries"]] == [str(p)]
    for i in range(5):
        (tmp_path / f"n{i}").touch()
    listing = client.one({"list_dir": {"path": str(tmp_path), "max_entries": 3}})
    assert len(listing["entries"]) == 3 and listing["truncated"]
    with pytest.raises(CallError) as exc:
        client.one({"list_dir": {"path": str(p)}})
    assert exc.value.reason == "NOT_A_DIRECTORY"

    link = tmp_path / "link"
    link.symlink_to(p)
    st = client.one({"stat_path": {"path": str(link)}})["info"]
    assert st["type"] == 3 and st["symlink_target"] == str(p)
    assert (
        client.one({"stat_path": {"path": str(link), "follow_symlinks": True}})["info"]["type"] == 1
    )
    assert st["modified_at"]["seconds"] > 1_600_000_000

    made = client.one({"make_dir": {"path": str(tmp_path / "a" / "b"), "parents": True}})["info"]
    assert made["type"] == 2 and made["mode"] == 0o755
    client.one({"make_dir": {"path": str(tmp_path / "a" / "b"), "parents": True}})  # idempotent
    with pytest.raises(CallError) as exc:
        client.one({"make_dir": {"path": str(tmp_path / "a")}})
    assert (exc.value.code, exc.value.reason) == (6, "PATH_EXISTS")

    with pytest.raises(CallError) as exc:
        client.one({"remove_path": {"path": str(tmp_path / "a")}})
    assert (exc.value.code, exc.value.reason) == (9, "DIRECTORY_NOT_EMPTY")
    client.one({"remove_path": {"path": str(tmp_path / "a"), "recursive": True}})
    assert not (tmp_path / "a").exists()
    with pytest.raises(CallError) as exc:
        client.one({"remove_path": {"path": str(tmp_path / "a")}})
    assert exc.value.reason == "PATH_NOT_FOUND"

    dst = tmp_path / "moved.txt"
    (tmp_path / "n0").write_text("occupied")
    with pytest.raises(CallError) as exc:
        client.one({"move_path": {"source": str(p), "destination": str(tmp_path / "n0")}})
    assert exc.value.reason == "PATH_EXISTS"
    client.one(
        {"move_path": {"source": str(p), "destination": str(tmp_path / "n0"), "overwrite": True}}
    )
    moved = client.one({"move_path": {"source": str(tmp_path / "n0"), "destination": str(dst)}})[
        "info"
    ]
    assert moved["path"] == str(dst) and dst.read_bytes() == b"new"

    assert client.one({"chmod_path": {"path": str(dst), "mode": 0o751}})["info"]["mode"] == 0o751
    with pytest.raises(CallError) as exc:
        client.one({"chmod_path": {"path": str(tmp_path / "missing"), "mode": 0o600}})
    assert exc.value.reason == "PATH_NOT_FOUND"
    with pytest.raises(CallError) as exc:
        client.one({"stat_path": {"path": ""}})
    assert exc.value.code == 3


def test_stat_and_list_name_owners_and_follow_links_as_envd_reports_them(
    client: ChronusClient, tmp_path: Path
) -> None:
    """A symlink's info is the link's own (size, owner, text) plus, in ``target``, the stat of
    what it finally resolves to at its absolute path; owners are named from /etc/passwd and
    /etc/group (this host's: root:0, nobody:65534, group nogroup:65534), else numbered."""
    real = tmp_path / "dir" / "real.txt"
    real.parent.mkdir()
    real.write_text("hello")
    real.chmod(0o640)
    os.chown(real, 65534, 65534)
    hop = tmp_path / "hop"
    hop.symlink_to("dir/real.txt")  # relative
    link = tmp_path / "link"
    link.symlink_to("hop")  # a chain of two
    os.lchown(link, 4242, 4343)  # ids in neither file

    st = client.one({"stat_path": {"path": str(link)}})["info"]
    assert (st["type"], st["size_bytes"], st["symlink_target"]) == (3, len("hop"), "hop")
    assert (st["uid"], st["gid"], st["owner"], st["group"]) == (4242, 4343, "4242", "4343")
    target = st["target"]
    assert (target["path"], target["type"], target["mode"]) == (str(real), 1, 0o640)
    assert (target["size_bytes"], target["owner"], target["group"]) == (5, "nobody", "nogroup")
    followed = client.one({"stat_path": {"path": str(link), "follow_symlinks": True}})["info"]
    assert (followed["path"], followed["owner"]) == (str(link), "nobody")
    assert "target" not in followed

    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "missing")
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    for path in (dangling, loop):
        info = client.one({"stat_path": {"path": str(path)}})["info"]
        assert info["type"] == 3 and "target" not in info, path
        assert (info["owner"], info["group"]) == ("root", "root")

    listing = {e["path"]: e for e in client.one({"list_dir": {"path": str(tmp_path)}})["entries"]}
    assert listing[str(link)]["target"]["path"] == str(real)
    assert listing[str(hop)]["target"]["path"] == str(real)
    directory = listing[str(tmp_path / "dir")]
    assert directory["owner"] == "root" and "target" not in directory
    assert "target" not in listing[str(dangling)]


def test_account_names_are_read_per_instance_first_line_winning(tmp_path: Path) -> None:
    """Go's os/user without cgo, which envd names owners with: the first line with an id
    wins, "+"/"-" NIS lines and short lines are skipped, a missing id is its number."""
    from chronus.users import AccountNames

    (tmp_path / "passwd").write_text(
        "# comment\n+nis:x:7:7::/:/bin/sh\nshort:x:8:8\n"
        "alice:x:1000:1000::/home/alice:/bin/sh\nalias:x:1000:1000::/:/bin/sh\n"
    )
    (tmp_path / "group").write_text("staff:x:50:alice\nshort:x:51\n")
    names = AccountNames(str(tmp_path))
    assert [names.user(u) for u in (1000, 7, 8, 9)] == ["alice", "7", "8", "9"]
    assert [names.group(g) for g in (50, 51)] == ["staff", "51"]
    # A user added afterwards (by a command) is seen by the next call's instance, not this one.
    with open(tmp_path / "passwd", "a") as f:
        f.write("bob:x:1001:1001::/home/bob:/bin/sh\n")
    assert names.user(1001) == "1001"
    assert AccountNames(str(tmp_path)).user(1001) == "bob"


def test_upload_and_download_50mb_streaming(
    chronus: tuple[ChronusClient, int, Path], tmp_path: Path
) -> None:
    client, pid, _ = chronus
    size = 50 * MIB
    block = os.urandom(MIB)
    target = tmp_path / "big" / "blob.bin"
    base = rss(pid)
    sid = client.open(
        {"upload_file": {"header": {"path": str(target), "size_bytes": size, "make_parents": True}}}
    )
    for i in range(50):
        client.send(sid, {"request": {"upload_file": {"chunk": block[i:] + block[:i]}}})
    client.send(sid, {"half_close": {}})
    (resp,) = client.responses(sid, timeout=60)
    assert resp["upload_file"]["bytes_written"] == size
    assert target.stat().st_size == size
    assert not [x for x in target.parent.iterdir() if x.name != "blob.bin"]

    got = 0
    chunks = 0
    for resp in client.responses(
        client.open({"download_file": {"path": str(target), "chunk_bytes": 2 * MIB}}), 60
    ):
        part = resp["download_chunk"]
        if chunks == 0:
            assert part["info"]["size_bytes"] == size and "chunk" not in part
        else:
            assert part.get("offset", 0) == got
            i = got // MIB
            assert part["chunk"][:16] == (block[i:] + block[:i])[:16]
            got += len(part["chunk"])
        chunks += 1
    assert got == size and chunks == 26
    growth = peak_rss(pid) - base
    print(
        f"\nchronus RSS {base / MIB:.1f} MiB before, peak growth {growth / MIB:.1f} MiB over 50 MiB up+down"
    )
    assert growth < 30 * MIB


def test_upload_size_mismatch_leaves_nothing(client: ChronusClient, tmp_path: Path) -> None:
    target = tmp_path / "short.bin"
    sid = client.open({"upload_file": {"header": {"path": str(target), "size_bytes": 10}}})
    client.send(sid, {"request": {"upload_file": {"chunk": b"12345"}}})
    client.send(sid, {"half_close": {}})
    with pytest.raises(CallError) as exc:
        list(client.responses(sid))
    assert (exc.value.code, exc.value.reason) == (3, "UPLOAD_SIZE_MISMATCH")
    assert list(tmp_path.iterdir()) == []


def test_a_write_over_a_file_is_whole_to_readers_and_leaves_no_temporary(
    client: ChronusClient, tmp_path: Path
) -> None:
    target = tmp_path / "data.bin"
    target.write_bytes(b"old")
    sid = client.open({"upload_file": {"header": {"path": str(target), "size_bytes": 8}}})
    client.send(sid, {"request": {"upload_file": {"chunk": b"new1"}}})
    # Half of it is in the temporary (named as replacing a file: watchers report a WRITE);
    # a reader still sees the old file whole.
    deadline = time.monotonic() + 5
    temps: list[Path] = []
    while time.monotonic() < deadline:
        temps = [p for p in tmp_path.iterdir() if p.name != "data.bin"]
        if temps and temps[0].stat().st_size == 4:
            break
        time.sleep(0.02)
    assert [p.name[: len(".data.bin.dsec-r")] for p in temps] == [".data.bin.dsec-r"]
    assert target.read_bytes() == b"old"
    client.send(sid, {"request": {"upload_file": {"chunk": b"new2"}}})
    client.send(sid, {"half_close": {}})
    (resp,) = client.responses(sid)
    assert resp["upload_file"]["bytes_written"] == 8
    assert target.read_bytes() == b"new1new2"
    # A new empty file (its temporary is renamed once more, to say so) is there, empty, alone.
    client.one({"write_file": {"path": str(tmp_path / "empty"), "data": b"", "mode": 0o640}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin", "empty"]
    st = (tmp_path / "empty").stat()
    assert (st.st_size, st.st_mode & 0o777) == (0, 0o640)


# ----------------------------------------------------------- http, status


def test_http_to_a_service_inside(client: ChronusClient) -> None:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"x" * 1000 if self.path == "/big" else f"path={self.path}".encode()
            self.send_response(200)
            self.send_header("X-Test", "yes")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            n = int(self.headers["Content-Length"])
            body = self.rfile.read(n)[::-1]
            self.send_response(201)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        r = client.one({"http": {"port": port, "path": "/a?b=1"}})
        assert r["status"] == 200 and r["body"] == b"path=/a?b=1"
        assert {"name": "X-Test", "value": "yes"} in r["headers"]
        r = client.one({"http": {"port": port, "method": "POST", "path": "/", "body": b"abc"}})
        assert (r["status"], r["body"]) == (201, b"cba")
        r = client.one({"http": {"port": port, "path": "/big", "max_body_bytes": 100}})
        assert len(r["body"]) == 100 and r["truncated"]
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(CallError) as exc:
        client.one({"http": {"port": port, "path": "/"}})
    assert (exc.value.code, exc.value.reason) == (14, "CONNECTION_REFUSED")
    with pytest.raises(CallError) as exc:
        client.one({"http": {"port": 0}})
    assert exc.value.code == 3


def test_status_and_unimplemented(client: ChronusClient) -> None:
    st = client.one({"status": {}})
    assert st["rss_bytes"] > 0 and st.get("running_execs", 0) >= 0
    with pytest.raises(CallError) as exc:
        client.call({"modified_files": {}})
    assert exc.value.code == 12
    with pytest.raises(CallError) as exc:
        client.run("true", trusted=True)
    assert exc.value.code == 12


def test_every_request_kind_has_its_handler_and_a_missing_one_is_refused_at_start() -> None:
    """chronus's handler table is derived from Request's oneof (the wire schema), in the proto's
    order; an arm without its `Engine._call_<arm>` stops chronus at start, naming the arm."""
    from chronus.engine import CALLS, Engine, handler_table
    from dsec.chronus.v1 import chronus_pb2 as C

    declared = sorted(C.Request.DESCRIPTOR.oneofs_by_name["call"].fields, key=lambda f: f.number)
    assert CALLS == tuple(f.name for f in declared)
    assert list(handler_table(Engine)) == list(CALLS)
    with pytest.raises(
        TypeError, match=r"no handler for Request\.teleport \(Engine\._call_teleport\)"
    ):
        handler_table(Engine, (*CALLS, "teleport"))
    with pytest.raises(ValueError, match="no oneof 'calls'"):  # wire.WireError
        wire.oneof_fields("dsec.chronus.v1.Request", "calls")


def test_commands_inherit_no_descriptors(client: ChronusClient) -> None:
    r = client.run("ls /proc/self/fd")
    assert sorted(int(x) for x in r["stdout"].split()) == [0, 1, 2, 3]  # 3: ls's own dir fd


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs setpriv to drop CAP_SYS_PTRACE")
def test_commands_cannot_reach_chronus_descriptors(
    chronus: tuple[ChronusClient, int, Path],
) -> None:
    client, pid, _ = chronus
    # Same uid, same capabilities: only PR_SET_DUMPABLE 0 stands between an
    # agent's command and chronus's channel socket.
    r = client.run(
        f"readlink /proc/{pid}/fd/0; echo rc=$?; readlink /proc/$$/fd/0 >/dev/null && echo own-ok"
    )
    assert r["stdout"] == b"rc=1\nown-ok\n"


def test_a_unary_result_and_its_end_arrive_in_one_write(tmp_path: Path) -> None:
    """A unary call's last response is written with its end (Stream.reply): the peer (aether,
    then the edge) wakes once for both. A reader blocked in recv() gets both frames from one
    recv(); written separately, the first recv() returns the result alone."""
    ours, theirs = socket.socketpair()  # no ChronusClient: this test reads raw bytes
    env = dict(os.environ, PYTHONPATH=str(ROOT), DSEC_CHRONUS_WORKDIR=str(tmp_path))
    env["DSEC_CHRONUS_RUNTIME_DIR"] = str(tmp_path / "run2")
    proc = subprocess.Popen(
        [sys.executable, "-S", "-m", "chronus", "--fd", str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )
    theirs.close()
    try:
        big = tmp_path / "big"
        big.write_bytes(os.urandom(200 * 1024))
        for n, request in enumerate(
            ({"exec": {"argv": ["true"]}}, {"stat_path": {"path": str(tmp_path)}})
        ):
            sid = 2 * n + 1
            wire.write_message(ours, {"stream_id": sid, "request": request})
            ours.settimeout(20)
            got = ours.recv(1 << 20)
            frames = []
            while got:
                (size,) = struct.unpack(">I", got[:4])
                frames.append(wire.decode(wire.FRAME, got[4 : 4 + size]))
                got = got[4 + size :]
            assert [("response" in f, "end" in f) for f in frames] == [
                (True, False),
                (False, True),
            ], frames
            assert all(f["stream_id"] == sid for f in frames)
        # A body above the coalescing size still arrives whole, then its end.
        wire.write_message(ours, {"stream_id": 9, "request": {"read_file": {"path": str(big)}}})
        first = wire.read_message(ours)
        second = wire.read_message(ours)
        assert first is not None and second is not None
        assert len(first["response"]["read_file"]["data"]) == 200 * 1024
        assert second["end"].get("code", 0) == 0
    finally:
        ours.close()
        proc.kill()
        proc.wait()
