"""The backend conformance suite's fixtures: one real cluster per backend under test.

Every scenario in this directory runs against each backend in targets.BACKENDS (the container,
microVM and full-VM backends); a new backend joins by adding its entry there (the edge runtime, what
image to use, the capabilities it declares, how to reach its runtime from the host). A new
backend is done when it passes the suite.
The clusters are module-scoped and shared by the scenarios (a VM guest boots under TCG here:
boot once per module, and microVMs are restored from a template per shape); each test's
sandboxes are labelled with the test id and always stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

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


@pytest.fixture(scope="module", params=BACKENDS, ids=lambda b: b.name)
def target(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    b: BackendUnderTest = request.param
    require_images("busybox")
    home = tmp_path_factory.mktemp(f"conformance-{b.name}")
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


@pytest.fixture
def make(target: Target, request: pytest.FixtureRequest) -> Iterator[Callable[..., Sandbox]]:
    """Factory: a sandbox of the backend under test, labelled with the test id, always stopped.
    On failure the services' log tails are printed (the edge's has the runtime's story)."""
    memory_mb = max(256, target.backend.min_memory_mb)
    with sandbox_factory(target.client, request.node.nodeid, memory_mb=memory_mb, grace_s=0.5) as f:

        def make_one(**kw: object) -> Sandbox:
            kw.setdefault("image", target.backend.image)
            kw.setdefault("backend", target.backend.name)
            return f(**kw)

        yield make_one
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print_log_tails(target.cluster, request.node.nodeid)
