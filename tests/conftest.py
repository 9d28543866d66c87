"""Shared fixtures: real dsec services as subprocesses, always stopped.

``cluster`` (session) runs iam, watcher, placement, one null-runtime edge and
an API server on Unix sockets under a temp dir. When a test that used it
fails, the tail of every service's log is printed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dsecctl.cluster import EdgeSpec, LocalCluster
from tests.pgserver import PostgresServer, start_postgres


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


def print_log_tails(cluster: LocalCluster, header: str) -> None:
    print(f"\n===== {header}: service log tails =====")
    for p in cluster.processes:
        print(f"----- {p.name} ({p.log_path})")
        print(cluster.log_tail(p, 40))


def start_cluster(home: Path, **kw: object) -> LocalCluster:
    # Each test edge gets a cgroup parent of its own: an edge removes every child of its
    # parent it does not know as an orphan, so test clusters sharing "dsec" (or a local
    # cluster's) would kill each other's sandboxes.
    for e in kw.get("edges") or []:  # type: ignore[attr-defined]
        if isinstance(e, EdgeSpec) and e.runtime == "container":
            e.extra_env.setdefault(
                "DSEC_EDGE_CGROUP_PARENT", f"dsec-test-{os.getpid()}-{e.edge_id}"
            )
            # A swap area for paused sandboxes per test edge: small (tests page out MBs).
            e.extra_env.setdefault("DSEC_EDGE_PAUSE_SWAP_MB", "1024")
    c = LocalCluster(
        home,
        transport="unix",
        log_level="DEBUG" if os.environ.get("DSEC_TEST_DEBUG") else "INFO",
        **kw,
    )  # type: ignore[arg-type]
    c.start(timeout_s=60)
    return c


@contextmanager
def one_container_edge(
    home: Path, edge_id: str, env: dict[str, str] | None = None
) -> Iterator[LocalCluster]:
    """A cluster of one container edge over the base images (no FnCall pools), always
    stopped: what most container tests of one feature need. ``env``: more DSEC_EDGE_*."""
    images = os.environ.get("DSEC_IMAGE_DIR", "/var/lib/dsec/images")
    env = {"DSEC_EDGE_IMAGE_DIR": images, "DSEC_EDGE_FNCALL_POOLS": "", **(env or {})}
    c = start_cluster(home, edges=[EdgeSpec(edge_id=edge_id, runtime="container", extra_env=env)])
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    home = tmp_path_factory.mktemp("cluster")
    c = start_cluster(home, edges=[EdgeSpec(edge_id="nulla", runtime="null")])
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL server (Debian package binaries) for the session, always stopped."""
    server = start_postgres()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _log_tails_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        # every cluster the test used, whatever its fixture is called
        for value in getattr(request.node, "funcargs", {}).values():
            if isinstance(value, LocalCluster):
                print_log_tails(value, request.node.nodeid)
