"""The `dsec` CLI as a user runs it: a subprocess against a real cluster.

`dsec demo` (what `make up` runs) passes on a working cluster and exits non-zero, naming the
failed steps, when steps really fail; `dsec sandbox watch` prints one line per change until
Ctrl-C and exits 0 on it.
"""

from __future__ import annotations

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
from typing import IO

import pytest

from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client
from tests.conftest import start_cluster
from tests.helpers import sandbox_factory

IMAGES = Path(os.environ.get("DSEC_IMAGE_DIR", "/var/lib/dsec/images"))
ROOT = Path(__file__).resolve().parents[2]
needs_images = pytest.mark.skipif(
    not all((IMAGES / f"{n}.erofs").exists() for n in ("busybox", "python")),
    reason="images busybox/python missing: run scripts/setup.sh (make test does)",
)


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A container edge with a small python FnCall pool: everything the demo shows."""
    home = tmp_path_factory.mktemp("clicluster")
    c = start_cluster(
        home,
        edges=[
            EdgeSpec(
                edge_id="cli0",
                runtime="container",
                extra_env={
                    "DSEC_EDGE_IMAGE_DIR": str(IMAGES),
                    "DSEC_EDGE_FNCALL_POOLS": "python=1",
                },
            )
        ],
    )
    try:
        yield c
    finally:
        c.stop()


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
    r = dsec("demo", env=cli_env(cli_cluster.apiserver, cli_cluster.token, tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAILED" not in r.stdout
    assert "==> demo done: all" in r.stdout
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
