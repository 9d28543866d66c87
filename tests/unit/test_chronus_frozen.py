"""chronus's timers count running time only (issue 31, "Preemption that lasts").

A paused container is frozen by the cgroup freezer while CLOCK_MONOTONIC runs on; chronus keeps
its deadlines on `chronus.clock`'s running clock, from which its reactor takes the turns it did
not run. Here: the clock and the reactor in this process, then the real chronus as a subprocess
frozen by SIGSTOP (the whole process stops while the clock runs: what the freezer does to it)
or by a real cgroup v1 freezer, across a command's timeout, a session's interrupt grace, a
WaitForPort, a WaitExec and an HTTP request; with controls where nothing freezes.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chronus.clock import MAX_WAIT_S, STALL_S, Clock
from chronus.reactor import Reactor
from chronus.sessions import INTERRUPT_GRACE_S
from tests.unit.test_chronus import CallError, ChronusClient, start_chronus, stop_chronus

FREEZER = Path("/sys/fs/cgroup/freezer")
#: How long the tests freeze chronus: longer than STALL_S + MAX_WAIT_S, so that it is always
#: found, and than the timeouts it lands in.
FREEZE_S = 5.0
#: What a loaded 2-core machine may add to a timer that should fire.
LATE_S = 1.5


# ----------------------------------------------------------------- the clock


def test_a_turn_late_by_more_than_stall_s_is_taken_off_whole() -> None:
    clock = Clock()
    # Late by exactly STALL_S (a turn of 1 s asked for, 2 s taken): still running time.
    assert clock.stalled(100.0, 1.0, 101.0 + STALL_S) == 0.0
    assert clock.stalled(100.0, 0.25, 100.3) == 0.0  # an ordinary late wakeup
    assert clock.stalled_s == 0.0
    # Late by more: the whole turn (where in it the freeze began is unknown).
    assert clock.stalled(100.0, 1.0, 102.5) == pytest.approx(2.5)
    # A turn that asked not to wait (calls were pending) but took 1.2 s.
    assert clock.stalled(200.0, 0.0, 201.2) == pytest.approx(1.2)
    assert clock.stalled_s == pytest.approx(3.7)
    before = time.monotonic()
    now = clock.now()
    assert before - 3.7 <= now + 1e-9 and now <= time.monotonic() - 3.7 + 1e-9


def _stall_reactor(reactor: Reactor, seconds: float) -> None:
    """The reactor's thread does not run its loop for `seconds` (as if frozen, or starved)."""
    reactor.call_soon(lambda: time.sleep(seconds))


def _when(pred: Callable[[], bool], timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.005)
    return time.monotonic()


def test_reactor_timers_and_deadlines_skip_a_stall() -> None:
    """A timer and a Deadline of 1.5 s, then a stall of 2.5 s: both pass 1.5 s of running time
    after they were made, so 2.5 + 1.5 s later (at most MAX_WAIT_S more); the stall is taken
    off the clock."""
    reactor = Reactor()
    reactor.start()
    fired: list[float] = []

    def arm() -> None:
        reactor.call_later(1.5, lambda: fired.append(time.monotonic()))

    t0 = time.monotonic()
    reactor.call_soon(arm)
    deadline = reactor.deadline(1.5)
    cancelled = reactor.deadline(1.5)
    cancelled.cancel()
    time.sleep(0.2)
    _stall_reactor(reactor, 2.5)
    passed = _when(lambda: deadline.passed, 10)
    _when(lambda: bool(fired), 1)
    assert 2.5 + 1.5 - 0.05 <= passed - t0 <= 2.5 + 1.5 + MAX_WAIT_S + LATE_S
    assert 2.5 + 1.5 - 0.05 <= fired[0] - t0 <= 2.5 + 1.5 + MAX_WAIT_S + LATE_S
    assert 2.5 <= reactor.clock.stalled_s <= 2.5 + MAX_WAIT_S + LATE_S
    assert not cancelled.passed


def test_reactor_counts_a_short_stall_as_running_time() -> None:
    """The control: a stall shorter than STALL_S is not taken off: the timer fires on time."""
    reactor = Reactor()
    reactor.start()
    t0 = time.monotonic()
    deadline = reactor.deadline(1.5)
    time.sleep(0.2)
    _stall_reactor(reactor, 0.5)
    passed = _when(lambda: deadline.passed, 10)
    assert 1.5 - 0.05 <= passed - t0 <= 1.5 + LATE_S
    assert reactor.clock.stalled_s == 0.0


# ----------------------------------------------- the real chronus, frozen


def _freezer_usable() -> bool:
    return os.geteuid() == 0 and (FREEZER / "cgroup.procs").exists()


class Pausable:
    """A chronus subprocess and a way to freeze it whole: SIGSTOP, or a cgroup v1 freezer of its
    own (its commands, started after it moved there, freeze with it, as in a paused container)."""

    def __init__(self, client: ChronusClient, pid: int, cgroup: Path | None) -> None:
        self.client, self.cgroup = client, cgroup
        self.pids = [pid]

    def add(self, pid: int) -> None:
        """Freeze `pid` too (a process of the same sandbox)."""
        self.pids.append(pid)
        if self.cgroup is not None:
            (self.cgroup / "cgroup.procs").write_text(str(pid))

    def freeze(self) -> None:
        if self.cgroup is None:
            for pid in self.pids:
                os.kill(pid, signal.SIGSTOP)
            return
        state = self.cgroup / "freezer.state"
        state.write_text("FROZEN")
        _when(lambda: state.read_text().strip() == "FROZEN", 10)

    def thaw(self) -> None:
        if self.cgroup is None:
            for pid in self.pids:
                os.kill(pid, signal.SIGCONT)
        else:
            (self.cgroup / "freezer.state").write_text("THAWED")

    def paused(self, seconds: float = FREEZE_S) -> tuple[float, float]:
        """Frozen for `seconds`: (when it froze, when it thawed), by this process's clock."""
        frozen_at = time.monotonic()
        self.freeze()
        try:
            time.sleep(seconds)
        finally:
            self.thaw()
        return frozen_at, time.monotonic()


@contextlib.contextmanager
def _chronus(work: Path, freezer: bool) -> Iterator[Pausable]:
    client, proc = start_chronus(work)
    cgroup = FREEZER / f"dsec-test-chronus-frozen-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    made = False
    try:
        if freezer:
            cgroup.mkdir()
            made = True
            (cgroup / "cgroup.procs").write_text(str(proc.pid))
        yield Pausable(client, proc.pid, cgroup if freezer else None)
    finally:
        if made:
            (cgroup / "freezer.state").write_text("THAWED")
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        stop_chronus(client, proc)
        if made:
            _remove_cgroup(cgroup)


def _remove_cgroup(cgroup: Path) -> None:
    """Move what is left to the root cgroup, then remove it (exited tasks leave it at once)."""
    deadline = time.monotonic() + 10
    while True:
        for pid in (cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (FREEZER / "cgroup.procs").write_text(pid)
        try:
            cgroup.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture(params=["sigstop", "freezer"])
def pausable(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Pausable]:
    if request.param == "freezer" and not _freezer_usable():
        pytest.skip("needs root and the cgroup v1 freezer at /sys/fs/cgroup/freezer")
    with _chronus(tmp_path, request.param == "freezer") as p:
        yield p


@pytest.fixture
def stoppable(tmp_path: Path) -> Iterator[Pausable]:
    with _chronus(tmp_path, freezer=False) as p:
        yield p


def _started(client: ChronusClient, sid: int) -> float:
    """Reads the stream's started event: when it came."""
    ev = client.next(sid)["response"]["exec_event"]
    assert "started" in ev, ev
    return time.monotonic()


def _exit(client: ChronusClient, sid: int, timeout: float = 30) -> tuple[dict[str, Any], float]:
    """The stream's exit event (keepalives and output skipped) and when it came."""
    while True:
        frame = client.next(sid, timeout)
        assert "end" not in frame, frame
        ev = frame["response"]["exec_event"]
        if "exit" in ev:
            return ev["exit"], time.monotonic()


def test_a_command_timeout_fires_on_time_when_nothing_freezes(stoppable: Pausable) -> None:
    """The control: timeout_s 3 on `sleep 10` kills it 3 s after its start."""
    client = stoppable.client
    sid = client.open({"exec_stream": {"command": "sleep 10", "timeout_s": 3}})
    started = _started(client, sid)
    exit_status, ended = _exit(client, sid)
    assert exit_status["timed_out"] and exit_status["exit_code"] == -1
    assert 3.0 - 0.1 <= ended - started <= 3.0 + LATE_S


def test_a_freeze_does_not_count_in_a_command_timeout(pausable: Pausable) -> None:
    """timeout_s 3 on `sleep 10`, frozen FREEZE_S after 1 s: not timed out at the thaw, but
    once it has run 3 s in all (at most MAX_WAIT_S more: a stall errs on the command's side)."""
    client = pausable.client
    sid = client.open({"exec_stream": {"command": "sleep 10", "timeout_s": 3}})
    started = _started(client, sid)
    time.sleep(1.0)
    frozen_at, thawed = pausable.paused()
    exit_status, ended = _exit(client, sid)
    assert exit_status["timed_out"] and exit_status["exit_code"] == -1
    ran = (frozen_at - started) + (ended - thawed)  # what the command had to run
    assert 3.0 - 0.1 <= ran <= 3.0 + MAX_WAIT_S + LATE_S, (ran, ended - thawed)
    # duration_s stays wall time, the freeze included.
    assert exit_status["duration_s"] >= FREEZE_S + 3.0 - 0.1


def test_a_freeze_does_not_count_in_a_session_interrupt_grace(stoppable: Pausable) -> None:
    """A call whose shell ignores SIGINT times out after 0.5 s; the session is closed when the
    5 s interrupt grace runs out. A freeze 1 s into the grace does not use it up."""
    client = stoppable.client
    session = client.one({"create_session": {}})["session"]["session_id"]
    client.one({"exec": {"command": "trap '' INT", "session_id": session}})
    sid = client.open(
        {
            "exec_stream": {
                "command": "while :; do sleep 0.2; done",
                "session_id": session,
                "timeout_s": 0.5,
            }
        }
    )
    started = _started(client, sid)
    time.sleep(1.5)
    frozen_at, thawed = stoppable.paused()
    exit_status, ended = _exit(client, sid)
    assert exit_status["timed_out"] and exit_status["error"] == "the session was closed"
    grace = (frozen_at - started - 0.5) + (ended - thawed)
    assert INTERRUPT_GRACE_S - 0.1 <= grace <= INTERRUPT_GRACE_S + 0.25 + LATE_S, grace


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_a_freeze_does_not_count_in_a_wait_for_port(stoppable: Pausable) -> None:
    """WaitForPort with timeout_s 3, frozen FREEZE_S after 1 s: still waiting 1 s after the thaw
    (running time 2 s at most), so a listener that opens then is seen."""
    client = stoppable.client
    port = _free_port()
    opened = time.monotonic()
    sid = client.open({"wait_for_port": {"port": port, "timeout_s": 3}})
    time.sleep(1.0)
    stoppable.paused()
    time.sleep(1.0)
    with socket.create_server(("127.0.0.1", port)):
        (resp,) = client.responses(sid)
    waited = resp["wait_for_port"].get("waited_s", 0.0)
    assert time.monotonic() - opened > FREEZE_S + 3.0 - 1.0  # past the wall-clock deadline
    assert 0.9 <= waited < 3.0  # what it ran: about 1 s before the freeze and 1 s after


def test_a_freeze_does_not_count_in_a_wait_exec_timeout(stoppable: Pausable) -> None:
    """WaitExec with timeout_s 3 on a running command, frozen FREEZE_S after 1 s: it answers
    RUNNING once it has waited 3 s of running time, not at the thaw. (The wait it replaced
    counted its 0.25 s polls, which a freeze also could not use up; this pins the Deadline.)"""
    client = stoppable.client
    (resp,) = client.call({"exec_stream": {"command": "sleep 30", "background": True}})
    exec_id = resp["exec_event"]["started"]["exec_id"]
    result: list[tuple[dict[str, Any], float]] = []

    def wait() -> None:
        info = client.one({"wait_exec": {"exec_id": exec_id, "timeout_s": 3}}, timeout=30)
        result.append((info["info"], time.monotonic()))

    asked = time.monotonic()
    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(1.0)
    frozen_at, thawed = stoppable.paused()
    waiter.join(30)
    ((info, answered),) = result
    assert info["status"] == 1  # still RUNNING
    waited = (frozen_at - asked) + (answered - thawed)
    assert 3.0 - 0.1 <= waited <= 3.0 + MAX_WAIT_S + LATE_S, waited
    client.one({"signal_exec": {"exec_id": exec_id, "signal": signal.SIGKILL}})


def test_wait_for_port_gives_up_on_time_when_nothing_freezes(stoppable: Pausable) -> None:
    """The control: nothing listens, timeout_s 1: PORT_NOT_LISTENING 1 s later."""
    asked = time.monotonic()
    with pytest.raises(CallError) as exc:
        stoppable.client.one({"wait_for_port": {"port": _free_port(), "timeout_s": 1}})
    assert (exc.value.code, exc.value.reason) == (4, "PORT_NOT_LISTENING")
    assert 1.0 - 0.05 <= time.monotonic() - asked <= 1.0 + LATE_S


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # the client gave up (its timeout) before the answer


@contextlib.contextmanager
def _slow_server(delay: float) -> Iterator[int]:
    """An HTTP server in this process that answers "late" `delay` s after a GET."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            time.sleep(delay)
            self.send_response(200)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"late")

        def log_message(self, *args: Any) -> None:
            pass

    server = _QuietServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_an_http_timeout_fires_on_time_when_nothing_freezes(stoppable: Pausable) -> None:
    """The control: an answer 3 s away, timeout_s 1: HTTP_TIMEOUT 1 s later."""
    with _slow_server(3.0) as port:
        asked = time.monotonic()
        with pytest.raises(CallError) as exc:
            stoppable.client.one({"http": {"port": port, "timeout_s": 1}})
        assert (exc.value.code, exc.value.reason) == (4, "HTTP_TIMEOUT")
        assert 1.0 - 0.05 <= time.monotonic() - asked <= 1.0 + MAX_WAIT_S + LATE_S


#: A service of the sandbox, frozen with chronus: it answers a GET after 2 s of its own running
#: time (20 naps of 0.1 s: a freeze counts as one nap), so after the thaw.
SLOW_SERVICE = """
import http.server, sys, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        for _ in range(20):
            time.sleep(0.1)
        self.send_response(200)
        self.send_header("Content-Length", "4")
        self.end_headers()
        self.wfile.write(b"late")
    def log_message(self, *a):
        pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def test_a_freeze_does_not_count_in_an_http_timeout(pausable: Pausable) -> None:
    """timeout_s 3 on a service that answers after 2 s of its running time, both frozen
    FREEZE_S 1 s into the request: the answer comes 1 s after the thaw, well within 3 s of
    running time, and is read (not an HTTP_TIMEOUT at the thaw)."""
    service = subprocess.Popen([sys.executable, "-c", SLOW_SERVICE], stdout=subprocess.PIPE)
    try:
        pausable.add(service.pid)
        assert service.stdout is not None
        port = int(service.stdout.readline())
        client = pausable.client
        asked = time.monotonic()
        sid = client.open({"http": {"port": port, "timeout_s": 3}})
        time.sleep(1.0)
        pausable.paused()
        (resp,) = client.responses(sid)
        assert time.monotonic() - asked > FREEZE_S + 1.5  # past the wall-clock timeout
        assert resp["http"]["status"] == 200 and resp["http"]["body"] == b"late"
    finally:
        service.kill()
        service.wait()
