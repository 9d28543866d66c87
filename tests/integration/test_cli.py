"""The `dsec` CLI as a user runs it: a subprocess against a real cluster.

`dsec demo` (what `make up` runs) passes on a working cluster and exits non-zero, naming the
failed steps, when steps really fail; `dsec sandbox watch` prints one line per change until
Ctrl-C and exits 0 on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsecctl.cluster import EdgeSpec, LocalCluster
from tests.conftest import print_log_tails, start_cluster

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


@pytest.fixture(autouse=True)
def _tails_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed and "cli_cluster" in request.fixturenames:
        print_log_tails(request.getfixturevalue("cli_cluster"), request.node.nodeid)


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
    for shown in ("run -> exit 0", "timed_out=True", "verdict OK", "stopped: TERMINATED (STOPPED)"):
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
    r = dsec("demo", env=cli_env(nowhere, "no-token", tmp_path), timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "==> FAILED connect: Unavailable [UNAVAILABLE]" in r.stdout, r.stdout
    assert "not run: the agent's tour" in r.stdout


# -------------------------------------------------------------------- watch


@pytest.mark.parametrize("action", ["watch", "create"])
def test_a_label_without_a_value_is_refused(action: str, tmp_path: Path) -> None:
    r = dsec("sandbox", action, "--label", "stage", env=cli_env("unix:/nowhere", "t", tmp_path))
    assert r.returncode == 2 and "expected KEY=VALUE, not 'stage'" in r.stderr, r.stderr
