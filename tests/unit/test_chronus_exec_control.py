"""chronus (the real engine, a subprocess on its framed socket): exec labels and the richer
ExecInfo, background streams that follow (ExecRequest.follow) and input by exec id
(ControlExec)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_chronus import (
    CallError,
    ChronusClient,
    eventually,
    start_chronus,
    stop_chronus,
)

INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION = 3, 5, 9


@pytest.fixture(scope="module")
def chronus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChronusClient, Path]]:
    work = tmp_path_factory.mktemp("chronus-exec")
    client, proc = start_chronus(work)
    try:
        yield client, work
    finally:
        stop_chronus(client, proc)


@pytest.fixture
def client(chronus: tuple[ChronusClient, Path]) -> ChronusClient:
    return chronus[0]


def gone(pid: int) -> bool:
    """Exited (absent, or a zombie nobody reaped yet); reading a process mid-exit can fail with
    ESRCH."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def info_of(client: ChronusClient, exec_id: str) -> dict[str, Any]:
    infos = client.one({"list_execs": {}})["execs"]
    return next(i for i in infos if i["exec_id"] == exec_id)


def start_background(client: ChronusClient, **req: Any) -> dict[str, Any]:
    (resp,) = client.call({"exec_stream": {"background": True, **req}})
    started: dict[str, Any] = resp["exec_event"]["started"]
    return started


def control(client: ChronusClient, exec_id: str, **action: Any) -> dict[str, Any]:
    return client.one({"control_exec": {"exec_id": exec_id, **action}})


def control_error(client: ChronusClient, exec_id: str, **action: Any) -> CallError:
    with pytest.raises(CallError) as exc:
        control(client, exec_id, **action)
    return exc.value


def wait_exit(client: ChronusClient, exec_id: str) -> dict[str, Any]:
    info = client.one({"wait_exec": {"exec_id": exec_id, "timeout_s": 10}})["info"]
    assert info["status"] == 2, info
    exit_status: dict[str, Any] = info["exit"]
    return exit_status


def stdout_until(client: ChronusClient, sid: int, needle: bytes) -> bytes:
    out = b""
    while needle not in out:
        ev = client.next(sid)["response"]["exec_event"]
        assert "exit" not in ev, (out, ev)
        out += ev.get("stdout", {}).get("data", b"")
    return out


# ------------------------------------------------------------ labels and ExecInfo


def test_exec_info_reports_labels_argv_cwd_env_user(client: ChronusClient, tmp_path: Path) -> None:
    labels = {"role": "server", "e2b.dev/tag": "x" * 1024}
    started = start_background(
        client, command="sleep 30", labels=labels, env={"ADDED": "1"}, cwd=str(tmp_path)
    )
    try:
        info = info_of(client, started["exec_id"])
        assert info["labels"] == labels
        assert info["argv"] == ["/bin/sh", "-c", "sleep 30"]
        assert info["cwd"] == str(tmp_path)
        assert info["env"] == {"ADDED": "1"}  # only what the request added
        assert not info.get("pty") and info.get("user", "") == ""
    finally:
        client.one({"signal_exec": {"exec_id": started["exec_id"], "signal": 9}})


def test_exec_info_of_an_argv_under_a_pty_has_the_default_cwd(
    chronus: tuple[ChronusClient, Path],
) -> None:
    client, work = chronus
    started = start_background(client, argv=["sleep", "30"], pty=True)
    try:
        info = info_of(client, started["exec_id"])
        assert info["argv"] == ["sleep", "30"]
        assert info["cwd"] == str(work)  # the sandbox workdir
        assert info["pty"] is True
        assert info.get("labels", {}) == {} and info.get("env", {}) == {}
    finally:
        client.one({"signal_exec": {"exec_id": started["exec_id"], "signal": 9}})


@pytest.mark.parametrize(
    ("labels", "named"),
    [
        ({f"k{i}": "v" for i in range(17)}, "at most 16 labels"),
        ({"has space": "v"}, "'has space'"),
        ({"": "v"}, "''"),
        ({"k" * 64: "v"}, "k" * 64),
        ({"ünï": "v"}, "'ünï'"),
        ({"big": "é" * 513}, "'big'"),  # 1026 bytes
    ],
)
def test_bad_labels_are_invalid_argument_naming_the_key(
    client: ChronusClient, labels: dict[str, str], named: str
) -> None:
    with pytest.raises(CallError) as exc:
        client.run("true", labels=labels)
    assert (exc.value.code, exc.value.reason) == (INVALID_ARGUMENT, "INVALID_LABEL")
    assert named in str(exc.value)


# --------------------------------------------------------- background, followed


def test_followed_background_stream_runs_to_its_exit(client: ChronusClient) -> None:
    events = [
        r["exec_event"]
        for r in client.call(
            {
                "exec_stream": {
                    "command": "echo a; echo b >&2; exit 4",
                    "background": True,
                    "follow": True,
                }
            }
        )
    ]
    kinds = [next(iter(e)) for e in events if "keepalive" not in e]
    assert kinds[0] == "started" and kinds[-1] == "exit"
    assert b"".join(e["stdout"]["data"] for e in events if "stdout" in e) == b"a\n"
    assert b"".join(e["stderr"]["data"] for e in events if "stderr" in e) == b"b\n"
    assert events[-1]["exit"]["exit_code"] == 4
    # still registered after its stream ended: a background exec
    exec_id = events[0]["started"]["exec_id"]
    assert info_of(client, exec_id)["status"] == 2


def test_followed_background_command_outlives_its_stream(client: ChronusClient) -> None:
    sid = client.open(
        {
            "exec_stream": {
                "command": "echo $$; sleep 0.5; echo later; sleep 30",
                "background": True,
                "follow": True,
            }
        }
    )
    started = client.next(sid)["response"]["exec_event"]["started"]
    first = stdout_until(client, sid, b"\n")
    pid = int(first)
    client.send(sid, {"cancel": {}})  # the client went away
    frame = client.next(sid)
    while "end" not in frame:
        frame = client.next(sid)
    assert frame["end"]["reason"] == "CANCELLED"
    try:
        assert not gone(pid)
        assert info_of(client, started["exec_id"])["status"] == 1  # RUNNING
        # reattach after what was seen: the rest, live
        sid = client.open(
            {"attach_exec": {"exec_id": started["exec_id"], "stdout_offset": len(first)}}
        )
        assert "started" in client.next(sid)["response"]["exec_event"]
        assert stdout_until(client, sid, b"later\n") == b"later\n"
        client.send(sid, {"cancel": {}})
    finally:
        client.one({"signal_exec": {"exec_id": started["exec_id"], "signal": 9}})
    assert eventually(lambda: gone(pid))


# ------------------------------------------------------------------ ControlExec


def test_stdin_by_exec_id_arrives_in_order_then_eof(client: ChronusClient) -> None:
    started = start_background(client, command="cat", stdin_open=True)
    exec_id = started["exec_id"]
    chunks = [f"{i:04d}|".encode() * (i % 7 + 1) for i in range(200)]
    for chunk in chunks:
        assert control(client, exec_id, stdin=chunk) == {}
    control(client, exec_id, close_stdin=True)
    assert wait_exit(client, exec_id).get("exit_code", 0) == 0
    result = client.call({"attach_exec": {"exec_id": exec_id}})
    out = b"".join(r["exec_event"]["stdout"]["data"] for r in result if "stdout" in r["exec_event"])
    assert out == b"".join(chunks)
    # exited: every action is refused, typed
    for action in ({"stdin": b"x"}, {"close_stdin": True}, {"resize": {"rows": 1, "cols": 1}}):
        err = control_error(client, exec_id, **action)
        assert (err.code, err.reason) == (FAILED_PRECONDITION, "EXEC_EXITED")


def test_control_errors_are_typed(client: ChronusClient) -> None:
    err = control_error(client, "ex-nope", stdin=b"x")
    assert (err.code, err.reason) == (NOT_FOUND, "EXEC_NOT_FOUND")
    plain = start_background(client, command="sleep 30")["exec_id"]
    piped = start_background(client, command="sleep 30", stdin_open=True)["exec_id"]
    try:
        err = control_error(client, plain, stdin=b"x")
        assert (err.code, err.reason) == (FAILED_PRECONDITION, "STDIN_CLOSED")
        err = control_error(client, plain, resize={"rows": 5, "cols": 5})
        assert (err.code, err.reason) == (FAILED_PRECONDITION, "NOT_A_PTY")
        err = control_error(client, piped)  # no action
        assert err.code == INVALID_ARGUMENT
        control(client, piped, stdin=b"ignored\n")
        control(client, piped, close_stdin=True)
        for action in ({"stdin": b"x"}, {"close_stdin": True}):
            err = control_error(client, piped, **action)
            assert (err.code, err.reason) == (FAILED_PRECONDITION, "STDIN_CLOSED")
        assert info_of(client, piped)["status"] == 1  # still running
    finally:
        for exec_id in (plain, piped):
            client.one({"signal_exec": {"exec_id": exec_id, "signal": 9}})


def test_pty_input_and_resize_by_exec_id(client: ChronusClient) -> None:
    sid = client.open(
        {
            "exec_stream": {
                "command": "read x; echo got:$x; trap 'stty size; exit 0' WINCH; echo armed; "
                "while :; do sleep 0.05; done",
                "background": True,
                "follow": True,
                "pty": True,
                "stdin_open": True,
                "pty_size": {"rows": 20, "cols": 30},
            }
        }
    )
    exec_id = client.next(sid)["response"]["exec_event"]["started"]["exec_id"]
    control(client, exec_id, stdin=b"hi\n")
    assert b"got:hi" in stdout_until(client, sid, b"armed")
    control(client, exec_id, resize={"rows": 7, "cols": 9})  # SIGWINCH: the trap prints
    out = b""
    for resp in client.responses(sid):
        ev = resp["exec_event"]
        out += ev.get("stdout", {}).get("data", b"")
        if "exit" in ev:
            assert ev["exit"].get("exit_code", 0) == 0
    assert b"7 9" in out


def test_a_pty_closes_its_input_with_eof(client: ChronusClient) -> None:
    started = start_background(client, command="cat; echo done:$?", pty=True, stdin_open=True)
    exec_id = started["exec_id"]
    control(client, exec_id, stdin=b"abc\n")
    control(client, exec_id, close_stdin=True)
    assert wait_exit(client, exec_id).get("exit_code", 0) == 0
    err = control_error(client, exec_id, stdin=b"x")
    assert err.reason == "EXEC_EXITED"
    out = b"".join(
        r["exec_event"]["stdout"]["data"]
        for r in client.call({"attach_exec": {"exec_id": exec_id}})
        if "stdout" in r["exec_event"]
    )
    assert b"abc" in out and b"done:0" in out


# ------------------------------------------------------------------------ user


def test_run_as_a_user_of_etc_passwd(chronus: tuple[ChronusClient, Path]) -> None:
    client, work = chronus  # not in a sandbox: the host's /etc/passwd (root, nobody)
    probe = 'id -u; id -g; echo "$HOME $USER $LOGNAME"; pwd'
    for spec in ("nobody", "65534"):
        r = client.run(probe, user=spec, cwd="/")
        lines = r["stdout"].decode().splitlines()
        assert lines == ["65534", "65534", "/nonexistent nobody nobody", "/"], r
    # nobody's home (/nonexistent) does not exist: the cwd falls back to the workdir, which
    # (0700, root's) nobody may not enter: the chdir ran as the user
    r = client.run("true", user="nobody")
    assert r["exit"]["exit_code"] == 126
    assert r["exit"]["error"] == f"chdir {work}: Permission denied"
    r = client.run('echo "$HOME"; pwd', user="root")
    assert r["stdout"].decode().split() == ["/root", "/root"]  # cwd defaults to the home
    r = client.run('echo "$HOME"; pwd', user="nobody", env={"HOME": "/tmp"}, cwd="/")
    assert r["stdout"].decode().split() == ["/tmp", "/"]  # the request wins
    # under a PTY and in the background too; ExecInfo says as whom
    started = start_background(client, command="id -u; sleep 30", user="nobody", pty=True, cwd="/")
    try:
        info = info_of(client, started["exec_id"])
        assert info["user"] == "nobody" and info["pty"] is True
        assert eventually(lambda: os.stat(f"/proc/{started['pid']}").st_uid == 65534)
    finally:
        client.one({"signal_exec": {"exec_id": started["exec_id"], "signal": 9}})


def test_unknown_user_and_user_in_a_session_are_invalid(client: ChronusClient) -> None:
    for spec in ("no-such-user", "4242424"):
        with pytest.raises(CallError) as exc:
            client.run("true", user=spec)
        assert (exc.value.code, exc.value.reason) == (INVALID_ARGUMENT, "USER_NOT_FOUND")
        assert repr(spec) in str(exc.value)
    session_id = client.one({"create_session": {}})["session"]["session_id"]
    try:
        with pytest.raises(CallError) as exc:
            client.run("true", user="nobody", session_id=session_id)
        assert (exc.value.code, exc.value.reason) == (INVALID_ARGUMENT, "USER_IN_SESSION")
    finally:
        client.one({"close_session": {"session_id": session_id}})


def test_a_user_can_reopen_its_own_stdout_and_stderr(client: ChronusClient) -> None:
    # pipes are their creator's (root), mode 0600: chronus hands their ends to the user
    r = client.run("echo out > /dev/stdout; echo err > /dev/stderr", user="nobody", cwd="/")
    assert r["exit"].get("exit_code", 0) == 0, r
    assert (r.get("stdout"), r.get("stderr")) == (b"out\n", b"err\n")


def test_account_files_that_are_not_regular_files_are_not_read(tmp_path: Path) -> None:
    from chronus.errors import ChronusError
    from chronus.users import resolve_user

    (tmp_path / "group").write_text("")
    os.mkfifo(tmp_path / "passwd")  # opened without O_NONBLOCK this would hang
    with pytest.raises(ChronusError) as exc:
        resolve_user("root", etc=str(tmp_path))
    assert exc.value.reason == "USER_NOT_FOUND"
    os.remove(tmp_path / "passwd")
    os.symlink("/dev/zero", tmp_path / "passwd")  # read to its end this would never end
    with pytest.raises(ChronusError) as exc:
        resolve_user("root", etc=str(tmp_path))
    assert exc.value.reason == "USER_NOT_FOUND"
    os.remove(tmp_path / "passwd")
    (tmp_path / "passwd").write_text("alice:x:1234:1234::/home/alice:/bin/sh\n")
    assert resolve_user("alice", etc=str(tmp_path)).uid == 1234


def test_cancelled_foreground_streams_leave_no_exec_behind(client: ChronusClient) -> None:
    before = {i["exec_id"] for i in client.one({"list_execs": {}})["execs"]}
    for _ in range(3):
        sid = client.open({"exec_stream": {"command": "echo up; sleep 30"}})
        stdout_until(client, sid, b"up\n")
        client.send(sid, {"cancel": {}})  # the foreground command is killed
        frame = client.next(sid)
        while "end" not in frame:
            frame = client.next(sid)

    def left() -> set[str]:
        return {i["exec_id"] for i in client.one({"list_execs": {}})["execs"]} - before

    assert eventually(lambda: not left()), left()
