"""Shared fixtures: real dsec services as subprocesses, always stopped.

``cluster`` (session) runs iam, watcher, placement, one null-runtime edge and
an API server on Unix sockets under a temp dir. When a test that used it (or any
other cluster) fails, the tail of every service's log is printed. Container
clusters, the cluster factory and the sandbox factory of the integration suite
are in tests/integration/conftest.py.

A test that runs the base images says which with ``pytest.mark.images(...)``:
one missing FAILS the test before any fixture starts, naming it and the command
that builds it (``make test`` builds them first; their absence is a broken
machine, not a skip).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsecctl.cluster import EdgeSpec, LocalCluster
from tests.pgserver import PostgresServer, start_postgres

IMAGES = Path(os.environ.get("DSEC_IMAGE_DIR", "/var/lib/dsec/images"))

# Every VM and microVM template the suite builds stays for the session (every edge a test
# starts inherits this): the suite uses more shapes than an edge keeps by default (4 VM
# templates, node-wide), and a template one cluster's edge evicts is built again by the next
# one, under TCG (a minute for bookworm, two or three for a desktop). ~160 MB each.
os.environ.setdefault("DSEC_EDGE_VM_MAX_TEMPLATES", "16")
os.environ.setdefault("DSEC_EDGE_MICROVM_MAX_TEMPLATES", "32")
#: What scripts/build-base-images.sh builds (its ALL_IMAGES).
BASE_IMAGES = ("busybox", "bookworm", "python")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "images(*names): the test runs sandboxes of these base images (fails if missing)"
    )
    # A suite started in the background (`make test &`) inherits SIGINT ignored, and so would
    # every process a test starts: `dsec sandbox watch` could not be stopped by its Ctrl-C,
    # chronus's interrupt grace would not be what it is. Tests get a normal SIGINT.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def require_images(*names: str) -> None:
    """Fails the calling test when a base image is missing (no names: any of them), naming it
    and how to build it."""
    missing = [n for n in names or BASE_IMAGES if not (IMAGES / f"{n}.erofs").exists()]
    if missing:
        pytest.fail(
            f"base images missing from {IMAGES}: {', '.join(m + '.erofs' for m in missing)}; "
            "build them with `make setup` (scripts/build-base-images.sh; `make test` runs it)",
            pytrace=False,
        )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before any fixture: a module-scoped cluster must not start over images that are not there.
    marker = item.get_closest_marker("images")
    if marker is not None:
        require_images(*marker.args)


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


def start_cluster(home: Path, timeout_s: float = 60, **kw: Any) -> LocalCluster:
    # Each test edge gets a cgroup parent of its own: an edge removes every child of its
    # parent it does not know as an orphan, so test clusters sharing "dsec" (or a local
    # cluster's) would kill each other's sandboxes.
    for e in kw.get("edges") or []:
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
    )
    c.start(timeout_s=timeout_s)
    return c


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
