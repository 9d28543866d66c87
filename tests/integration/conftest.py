"""The integration suite's fixtures: real clusters per backend, one sandbox factory, one check
that the base images are there.

Clusters (every one always stopped, also when a test fails; a failing test prints the tail of
each of its cluster's service logs, see tests/conftest.py):

- ``cluster`` (tests/conftest.py, session): one null-runtime edge, for control-plane tests.
- ``container_cluster`` (session): one container edge (``SHARED_EDGE``) over the base images,
  no FnCall pools: shared by the modules whose tests only use sandboxes of their own. A test on
  it asserts nothing node-wide (counts of sandboxes on the node, node status figures, quotas of
  the root project): other modules' sandboxes live on the same node.
- ``cluster_with`` (session): the factory for a module that needs a cluster of its own: its own
  edge settings, restarts or failure injection, node-wide counts. It is called from the module's
  own module-scoped fixture::

      @pytest.fixture(scope="module")
      def container_cluster(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
          with cluster_with("oneend", edge_env={"DSEC_EDGE_MAX_SANDBOXES": "4"}) as c:
              yield c

  A module-scoped fixture named ``container_cluster`` replaces the session one in its module,
  and ``client``, ``make_sandbox`` and the lifecycle fixtures then use it.

Sandboxes: ``client`` (the cluster's admin), ``make_sandbox`` (the one factory: every sandbox
labelled with the test id, every one stopped afterwards, also on failure; defaults from
``sandbox_defaults``, which a module may override), and the lifecycle fixtures
``sandbox`` → ``running`` → ``paused`` → ``resumed`` (each the same busybox sandbox, one step on).

Images: a module (or test) that uses the base images says which with
``pytest.mark.images("busybox", ...)`` (the check is in tests/conftest.py). When one is missing the
test FAILS, naming the missing images and the command that builds them: ``make test`` builds them
first, so a machine without them is broken, not a reason to run green with the real runtimes
untested. A skip remains only for missing hardware (a GPU), and names it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import pytest

from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client, Sandbox
from tests.conftest import IMAGES, require_images, start_cluster
from tests.helpers import sandbox_factory, wait_for

#: The edge of the session's shared container cluster.
SHARED_EDGE = "ctr0"


class ClusterWith(Protocol):
    """The type of the ``cluster_with`` fixture (see it and the module docstring)."""

    def __call__(
        self,
        name: str,
        *,
        edges: Sequence[EdgeSpec] | None = None,
        edge_env: dict[str, str] | None = None,
        **cluster_kw: Any,
    ) -> AbstractContextManager[LocalCluster]: ...


def container_edge(edge_id: str, env: dict[str, str] | None = None, **spec: Any) -> EdgeSpec:
    """A container edge over the base images, without FnCall pools or full VMs; ``env``: more
    DSEC_EDGE_*, ``spec``: more EdgeSpec fields (labels, max_sandboxes, cpu_millis, ...)."""
    # No full VMs (tests/vm has its own cluster): a create for one is BACKEND_NOT_OFFERED here.
    extra_env = {
        "DSEC_EDGE_IMAGE_DIR": str(IMAGES),
        "DSEC_EDGE_FNCALL_POOLS": "",
        "DSEC_EDGE_VM": "off",
        **(env or {}),
    }
    return EdgeSpec(edge_id=edge_id, runtime="container", extra_env=extra_env, **spec)


@pytest.fixture(scope="session")
def cluster_with(tmp_path_factory: pytest.TempPathFactory) -> ClusterWith:
    """The cluster factory: ``with cluster_with(name, ...) as c:`` starts a cluster under a
    fresh home named after ``name`` and stops it on exit. Without ``edges`` the cluster has one
    container edge whose id is ``name`` and whose environment adds ``edge_env``; ``cluster_kw``
    goes to LocalCluster (apiservers, extra_env, compat, ...) or its start (timeout_s)."""

    @contextmanager
    def start(
        name: str,
        *,
        edges: Sequence[EdgeSpec] | None = None,
        edge_env: dict[str, str] | None = None,
        **cluster_kw: Any,
    ) -> Iterator[LocalCluster]:
        specs = list(edges) if edges is not None else [container_edge(name, edge_env)]
        if any(e.runtime == "container" for e in specs):
            require_images("busybox")
        c = start_cluster(tmp_path_factory.mktemp(name), edges=specs, **cluster_kw)
        try:
            yield c
        finally:
            c.stop()

    return start


@pytest.fixture(scope="session")
def container_cluster(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """The session's shared container cluster (see the module docstring for who may use it)."""
    with cluster_with(SHARED_EDGE) as c:
        yield c


@pytest.fixture
def client(container_cluster: LocalCluster) -> Iterator[Client]:
    """The cluster's admin client (the bootstrap token)."""
    with Client(container_cluster.apiserver, token=container_cluster.token) as c:
        yield c


@pytest.fixture
def sandbox_defaults() -> dict[str, Any]:
    """``make_sandbox``'s memory limit and stop grace; a module overrides this fixture."""
    return {"memory_mb": 256, "grace_s": 0.5}


@pytest.fixture
def make_sandbox(
    client: Client, request: pytest.FixtureRequest, sandbox_defaults: dict[str, Any]
) -> Iterator[Callable[..., Sandbox]]:
    """Factory: sandboxes (busybox, half a core by default) labelled with the test id, all
    stopped afterwards, also when the test failed."""
    with sandbox_factory(client, request.node.nodeid, **sandbox_defaults) as make:
        yield make


@pytest.fixture
def sandbox(make_sandbox: Callable[..., Sandbox]) -> Sandbox:
    """A busybox sandbox, created (it accepts commands)."""
    return make_sandbox(image="busybox")


@pytest.fixture
def running(sandbox: Sandbox) -> Sandbox:
    """``sandbox``, seen RUNNING by the API."""
    wait_for(lambda: sandbox.refresh().state == "RUNNING", timeout_s=30)
    return sandbox


@pytest.fixture
def paused(running: Sandbox) -> Sandbox:
    """``running``, paused."""
    assert running.pause().state == "PAUSED"
    return running


@pytest.fixture
def resumed(paused: Sandbox) -> Sandbox:
    """``paused``, resumed."""
    assert paused.resume().state == "RUNNING"
    return paused
