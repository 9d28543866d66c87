"""Exec labels and ExecInfo, followed background streams and input by exec id (ControlExec),
end to end: SDK -> apiserver -> edge -> runc -> aether -> chronus, in real container sandboxes
(labelled with the test id and always stopped)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from libdsec import Exited, Output, Sandbox, Started
from libdsec.errors import FailedPrecondition, InvalidArgument, NotFound
from tests.helpers import wait_for

pytestmark = pytest.mark.images("busybox")


def stdout_of(proc_events: Iterator[object]) -> bytes:
    return b"".join(e.data for e in proc_events if isinstance(e, Output) and e.stream == "stdout")


def test_labels_and_exec_info(sandbox: Sandbox) -> None:
    proc = sandbox.start("sleep 30", labels={"role": "server"}, env={"PORT": "8000"}, cwd="/tmp")
    try:
        (info,) = [i for i in sandbox.processes() if i.exec_id == proc.exec_id]
        assert info.running and info.labels == {"role": "server"}
        assert info.argv == ["/bin/sh", "-c", "sleep 30"]
        assert (info.cwd, info.env, info.pty, info.user) == ("/tmp", {"PORT": "8000"}, False, "")
    finally:
        proc.kill()
    with pytest.raises(InvalidArgument) as exc:
        sandbox.run("true", labels={"bad key": "v"})
    assert exc.value.reason == "INVALID_LABEL" and "'bad key'" in exc.value.message


def test_send_stdin_in_order_then_close(sandbox: Sandbox) -> None:
    proc = sandbox.start("cat", stdin_open=True)
    parts = [f"{i}," for i in range(100)]
    for part in parts:
        proc.send_stdin(part)
    proc.close_stdin()
    info = proc.wait(timeout_s=20)
    assert not info.running and info.exit is not None and info.exit.exit_code == 0
    assert stdout_of(proc.attach()) == "".join(parts).encode()
    with pytest.raises(FailedPrecondition) as exc:
        proc.send_stdin(b"late")
    assert exc.value.reason == "EXEC_EXITED"


def test_control_errors(sandbox: Sandbox) -> None:
    with pytest.raises(NotFound) as missing:
        sandbox.process("ex-nope").send_stdin("x")
    assert missing.value.reason == "EXEC_NOT_FOUND"
    proc = sandbox.start("sleep 30")
    try:
        with pytest.raises(FailedPrecondition) as closed:
            proc.send_stdin("x")
        assert closed.value.reason == "STDIN_CLOSED"
        with pytest.raises(FailedPrecondition) as not_pty:
            proc.resize(10, 10)
        assert not_pty.value.reason == "NOT_A_PTY"
    finally:
        proc.kill()


def test_pty_input_and_resize(sandbox: Sandbox) -> None:
    shell = sandbox.start(
        "read x; echo got:$x; trap 'stty size; exit 0' WINCH; echo armed; "
        "while :; do sleep 0.05; done",
        pty=(20, 30),
    )
    shell.send_stdin("hi\n")
    seen = b""
    for ev in shell.attach():
        if isinstance(ev, Output):
            seen += ev.data
            if b"armed" in seen:
                break
    assert b"got:hi" in seen
    shell.resize(7, 9)
    info = shell.wait(timeout_s=20)
    assert info.exit is not None and info.exit.exit_code == 0 and info.pty
    assert b"7 9" in stdout_of(shell.attach())


def test_background_stream_leaves_the_command_running(sandbox: Sandbox) -> None:
    events = sandbox.stream("echo first; sleep 0.5; echo second; sleep 30", background=True)
    started = next(events)
    assert isinstance(started, Started) and started.pid > 0
    first = next(e for e in events if isinstance(e, Output))
    assert first.data == b"first\n"
    events.close()  # the client goes away: the command stays
    proc = sandbox.process(started.exec_id)
    try:
        assert proc.wait(timeout_s=1).running
        rest = b""
        for ev in proc.attach(stdout_offset=len(first.data)):
            if isinstance(ev, Output):
                rest += ev.data
                if b"second\n" in rest:
                    break
        assert rest == b"second\n"
    finally:
        proc.kill()
    wait_for(lambda: not proc.wait(timeout_s=1).running)
    # run to the end, a followed background stream ends with the exit like a foreground one
    last = list(sandbox.stream("echo done; exit 3", background=True))[-1]
    assert isinstance(last, Exited) and last.status.exit_code == 3


def test_run_as_a_user(sandbox: Sandbox) -> None:
    setup = sandbox.run(
        "echo 'alice:x:1000:1000::/home/alice:/bin/sh' >> /etc/passwd && "
        "printf 'alice:x:1000:\\ndev:x:2000:bob,alice\\n' >> /etc/group && "
        "mkdir -p /home/alice && chown 1000:1000 /home/alice && "
        "mkdir /root-only && chmod 700 /root-only"
    )
    assert setup.ok, setup.stderr
    r = sandbox.run('id -u; id -g; id -G; echo "$HOME $USER $LOGNAME"; pwd', user="alice")
    assert r.text.splitlines() == ["1000", "1000", "1000 2000", "/home/alice alice alice",
                                   "/home/alice"]  # fmt: skip
    assert sandbox.run("id -u", user="1000").text == "1000\n"
    denied = sandbox.run("ls /root-only", user="alice")  # root's DAC_OVERRIDE is gone
    assert denied.exit_code != 0 and "Permission denied" in denied.stderr.decode()
    proc = sandbox.start("sleep 30", user="alice", labels={"who": "alice"})
    try:
        (info,) = [i for i in sandbox.processes() if i.exec_id == proc.exec_id]
        assert (info.user, info.cwd, info.labels) == ("alice", "/home/alice", {"who": "alice"})
    finally:
        proc.kill()
    with pytest.raises(InvalidArgument) as exc:
        sandbox.run("true", user="mallory")
    assert exc.value.reason == "USER_NOT_FOUND"
