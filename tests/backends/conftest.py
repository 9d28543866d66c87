"""The backend conformance suite's fixtures: one real cluster per backend under test.

Every scenario in this directory runs against each backend in targets.BACKENDS (the container,
microVM and full-VM backends); a new backend joins by adding its entry there (the edge runtime, what
image to use, the capabilities it declares, how to reach its runtime from the host). A new
backend is done when it passes the suite.
The clusters are module-scoped and shared by the scenarios (a VM guest boots under TCG here:
boot once per module, and microVMs are restored from a template per shape); each test's
sandboxes are labelled with the test id and always stopped. test_long_pause.py keeps every
backend's cluster up at once instead (its pauses are held together), built the same way
(running_target, backend_sandboxes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client, Sandbox
from tests.backends.targets import BACKENDS, BackendUnderTest
from tests.conftest import IMAGES, print_log_tails, require_images, start_cluster
from tests.helpers import sandbox_factory


@dataclass
class Target:
    backend: BackendUnderTest
    cluster: LocalCluster
    client: Client
    edge_id: str


@contextmanager
def running_target(b: BackendUnderTest, home: Path) -> Iterator[Target]:
    """A cluster of one edge running backend ``b`` under ``home``, and a client of it; the
    cluster is stopped on exit (and by start_cluster itself when it does not come up)."""
    edge_id = "conf" + b.name[:4]
    cluster = start_cluster(
        home,
        edges=[
            EdgeSpec(
                edge_id=edge_id,
                runtime=b.runtime,
                extra_env={
                    "DSEC_EDGE_IMAGE_DIR": str(IMAGES),
                    "DSEC_EDGE_FNCALL_POOLS": "",
                    **b.extra_env,
                },
            )
        ],
    )
    try:
        with Client(cluster.apiserver, token=cluster.token) as client:
            yield Target(b, cluster, client, edge_id)
    finally:
        cluster.stop()


@pytest.fixture(scope="module", params=BACKENDS, ids=lambda b: b.name)
def target(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    b: BackendUnderTest = request.param
    require_images("busybox")
    with running_target(b, tmp_path_factory.mktemp(f"conformance-{b.name}")) as t:
        yield t


@contextmanager
def backend_sandboxes(target: Target, test_id: str) -> Iterator[Callable[..., Sandbox]]:
    """Factory: a sandbox of ``target``'s backend, labelled with ``test_id``, always stopped."""
    memory_mb = max(256, target.backend.min_memory_mb)
    with sandbox_factory(target.client, test_id, memory_mb=memory_mb, grace_s=0.5) as f:

        def make_one(**kw: object) -> Sandbox:
            kw.setdefault("image", target.backend.image)
            kw.setdefault("backend", target.backend.name)
            return f(**kw)

        yield make_one


@pytest.fixture
def make(target: Target, request: pytest.FixtureRequest) -> Iterator[Callable[..., Sandbox]]:
    """Factory: a sandbox of the backend under test, labelled with the test id, always stopped.
    On failure the services' log tails are printed (the edge's has the runtime's story)."""
    with backend_sandboxes(target, request.node.nodeid) as make_one:
        yield make_one
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print_log_tails(target.cluster, request.node.nodeid)
