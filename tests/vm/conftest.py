"""The full-VM suite's fixtures: one cluster for the whole session, whose edge offers the vm
backend (DSEC_EDGE_VM=on: the edge refuses to start without libvirt, the VM images and a
booting guest, so this suite fails loudly rather than skipping), with the E2B front end.

VM guests run under TCG here: a desktop boots in minutes. Every test shares the node's
templates (one boot per image and shape, saved; every create restores it), so the tests use
two shapes only: ``VM_SHAPE`` for the bookworm image and ``DESKTOP_SHAPE`` for the desktop
(also what the E2B front end gives its "desktop" template).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client, Sandbox
from tests.conftest import IMAGES, require_images, start_cluster
from tests.integration.e2b_support import E2bTarget

VM_IMAGES = Path("/var/lib/dsec/vm-images")
#: The bookworm VMs' shape (one template for all of them).
VM_SHAPE: dict[str, Any] = {"cpu": 1, "memory_mb": 768}
#: The desktop VMs' shape (one template; the E2B front end's "desktop" template uses it too).
DESKTOP_SHAPE: dict[str, Any] = {"cpu": 1, "memory_mb": 1536}
EDGE = "vm0"
DOMAIN = "dsec.test"


def require_vm_images(*names: str) -> None:
    missing = [n for n in names if not (VM_IMAGES / n / "image.json").is_file()]
    if missing:
        pytest.fail(
            f"VM images missing: {', '.join(missing)} (build them: scripts/build-vm-images.sh)"
        )


@pytest.fixture(scope="session")
def vm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    require_images("busybox")
    require_vm_images("bookworm", "desktop")
    edge = EdgeSpec(
        edge_id=EDGE,
        runtime="container",
        extra_env={
            "DSEC_EDGE_IMAGE_DIR": str(IMAGES),
            "DSEC_EDGE_FNCALL_POOLS": "",
            "DSEC_EDGE_VM": "on",
            "DSEC_EDGE_VM_IMAGE_DIR": str(VM_IMAGES),
        },
        memory_mb=12288,
    )
    c = start_cluster(
        tmp_path_factory.mktemp("vm"),
        edges=[edge],
        extra_env={
            "DSEC_COMPAT_DOMAIN": DOMAIN,
            "DSEC_COMPAT_TEMPLATE_MEMORY_MB": f"desktop={DESKTOP_SHAPE['memory_mb']}",
        },
        timeout_s=180,
    )
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def container_cluster(vm_cluster: LocalCluster) -> LocalCluster:
    """(So a failing test prints the services' log tails: see tests/conftest.py.)"""
    return vm_cluster


@pytest.fixture
def client(vm_cluster: LocalCluster) -> Iterator[Client]:
    with Client(vm_cluster.apiserver, token=vm_cluster.token) as c:
        yield c


@pytest.fixture(scope="session")
def session_client(vm_cluster: LocalCluster) -> Iterator[Client]:
    with Client(vm_cluster.apiserver, token=vm_cluster.token) as c:
        yield c


@contextmanager
def one_vm(client: Client, image: str, label: str, ttl_s: int = 3600) -> Iterator[Sandbox]:
    """A VM of `image` in its shared shape (one template), shared by the tests of a scope and
    stopped at its end."""
    shape = DESKTOP_SHAPE if image == "desktop" else VM_SHAPE
    # The first create of a shape builds its template: a desktop's takes minutes under TCG.
    sb = client.create(
        backend="vm", image=image, labels={"test": label}, ttl_s=ttl_s, timeout=900, **shape
    )
    try:
        yield sb
    finally:
        sb.stop(grace_s=1)


@pytest.fixture(scope="session")
def desktop_sandbox(session_client: Client) -> Iterator[Sandbox]:
    """One desktop VM for the display tests that leave it as they found it."""
    with one_vm(session_client, "desktop", "desktop") as sb:
        yield sb


@pytest.fixture(scope="session")
def e2b_target(vm_cluster: LocalCluster, session_client: Client) -> E2bTarget:
    key = session_client.create_token("e2b-desktop", agent=True).secret
    return E2bTarget(vm_cluster, vm_cluster.compat_url, key)


@pytest.fixture(scope="module")
def e2b_desktop_env(e2b_target: E2bTarget) -> dict[str, str]:
    return {
        "E2B_API_URL": e2b_target.url,
        "E2B_SANDBOX_URL": e2b_target.url,
        "E2B_API_KEY": e2b_target.key,
    }
