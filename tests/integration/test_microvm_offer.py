"""Whether an edge offers microVMs is decided by booting one: an edge whose QEMU cannot boot a
guest does not offer them and says why (GetNodeStatus, `dsec status`), and with
DSEC_EDGE_MICROVM=on refuses to start. The failing QEMU is real: a binary that is not a QEMU."""

from __future__ import annotations

from pathlib import Path

import pytest

from libdsec import Client
from libdsec.errors import BackendNotOffered
from tests.helpers import dsec_status
from tests.integration.conftest import ClusterWith

pytestmark = pytest.mark.images("busybox")


def _env(tmp: Path, mode: str) -> dict[str, str]:
    return {
        "DSEC_EDGE_MICROVM": mode,
        "DSEC_EDGE_MICROVM_QEMU": "/bin/false",  # boots nothing, under any accelerator
        "DSEC_EDGE_MICROVM_CACHE_DIR": str(tmp / "microvm"),
    }


def test_an_edge_that_boots_no_guest_does_not_offer_microvms_and_says_why(
    tmp_path: Path, cluster_with: ClusterWith
) -> None:
    with cluster_with("mvo0", edge_env=_env(tmp_path, "auto")) as c:
        status = dsec_status(c.home)
        line = next(x for x in status.splitlines() if "microvm:" in x)
        assert "no guest boots here" in line and "tcg: QEMU exited 1" in line, line
        assert "controls absent:" in status and "microvm" in status
        with Client(c.apiserver, token=c.token) as client:
            with client.create(image="busybox", cpu=0.25, memory_mb=64) as sb:
                assert sb.run("echo containers-still").text == "containers-still\n"
            with pytest.raises(BackendNotOffered):
                client.create(backend="microvm", image="busybox", memory_mb=256)


def test_an_edge_told_to_offer_microvms_refuses_to_start_without_them(
    tmp_path: Path, cluster_with: ClusterWith
) -> None:
    with pytest.raises(RuntimeError) as info, cluster_with("mvo0", edge_env=_env(tmp_path, "on")):
        pass
    text = str(info.value)
    assert "edge-mvo0 exited with 2" in text and "DSEC_EDGE_MICROVM=on requires them" in text
