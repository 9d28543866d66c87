"""One cluster for the fuzz suite (package scope): a null-runtime edge and both HTTP front
ends, its own, so the generated calls that are valid and destructive (a drained node, a
deleted project, a revoked token) hurt no other test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsecctl.cluster import EdgeSpec, LocalCluster
from tests.conftest import start_cluster


@pytest.fixture(scope="package")
def fuzz_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(
        tmp_path_factory.mktemp("fuzz"), edges=[EdgeSpec(edge_id="fz", runtime="null")]
    )
    try:
        yield c
    finally:
        c.stop()
