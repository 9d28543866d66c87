"""The `dsec` CLI as a user runs it: a subprocess against a real cluster.

`dsec demo` (what `make up` runs) passes on a working cluster and exits non-zero, naming the
failed steps, when steps really fail; `dsec sandbox watch` prints one line per change until
Ctrl-C and exits 0 on it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from dsecctl.cluster import LocalCluster
from libdsec import Client
from libdsec.errors import DSecError
from tests.helpers import sandbox_factory
from tests.integration.conftest import ClusterWith

ROOT = Path(__file__).resolve().parents[2]
needs_images = pytest.mark.images("busybox", "python")


@pytest.fixture(scope="module")
def cli_cluster(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """A container edge with a small python FnCall pool: everything the demo shows."""
    with cluster_with("cli0", edge_env={"DSEC_EDGE_FNCALL_POOLS": "python=1"}) as c:
        yield c


def cli_env(target: str, token: str, home: Path) -> dict[str, str]:
    """The environment of a `dsec` run against ``target`` ($DSEC_HOME empty: nothing else)."""
    env = dict(os.environ, DSEC_TARGET=target, DSEC_TOKEN=token, DSEC_HOME=str(home))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def dsec(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsecctl", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --------------------------------------------------------------------- demo


@needs_images
def test_the_demo_passes_every_step_on_a_working_cluster(
    cli_cluster: LocalCluster, tmp_path: Path
) -> None:
    with Client(cli_cluster.apiserver, token=cli_cluster.token) as admin:
        before = {e.name for e in admin.list_environments("demo-env")}
        r = dsec("demo", env=cli_env(cli_cluster.apiserver, cli_cluster.token, tmp_path))
        after = {e.name for e in admin.list_environments("demo-env")}
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAILED" not in r.stdout
    assert "==> demo done: all" in r.stdout
    assert after == before  # the environment it packed is deleted again
    shown_all = ("run -> exit 0", "timed_out=True", "verdict OK", "stopped: TERMINATED (STOPPED)")
    for shown in (*shown_all, "guest kernel 6.", "a read resumed it"):
        assert shown in r.stdout, r.stdout


def test_the_demo_exits_non_zero_naming_the_steps_that_failed(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    # The session cluster's edge runs the null runtime: nothing really starts in its
    # sandboxes, so the demo's commands, files and FnCall really fail there.
    r = dsec("demo", env=cli_env(cluster.apiserver, cluster.token, tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "==> demo FAILED:" in r.stdout, r.stdout
    failed = [line.split(":", 1)[1].strip() for line in r.stdout.splitlines() if "failed:" in line]
    assert failed, r.stdout
    for name in failed:  # each failure was reported where it happened, with its error
        assert f"==> FAILED {name}:" in r.stdout
    assert "fncall in a warm pool" in failed  # no FnCall pool on a null edge
    assert "connect" not in failed  # the steps before still ran and passed


def test_the_demo_without_a_cluster_fails_clearly(tmp_path: Path) -> None:
    nowhere = f"unix:{tmp_path / 'no-apiserver.sock'}"
    r = dsec("demo", env=cli_env(nowhere, "no-token", tmp_path), timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    # WhoAmI waits for the API server (a restarting one would come back) until its
    # deadline: the step says it could not be reached, and where.
    assert "==> FAILED connect: DeadlineExceeded [DEADLINE_EXCEEDED]" in r.stdout, r.stdout
    assert f"the API server at {nowhere} cannot be reached" in r.stdout, r.stdout
    assert "not run: the agent's tour" in r.stdout


# -------------------------------------------------------------------- watch


@pytest.mark.parametrize("action", ["watch", "create"])
def test_a_label_without_a_value_is_refused(action: str, tmp_path: Path) -> None:
    r = dsec("sandbox", action, "--label", "stage", env=cli_env("unix:/nowhere", "t", tmp_path))
    assert r.returncode == 2 and "expected KEY=VALUE, not 'stage'" in r.stderr, r.stderr


class Lines:
    """A stream of a subprocess read line by line on a thread, with a deadline per line."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def until(self, match: Callable[[str], bool], timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no such line within {timeout_s} s; saw {self.seen}"
                ) from None
            if line is None:
                raise AssertionError(f"the stream ended; saw {self.seen}")
            self.seen.append(line)
            if match(line):
                return line


@needs_images
@pytest.mark.parametrize("as_json", [False, True])
def test_sandbox_watch_prints_each_change_until_ctrl_c(
    cli_cluster: LocalCluster, tmp_path: Path, request: pytest.FixtureRequest, as_json: bool
) -> None:
    task = f"cli-watch-{as_json}"
    args = ["sandbox", "watch", "--task", task, "--label", "via=cli"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsecctl", *args, *(["--json"] if as_json else [])],
        cwd=ROOT,
        env=cli_env(cli_cluster.apiserver, cli_cluster.token, tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = Lines(proc.stdout), Lines(proc.stderr)  # type: ignore[arg-type]
        err.until(lambda line: line.startswith("watching"))  # established: nothing is missed
        with Client(cli_cluster.apiserver, token=cli_cluster.token) as c:
            with sandbox_factory(c, request.node.nodeid, memory_mb=64) as make:
                other = make(task_id=task)  # no via=cli label: filtered out
                sb = make(task_id=task, labels={"via": "cli"})
                running = out.until(lambda line: sb.id in line and "RUNNING" in line)
                sb.stop(grace_s=0.2)
                ended = out.until(lambda line: sb.id in line and "TERMINATED" in line)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, err.seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not any(other.id in line for line in out.seen), out.seen
    if as_json:
        first, last = json.loads(running), json.loads(ended)
        assert (first["id"], first["state"], first["task_id"]) == (sb.id, "RUNNING", task)
        assert (last["state"], last["reason"]) == ("TERMINATED", "STOPPED")
        assert last["labels"]["via"] == "cli" and "time" in last
    else:
        when, sandbox_id, state, reason = ended.split()
        assert (sandbox_id, state, reason) == (sb.id, "TERMINATED", "STOPPED")
        datetime.datetime.fromisoformat(when)  # a timestamp comes first
        assert running.split()[3] == "-"  # no reason while it runs
    assert "Traceback" not in "\n".join(err.seen)


# ------------------------------------------------------------------ plumbing


def test_version_a_missing_environment_and_a_closed_pipe(
    cli_cluster: LocalCluster, tmp_path: Path
) -> None:
    env = cli_env(cli_cluster.apiserver, cli_cluster.token, tmp_path)
    version = dsec("--version", env=env)
    assert version.returncode == 0 and version.stdout.startswith("dsec 0."), version
    missing = dsec("env", "rm", "nope:1", env=env)
    assert missing.returncode == 1, missing
    assert "no environment nope:1" in missing.stderr
    # the reader is gone before anything is written (`dsec env list | head -0`)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsecctl", "env", "list"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 128 + signal.SIGPIPE, err
    assert err == "", err  # no traceback, no "Exception ignored"


# ------------------------------------------------------------- sandbox day


@pytest.fixture(scope="module")
def cli_client(cli_cluster: LocalCluster) -> Iterator[Client]:
    with Client(cli_cluster.apiserver, token=cli_cluster.token) as c:
        yield c


@pytest.fixture
def env(cli_cluster: LocalCluster, tmp_path: Path) -> dict[str, str]:
    return cli_env(cli_cluster.apiserver, cli_cluster.token, tmp_path)


@pytest.fixture(scope="module")
def shared_sandbox(
    cli_client: Client, request: pytest.FixtureRequest
) -> Iterator[tuple[str, Client]]:
    """One busybox sandbox for the tests that only run commands and copy files in it."""
    with sandbox_factory(cli_client, request.node.nodeid, memory_mb=128) as make:
        yield make().id, cli_client


def _ok(r: subprocess.CompletedProcess[Any]) -> subprocess.CompletedProcess[Any]:
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    return r


def dsec_bytes(
    *args: str, env: dict[str, str], stdin: bytes = b"", timeout: float = 120
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "dsecctl", *args],
        cwd=ROOT,
        env=env,
        input=stdin,
        capture_output=True,
        timeout=timeout,
    )


@needs_images
def test_exec_passes_an_argv_forwards_stdin_and_exits_with_the_commands_status(
    shared_sandbox: tuple[str, Client], env: dict[str, str]
) -> None:
    sb, _ = shared_sandbox
    # no shell in between: a space and a `$` arrive as written
    r = _ok(dsec("sandbox", "exec", sb, "--", "printf", "%s|", "a b", "$HOME", "*", env=env))
    assert r.stdout == "a b|$HOME|*|"
    r = dsec_bytes("sandbox", "exec", sb, "--", "cat", env=env, stdin=b"hi\nthere\n")
    assert (r.returncode, r.stdout) == (0, b"hi\nthere\n"), r.stderr
    r = dsec("sandbox", "exec", sb, "--", "sh", "-c", "echo out; echo err >&2; exit 7", env=env)
    assert (r.returncode, r.stdout, r.stderr) == (7, "out\n", "err\n")
    r = dsec("sandbox", "exec", sb, "--", "sh", "-c", "kill -TERM $$", env=env)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    options = ["--env", "A=1 2", "--cwd", "/tmp"]
    r = _ok(dsec("sandbox", "exec", sb, *options, "--", "sh", "-c", 'echo "$A" $(pwd)', env=env))
    assert r.stdout == "1 2 /tmp\n"
    r = dsec("sandbox", "exec", sb, "--timeout-s", "1", "--", "sleep", "30", env=env)
    assert r.returncode == 124 and "timed out after 1 s" in r.stderr, r.stderr
    r = dsec("sandbox", "exec", sb, "--", "no-such-program", env=env)
    assert r.returncode == 127 and "no-such-program" in r.stderr, r.stderr
    r = dsec("sandbox", "exec", sb, env=env)
    assert r.returncode == 2 and "give the command after --" in r.stderr


SLOW_TWO_LINES = ["sh", "-c", "echo first; sleep 5; echo second"]


@needs_images
def test_exec_streams_output_as_it_comes(
    shared_sandbox: tuple[str, Client], env: dict[str, str]
) -> None:
    sb, _ = shared_sandbox
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsecctl", "sandbox", "exec", sb, "--", *SLOW_TWO_LINES],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out = Lines(proc.stdout)  # type: ignore[arg-type]
        t0 = time.monotonic()
        out.until(lambda line: line == "first", timeout_s=30)
        assert proc.poll() is None  # printed before the command ended
        out.until(lambda line: line == "second", timeout_s=30)
        assert time.monotonic() - t0 > 3
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@needs_images
def test_cp_copies_a_file_both_ways_and_through_stdin_stdout(
    shared_sandbox: tuple[str, Client], env: dict[str, str], tmp_path: Path
) -> None:
    sb, c = shared_sandbox
    data = os.urandom(3 * 1024 * 1024 + 17)
    local = tmp_path / "blob.bin"
    local.write_bytes(data)
    local.chmod(0o750)
    _ok(dsec("sandbox", "cp", str(local), f"{sb}:/tmp/blob.bin", env=env))
    assert c.get(sb).files.read("/tmp/blob.bin") == data
    assert c.get(sb).files.stat("/tmp/blob.bin").mode & 0o777 == 0o750
    _ok(dsec("sandbox", "cp", str(local), f"{sb}:/tmp/", env=env))  # a directory: its name
    assert c.get(sb).files.stat("/tmp/blob.bin").size == len(data)
    back = tmp_path / "back.bin"
    _ok(dsec("sandbox", "cp", f"{sb}:/tmp/blob.bin", str(back), env=env))
    assert back.read_bytes() == data and back.stat().st_mode & 0o777 == 0o750
    into = tmp_path / "into"
    into.mkdir()
    _ok(dsec("sandbox", "cp", f"{sb}:/tmp/blob.bin", str(into), env=env))
    assert (into / "blob.bin").read_bytes() == data
    # `-`: stdin up, stdout down
    _ok(dsec_bytes("sandbox", "cp", "-", f"{sb}:/tmp/piped.bin", env=env, stdin=data[::-1]))
    r = _ok(dsec_bytes("sandbox", "cp", f"{sb}:/tmp/piped.bin", "-", env=env))
    assert r.stdout == data[::-1] and r.stderr == b""  # no progress bar off a terminal
    # what cannot be copied says so
    r = dsec("sandbox", "cp", f"{sb}:/tmp/missing", str(tmp_path / "m"), env=env)
    assert r.returncode != 0 and "PathNotFound" in r.stderr, r.stderr
    r = dsec("sandbox", "cp", str(tmp_path / "missing"), f"{sb}:/tmp/x", env=env)
    assert r.returncode != 0 and "No such file" in r.stderr, r.stderr
    r = dsec("sandbox", "cp", str(local), str(back), env=env)
    assert r.returncode == 2 and "exactly one of SRC and DST" in r.stderr
    assert not list(tmp_path.glob("*.part"))


@needs_images
def test_logs_replays_and_follows_background_commands(
    shared_sandbox: tuple[str, Client], env: dict[str, str]
) -> None:
    sb, c = shared_sandbox
    done = c.get(sb).start(["sh", "-c", "echo one; echo warn >&2; echo two"])
    done.wait(timeout_s=30)
    r = _ok(dsec("sandbox", "logs", sb, done.exec_id, env=env))
    assert (r.stdout, r.stderr) == ("one\ntwo\n", "warn\n")
    r = _ok(dsec("sandbox", "logs", sb, done.exec_id, "--json", env=env))
    chunks = [json.loads(line) for line in r.stdout.splitlines()]
    assert {(ch["stream"], ch["exec_id"]) for ch in chunks} == {
        ("stdout", done.exec_id),
        ("stderr", done.exec_id),
    }
    # a running one: without -f what it printed so far, with -f until it exits
    running = c.get(sb).start(["sh", "-c", "echo early; sleep 4; echo late"])
    t0 = time.monotonic()
    r = _ok(dsec("sandbox", "logs", sb, running.exec_id, env=env))
    assert r.stdout == "early\n" and time.monotonic() - t0 < 4
    r = _ok(dsec("sandbox", "logs", sb, running.exec_id, "-f", env=env))
    assert r.stdout == "early\nlate\n"
    # without an exec id: every background command, under a header each
    r = _ok(dsec("sandbox", "logs", sb, env=env))
    assert f"==> {done.exec_id}: sh -c 'echo one" in r.stdout
    assert f"==> {running.exec_id}: sh -c 'echo early" in r.stdout
    ps = json.loads(_ok(dsec("sandbox", "ps", sb, "--json", env=env)).stdout)
    by_id = {p["exec_id"]: p for p in ps}
    assert by_id[running.exec_id]["exit"]["exit_code"] == 0
    assert by_id[running.exec_id]["argv"][0] == "sh"


@needs_images
def test_create_with_options_show_list_filters_pause_resume_stop(
    cli_client: Client, env: dict[str, str], request: pytest.FixtureRequest
) -> None:
    task = f"cli-day-{os.getpid()}"
    made: list[str] = []
    try:
        options = (
            "--image busybox --cpu 0.5 --memory-mb 96 --pids-max 77 --ttl-s 900"
            " --idle-timeout-s 600 --label stage=eval --label who=cli --workdir /tmp"
            " --allow 10.1.2.3:443/tcp --deny 10.9.9.9 --best-effort --sudo-user user"
            " --sudo-user 1000 --json"
        ).split()
        greeting = ["--env", "GREETING=hello there", "--task", task]
        r = _ok(dsec("sandbox", "create", *options, *greeting, env=env))
        created = json.loads(r.stdout)
        made.append(created["id"])
        other = _ok(dsec("sandbox", "create", "--image", "busybox", "--task", task, env=env))
        made.append(other.stdout.strip())

        shown = json.loads(_ok(dsec("sandbox", "show", created["id"], "--json", env=env)).stdout)
        assert (shown["id"], shown["state"], shown["backend"], shown["image"]) == (
            created["id"],
            "RUNNING",
            "container",
            "busybox",
        )
        assert shown["labels"] == {"stage": "eval", "who": "cli"} and shown["task_id"] == task
        assert shown["edge_id"] == "cli0" and shown["termination_reason"] is None
        assert shown["created_at"] and shown["expires_at"] and shown["started_at"]
        spec = shown["spec"]
        assert spec["cpu"] == 0.5 and spec["memory_mb"] == 96 and spec["pids_max"] == 77
        assert (spec["ttl_s"], spec["idle_timeout_s"]) == (900, 600)
        assert spec["env"] == {"GREETING": "hello there"} and spec["workdir"] == "/tmp"
        assert spec["best_effort"] is True and spec["sudo_users"] == ["user", "1000"]
        assert spec["network"] == {
            "allow": ["10.1.2.3:443/tcp"],
            "deny": ["10.9.9.9"],
            "open": False,
            "max_blocked_connects": 0,
        }
        assert set(shown["violations"]) >= {"blocked_connects", "oom_kills"}
        text = _ok(dsec("sandbox", "show", created["id"], env=env)).stdout
        assert "allowlist; allow 10.1.2.3:443/tcp; deny 10.9.9.9" in text
        assert "memory 96 MiB" in text and "stage=eval, who=cli" in text
        # the spec reached the commands: env and workdir
        r = _ok(
            dsec(
                "sandbox",
                "exec",
                created["id"],
                "--",
                "sh",
                "-c",
                'echo "$GREETING" $(pwd)',
                env=env,
            )
        )
        assert r.stdout == "hello there /tmp\n"

        def listed(*args: str) -> set[str]:
            r = _ok(dsec("sandbox", "list", "--task", task, *args, "--json", env=env))
            return {s["id"] for s in json.loads(r.stdout)}

        assert listed() == set(made)
        assert listed("--label", "stage=eval") == {created["id"]}
        assert listed("--label", "stage=eval", "--label", "who=nobody") == set()

        r = _ok(dsec("sandbox", "pause", created["id"], env=env))
        assert r.stdout.split() == [created["id"], "PAUSED"]
        assert listed("--state", "paused") == {created["id"]}
        assert listed("--state", "RUNNING") == {made[1]}
        resumed = json.loads(
            _ok(dsec("sandbox", "resume", created["id"], "--json", env=env)).stdout
        )
        assert resumed["state"] == "RUNNING"
        assert listed("--state", "RUNNING", "--state", "PAUSED") == set(made)

        r = _ok(dsec("sandbox", "stop", made[1], "--json", env=env))
        stopped = json.loads(r.stdout)
        assert (stopped["state"], stopped["termination_reason"]) == ("TERMINATED", "STOPPED")
        assert listed("--state", "TERMINATED") == {made[1]}
        r = _ok(dsec("sandbox", "list", "--task", task, "--state", "terminated", env=env))
        assert r.stdout.startswith(f"{made[1]}  TERMINATED (STOPPED)")
    finally:
        for sandbox_id in made:
            try:
                cli_client.get(sandbox_id).stop(grace_s=0.2)
            except DSecError:
                pass


@needs_images
def test_create_count_prints_every_sandbox(cli_client: Client, env: dict[str, str]) -> None:
    task = f"cli-burst-{os.getpid()}"
    try:
        options = "--count 2 --image busybox --memory-mb 64 --json".split()
        r = _ok(dsec("sandbox", "create", *options, "--task", task, env=env))
        made = json.loads(r.stdout)
        assert [s["state"] for s in made] == ["RUNNING", "RUNNING"]
        assert {s["task_id"] for s in made} == {task}
        r = _ok(dsec("sandbox", "stop", "--task", task, "--json", env=env))
        assert set(json.loads(r.stdout)["stopped"]) == {s["id"] for s in made}
    finally:
        cli_client.stop_all(task_id=task)


@needs_images
def test_a_bad_sandbox_id_fails_naming_the_command_and_the_error(env: dict[str, str]) -> None:
    missing = "sb-cli0-0000000000000000"
    for args in (
        ["sandbox", "exec", missing, "--", "true"],
        ["sandbox", "show", missing],
        ["sandbox", "pause", missing],
        ["sandbox", "logs", missing],
        ["sandbox", "cp", f"{missing}:/etc/passwd", "-"],
    ):
        r = dsec(*args, env=env)
        # exec: docker exec's 125 (dsec failed, the command's status is unknown); else 2
        assert r.returncode == (125 if args[1] == "exec" else 2), (args, r.returncode)
        line = f"dsec sandbox {args[1]}: SandboxNotFound [SANDBOX_NOT_FOUND]"
        assert r.stderr.startswith(line) and r.stderr.count("\n") == 1, r.stderr
        assert "Traceback" not in r.stderr


@needs_images
def test_every_data_command_prints_json(cli_cluster: LocalCluster, env: dict[str, str]) -> None:
    who = json.loads(_ok(dsec("whoami", "--json", env=env)).stdout)
    assert who["project_id"] == "root" and who["role"] == "ADMIN"
    project = json.loads(_ok(dsec("project", "show", "--json", env=env)).stdout)
    assert project["project_id"] == "root" and "usage" in project
    assert isinstance(json.loads(_ok(dsec("project", "list", "--json", env=env)).stdout), list)
    tokens = json.loads(_ok(dsec("token", "list", "--json", env=env)).stdout)
    assert who["principal_id"] in {t["token_id"] for t in tokens}
    envs = json.loads(_ok(dsec("env", "list", "--json", env=env)).stdout)
    assert "busybox:latest" in {e["name"] for e in envs}
    busybox = json.loads(_ok(dsec("env", "show", "busybox", "--json", env=env)).stdout)
    assert busybox["layers"] and busybox["layers"][0]["digest"].startswith("sha256:")
    layers = json.loads(_ok(dsec("env", "layers", "--json", env=env)).stdout)
    assert busybox["layers"][0]["digest"] in {layer["digest"] for layer in layers}
    status = dsec("status", "--json", env={**env, "DSEC_HOME": str(cli_cluster.home)})
    services = {s["name"]: s for s in json.loads(_ok(status).stdout)["services"]}
    assert services["apiserver"]["state"] == "SERVING" and "edge-cli0" in services


# -------------------------------------------------------------------- shell


class Terminal:
    """`dsec sandbox shell` on a pseudo-terminal of its own (as in a person's terminal):
    what it prints is read from the master side, keys are written to it."""

    def __init__(self, args: list[str], env: dict[str, str], rows: int, cols: int) -> None:
        import fcntl
        import struct
        import termios

        self._fcntl, self._struct, self._termios = fcntl, struct, termios
        self.master, slave = os.openpty()
        self.resize(rows, cols, fd=slave)
        # setsid -c: a session of its own whose controlling terminal is this one (window
        # changes send it SIGWINCH), without a preexec_fn (a fork of this gRPC process)
        self.proc = subprocess.Popen(
            ["setsid", "-c", sys.executable, "-m", "dsecctl", *args],
            cwd=ROOT,
            env=env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
        )
        os.close(slave)
        self.seen = b""

    def resize(self, rows: int, cols: int, fd: int | None = None) -> None:
        size = self._struct.pack("HHHH", rows, cols, 0, 0)
        self._fcntl.ioctl(self.master if fd is None else fd, self._termios.TIOCSWINSZ, size)

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def until(self, pattern: bytes, timeout_s: float = 30) -> None:
        import select

        deadline = time.monotonic() + timeout_s
        while pattern not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} within {timeout_s} s; saw {self.seen!r}")
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    self.seen += os.read(self.master, 4096)
                except OSError:  # the other side closed
                    raise AssertionError(
                        f"no {pattern!r}; the terminal closed: {self.seen!r}"
                    ) from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@needs_images
def test_shell_runs_in_a_terminal_follows_its_size_and_exits_with_the_shells_status(
    shared_sandbox: tuple[str, Client], env: dict[str, str]
) -> None:
    sb, _ = shared_sandbox
    term = Terminal(["sandbox", "shell", sb], env, rows=30, cols=100)
    try:
        term.until(b"# ")  # the prompt
        term.type(b"stty size\r")
        term.until(b"30 100")
        term.resize(41, 123)  # the window changed: SIGWINCH to dsec, a resize to the sandbox
        deadline = time.monotonic() + 20
        while b"41 123" not in term.seen:
            assert time.monotonic() < deadline, term.seen
            term.type(b"stty size\r")
            with contextlib.suppress(AssertionError):
                term.until(b"41 123", timeout_s=1)
        term.type(b"echo $((6*7))\r")
        term.until(b"\r\n42\r\n")
        term.type(b"exit 3\r")
        assert term.proc.wait(timeout=30) == 3, term.seen
        assert b"Traceback" not in term.seen
    finally:
        term.close()


@needs_images
def test_shell_refuses_without_a_terminal(
    shared_sandbox: tuple[str, Client], env: dict[str, str]
) -> None:
    sb, _ = shared_sandbox
    r = dsec("sandbox", "shell", sb, env=env)  # stdin: not a terminal under pytest's capture
    assert r.returncode == 2 and "stdin is not a terminal" in r.stderr, r.stderr


@needs_images
def test_progress_bars_on_a_terminal_leave_the_data_intact(
    shared_sandbox: tuple[str, Client], cli_client: Client, env: dict[str, str], tmp_path: Path
) -> None:
    sb, c = shared_sandbox
    data = os.urandom(4 * 1024 * 1024)
    (tmp_path / "up.bin").write_bytes(data)
    term = Terminal(["sandbox", "cp", str(tmp_path / "up.bin"), f"{sb}:/tmp/up.bin"], env, 24, 100)
    try:
        assert term.proc.wait(timeout=60) == 0, term.seen
        with contextlib.suppress(AssertionError):
            term.until(b"\x00", timeout_s=0.5)  # drain what it drew
    finally:
        term.close()
    assert b"Traceback" not in term.seen
    assert c.get(sb).files.read("/tmp/up.bin") == data
    task = f"cli-burst-tty-{os.getpid()}"
    args = ["sandbox", "create", "--count", "2", "--image", "busybox", "--memory-mb", "64"]
    term = Terminal([*args, "--task", task], env, 24, 100)
    try:
        assert term.proc.wait(timeout=120) == 0, term.seen
        with contextlib.suppress(AssertionError):
            term.until(b"\x00", timeout_s=0.5)
    finally:
        term.close()
        made = cli_client.stop_all(task_id=task)
    assert len(made) == 2 and all(sandbox_id.encode() in term.seen for sandbox_id in made)


def test_project_create_with_exist_ok_is_idempotent(
    cli_cluster: LocalCluster, env: dict[str, str]
) -> None:
    name = f"cli-exist-{os.getpid()}"
    try:
        first = json.loads(
            _ok(dsec("project", "create", name, "--sandboxes", "3", "--json", env=env)).stdout
        )
        again = dsec("project", "create", name, env=env)
        assert again.returncode == 2 and "AlreadyExists [PROJECT_EXISTS]" in again.stderr
        same = _ok(dsec("project", "create", name, "--sandboxes", "1", "--exist-ok", env=env))
        assert (
            same.stdout.startswith(f"{first['project_id']}  quota") and "sandboxes=3" in same.stdout
        )
    finally:
        dsec("project", "delete", f"root/{name}", env=env)
