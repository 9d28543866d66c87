"""One cluster for the fuzz suite (package scope), its own, so the generated calls that are
valid and destructive (a drained node, a deleted project, a revoked token) hurt no other
test: a null-runtime edge (cheap sandboxes: lifecycle calls), a container edge (one sandbox:
exec, files and sessions reach the in-sandbox agents), and both HTTP front ends. Sandboxes
choose their edge by its ``fuzz`` label."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsecctl.cluster import EdgeSpec, LocalCluster
from tests.conftest import require_images, start_cluster


@pytest.fixture(scope="package")
def fuzz_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    require_images("busybox")
    edges = [
        EdgeSpec(edge_id="fz", runtime="null", labels={"fuzz": "null"}),
        EdgeSpec(
            edge_id="fzc", runtime="container", labels={"fuzz": "container"}, max_sandboxes=20
        ),
    ]
    c = start_cluster(tmp_path_factory.mktemp("fuzz"), edges=edges)
    try:
        yield c
    finally:
        c.stop()
