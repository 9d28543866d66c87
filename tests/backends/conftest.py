"""The backend conformance suite's fixtures: one real cluster per backend under test.

Every scenario in this directory runs against each backend in BACKENDS: the container backend
(runc) now; the microVM and VM backends join by adding an entry (the edge runtime, what image
to use, the capabilities the backend declares). A new backend is done when it passes the suite.
The clusters are module-scoped and shared by the scenarios (a VM guest boots under TCG here:
boot once per module, and microVMs are restored from a template per shape); each test's
sandboxes are labelled with the test id and always stopped.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client, Sandbox
from tests.conftest import print_log_tails, start_cluster
from tests.helpers import sandbox_factory

IMAGES = Path(os.environ.get("DSEC_IMAGE_DIR", "/var/lib/dsec/images"))


@dataclass(frozen=True)
class BackendUnderTest:
    name: str  # the SDK's backend= value
    runtime: str  # DSEC_EDGE_RUNTIME of its edge
    image: str  # an image every scenario can use (a POSIX shell, coreutils)
    #: What the backend declares beyond the contract (edge.backends.contract.Capability values).
    capabilities: frozenset[str]
    extra_env: dict[str, str] = field(default_factory=dict)
    #: The smallest memory limit it takes (the memory-bomb scenario runs at it).
    min_memory_mb: int = 64
    #: How a sandbox ends when its runtime process is killed from the host.
    runtime_death: str = "CHANNEL_CLOSED"


BACKENDS = [
    BackendUnderTest(
        name="container",
        runtime="container",
        image="busybox",
        capabilities=frozenset(
            {"exec", "pause", "pack_diff", "trusted_exec", "network_policy", "modified_files"}
        ),
    ),
    # QEMU microvm guests on the same edge (guests boot under TCG here: the cluster is shared
    # by the module, and the guests are restored from one template per shape).
    BackendUnderTest(
        name="microvm",
        runtime="container",
        image="busybox",
        capabilities=frozenset({"exec", "pause", "network_policy"}),
        extra_env={"DSEC_EDGE_MICROVM": "on"},
        min_memory_mb=256,
        runtime_death="RUNTIME_ERROR",
    ),
]


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
    if not (IMAGES / "busybox.erofs").exists():
        pytest.skip("base images missing: run scripts/setup.sh (make test does)")
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
    with sandbox_factory(target.client, request.node.nodeid, memory_mb=256, grace_s=0.5) as f:

        def make_one(**kw: object) -> Sandbox:
            kw.setdefault("image", target.backend.image)
            kw.setdefault("backend", target.backend.name)
            return f(**kw)

        yield make_one
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print_log_tails(target.cluster, request.node.nodeid)
