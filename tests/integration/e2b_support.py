"""Shared setup of the E2B-compatibility tests: a container cluster with the compat front end,
a dsec token as the E2B API key, and the three E2B_* variables pointing the stock e2b SDK
at it (the way a user's unchanged code would be pointed)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client
from tests.conftest import start_cluster

IMAGES = Path(os.environ.get("DSEC_IMAGE_DIR", "/var/lib/dsec/images"))
HAVE_IMAGES = (IMAGES / "bookworm.erofs").exists()


@dataclass(frozen=True)
class E2bTarget:
    cluster: LocalCluster
    url: str
    key: str  # a dsec token (agent) of the root project, used as E2B_API_KEY


@contextmanager
def e2b_cluster(home: Path) -> Iterator[E2bTarget]:
    c = start_cluster(
        home,
        edges=[
            EdgeSpec(
                edge_id="e2b0",
                runtime="container",
                extra_env={"DSEC_EDGE_IMAGE_DIR": str(IMAGES), "DSEC_EDGE_FNCALL_POOLS": ""},
            )
        ],
    )
    try:
        with Client(c.apiserver, token=c.token) as admin:
            key = admin.create_token("e2b-tests", agent=True).secret
        yield E2bTarget(c, c.compat_url, key)
    finally:
        c.stop()


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
