"""Shared setup of the E2B-compatibility tests: a container cluster with the compat front end,
a dsec token as the E2B API key, and the three E2B_* variables pointing the stock e2b SDK
at it (the way a user's unchanged code would be pointed)."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from e2b import Sandbox

from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client
from tests.integration.conftest import ClusterWith, container_edge


@dataclass(frozen=True)
class E2bTarget:
    cluster: LocalCluster
    url: str
    #: A dsec token (agent) of the root project in E2B's key shape (``e2b_<hex>``, what E2B's
    #: SDKs check), used as E2B_API_KEY.
    key: str


@contextmanager
def e2b_cluster(
    cluster_with: ClusterWith,
    name: str,
    edge: EdgeSpec | None = None,
    **cluster_kw: Any,
) -> Iterator[E2bTarget]:
    """A cluster of one container edge (``edge``, default e2b0) with the compat front end,
    always stopped; ``cluster_kw`` goes to the cluster (``extra_env``: the front end's
    settings)."""
    with cluster_with(name, edges=[edge or container_edge("e2b0")], **cluster_kw) as c:
        with Client(c.apiserver, token=c.token) as admin:
            key = admin.create_token("e2b-tests", agent=True, e2b=True).secret
        assert re.fullmatch(r"e2b_[0-9a-f]+", key), key
        yield E2bTarget(c, c.compat_url, key)


@contextmanager
def e2b_environment(target: E2bTarget) -> Iterator[None]:
    """E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set for the block, then restored."""
    wanted = {
        "E2B_API_URL": target.url,
        "E2B_SANDBOX_URL": target.url,
        "E2B_API_KEY": target.key,
    }
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def sandbox_maker(request: pytest.FixtureRequest) -> Iterator[Callable[..., Sandbox]]:
    """``Sandbox.create`` for a test: its sandboxes are labelled with the test (metadata
    "test", merged into what the test passes) and always killed afterwards."""
    made: list[Sandbox] = []
    tag = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]

    def create(*args: object, **kw: object) -> Sandbox:
        metadata = {"test": tag, **kw.pop("metadata", {})}  # type: ignore[dict-item]
        sb = Sandbox.create(*args, metadata=metadata, **kw)  # type: ignore[arg-type]
        made.append(sb)
        return sb

    try:
        yield create
    finally:
        for sb in made:
            try:
                sb.kill()
            except Exception:
                pass
