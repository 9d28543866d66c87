"""Whether an edge offers microVMs is decided by booting one: an edge whose QEMU cannot boot a
guest does not offer them and says why (GetNodeStatus, `dsec status`), and with
DSEC_EDGE_MICROVM=on refuses to start. The failing QEMU is real: a binary that is not a QEMU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsecctl.cluster import EdgeSpec
from libdsec import Client
from libdsec.errors import BackendNotOffered
from tests.conftest import start_cluster
from tests.helpers import dsec_status

IMAGES = Path(os.environ.get("DSEC_IMAGE_DIR", "/var/lib/dsec/images"))
pytestmark = pytest.mark.skipif(
    not (IMAGES / "busybox.erofs").exists(),
    reason="base images missing: run scripts/setup.sh (make test does)",
)


def _edge(tmp: Path, mode: str) -> EdgeSpec:
    return EdgeSpec(
        edge_id="mvo0",
        runtime="container",
        extra_env={
            "DSEC_EDGE_IMAGE_DIR": str(IMAGES),
            "DSEC_EDGE_FNCALL_POOLS": "",
            "DSEC_EDGE_MICROVM": mode,
            "DSEC_EDGE_MICROVM_QEMU": "/bin/false",  # boots nothing, under any accelerator
            "DSEC_EDGE_MICROVM_CACHE_DIR": str(tmp / "microvm"),
        },
    )


def test_an_edge_that_boots_no_guest_does_not_offer_microvms_and_says_why(
    tmp_path: Path,
) -> None:
    c = start_cluster(tmp_path / "home", edges=[_edge(tmp_path, "auto")])
    try:
        status = dsec_status(c.home)
        line = next(x for x in status.splitlines() if "microvm:" in x)
        assert "no guest boots here" in line and "tcg: QEMU exited 1" in line, line
        assert "controls absent:" in status and "microvm" in status
        with Client(c.apiserver, token=c.token) as client:
            with client.create(image="busybox", cpu=0.25, memory_mb=64) as sb:
                assert sb.run("echo containers-still").text == "containers-still\n"
            with pytest.raises(BackendNotOffered):
                client.create(backend="microvm", image="busybox", memory_mb=256)
    finally:
        c.stop()


def test_an_edge_told_to_offer_microvms_refuses_to_start_without_them(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as info:
        start_cluster(tmp_path / "home", edges=[_edge(tmp_path, "on")])
    text = str(info.value)
    assert "edge-mvo0 exited with 2" in text and "DSEC_EDGE_MICROVM=on requires them" in text
