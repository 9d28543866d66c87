"""Layered environments end to end: SDK -> apiserver -> edge -> layer store -> runc sandboxes.

One cluster with a container edge and a private layer store (a temp dir), so nothing here
touches the machine's shared store. Every sandbox is labelled with the test id and stopped,
Docker images built here are removed, also on failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dsecctl.cluster import LocalCluster
from edge.runtime import mounts
from libdsec import Client, Sandbox
from libdsec.errors import ImageNotFound, LayerCorrupt, LayerNotFound, Unavailable
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith

EDGE = "lay0"
pytestmark = pytest.mark.images("busybox")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The edge's private layer store."""
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def layer_cluster(cluster_with: ClusterWith, store: Path) -> Iterator[LocalCluster]:
    """A cluster of the module's own: a private layer store, a fast layer GC, a restart."""
    env = {
        "DSEC_EDGE_LAYER_STORE": str(store),
        "DSEC_EDGE_LAYER_GC_INTERVAL_S": "0.5",
        "DSEC_EDGE_LAYER_GC_GRACE_S": "1",
        "DSEC_EDGE_LAYER_CHUNK_KB": "64",
    }
    with cluster_with(EDGE, edge_env=env) as c:
        yield c


@pytest.fixture(scope="module")
def container_cluster(layer_cluster: LocalCluster) -> LocalCluster:
    return layer_cluster


@pytest.fixture
def sandbox_defaults() -> dict[str, Any]:
    return {"memory_mb": 128, "grace_s": 0.2}


def files(root: Path, content: dict[str, str]) -> Path:
    for rel, text in content.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def upper_of(cluster: LocalCluster, sandbox_id: str) -> Path:
    return (
        cluster.home / "edges" / EDGE / "container" / "runtime" / "sandboxes" / sandbox_id / "upper"
    )


# ------------------------------------------------------------------ composition


def test_layers_compose_and_writes_stay_in_the_upper(
    layer_cluster: LocalCluster,
    client: Client,
    make_sandbox: Callable[..., Sandbox],
    tmp_path: Path,
) -> None:
    ws = files(tmp_path / "ws", {"workspace/repo/main.py": "print('v1')\n"})
    tk1 = files(tmp_path / "tk1", {"opt/tool/version": "tool-1\n"})
    tk2 = files(tmp_path / "tk2", {"opt/tool/version": "tool-2\n"})
    env = client.import_image(f"dir:{ws}", "ws-env:v1", base="busybox", all_root=True)
    assert [x.kind for x in env.layers] == ["BASE", "WORKSPACE"]
    t1 = client.import_image(f"dir:{tk1}", "tool:1", kind="toolkit", all_root=True)
    t2 = client.import_image(f"dir:{tk2}", "tool:2", kind="toolkit", all_root=True)

    sb = make_sandbox(image="ws-env:v1", toolkits=["tool:1"])
    r = sb.run("cat /workspace/repo/main.py /opt/tool/version && busybox true && echo ok")
    assert r.ok and r.text == "print('v1')\ntool-1\nok\n", r.stderr
    # writes land in the upper; copy-up of a lower file; a new file in a lower directory
    sb.run("echo out > /work/new.txt; echo more >> /workspace/repo/main.py")
    sb.run(
        "mkdir -p /workspace/repo/pkg/__pycache__ && echo pyc > /workspace/repo/pkg/__pycache__/m.pyc"
    )
    upper = upper_of(layer_cluster, sb.id)
    assert (upper / "work" / "new.txt").read_text() == "out\n"
    assert (upper / "workspace" / "repo" / "main.py").read_text() == "print('v1')\nmore\n"
    assert (upper / "workspace" / "repo" / "pkg" / "__pycache__" / "m.pyc").exists()
    # the layers themselves are unchanged: a new sandbox sees the original, and the upgrade of
    # one toolkit changes one layer only
    sb2 = make_sandbox(image="ws-env:v1", toolkits=["tool:2"])
    assert sb2.run("cat /workspace/repo/main.py /opt/tool/version").text == "print('v1')\ntool-2\n"
    assert not sb2.files.exists("/work/new.txt")
    composed1 = client.compose_environment(
        "full:1", base="busybox", workspace="ws-env:v1", toolkits=["tool:1"]
    )
    composed2 = client.compose_environment(
        "full:2", base="busybox", workspace="ws-env:v1", toolkits=["tool:2"]
    )
    d1 = [x.digest for x in composed1.layers]
    d2 = [x.digest for x in composed2.layers]
    assert d1[:2] == d2[:2] == [x.digest for x in env.layers]
    assert d1[2] == t1.layers[0].digest and d2[2] == t2.layers[0].digest
    assert make_sandbox(image="full:2").run("cat /opt/tool/version").text == "tool-2\n"
    # every layer is one file-backed mount on the node (its local metadata image, no loop
    # device), shared by every sandbox that uses it
    edge_dir = layer_cluster.home / "edges" / EDGE / "container"
    layer_mounts = [
        m for m in mounts.mounts_under(edge_dir / "runtime" / "layers") if m.fstype == "erofs"
    ]
    assert layer_mounts and all(
        m.source.startswith(str(edge_dir / "layer-cache" / "meta")) for m in layer_mounts
    )
    assert len({m.source for m in layer_mounts}) == len(layer_mounts)


def test_imports_are_idempotent(client: Client, tmp_path: Path) -> None:
    src = files(tmp_path / "src", {"a.txt": "same"})
    a = client.import_image(f"dir:{src}", "idem:a", all_root=True)
    before = {x.digest for x in client.list_layers()}
    b = client.import_image(f"dir:{src}", "idem:b", all_root=True)
    assert [x.digest for x in a.layers] == [x.digest for x in b.layers]
    assert {x.digest for x in client.list_layers()} == before
    assert {"idem:a", "idem:b"} <= {e.name for e in client.list_environments("idem")}
    assert client.get_environment("idem:a").layers[0].meta_bytes > 0


# ------------------------------------------------------------------------ docker


@pytest.fixture
def docker_image(tmp_path: Path) -> Iterator[str]:
    """A Docker image (built on dsec/busybox) with a deleted file and an opaque directory."""
    tag = f"dsec-layers-test:{uuid.uuid4().hex[:8]}"
    (tmp_path / "Dockerfile").write_text(
        "FROM dsec/busybox:latest\n"
        "RUN mkdir -p /data/opq && echo old > /data/opq/old && echo keep > /data/keep\n"
        "RUN rm /bin/vi && rm -rf /data/opq && mkdir /data/opq && echo new > /data/opq/new\n"
        "ENV STAGE=imported\nWORKDIR /data\n"
    )
    r = subprocess.run(
        ["docker", "build", "-q", "-t", tag, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DOCKER_BUILDKIT": "0"},
    )
    if r.returncode != 0:
        pytest.fail(f"docker build failed (is dsec/busybox imported? scripts/setup.sh): {r.stderr}")
    try:
        yield tag
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=120)


def test_docker_image_whiteouts_and_opaque_dirs(
    client: Client, make_sandbox: Callable[..., Sandbox], docker_image: str
) -> None:
    env = client.import_image(f"docker:{docker_image}")
    assert env.name == f"docker/{docker_image}" and len(env.layers) == 3
    assert env.config["env.STAGE"] == "imported" and env.config["workdir"] == "/data"
    again = client.import_image(f"docker:{docker_image}")  # idempotent: nothing rebuilt
    assert [x.digest for x in again.layers] == [x.digest for x in env.layers]
    sb = make_sandbox(image=f"docker:{docker_image}")
    r = sb.run("ls /data/opq; cat /data/keep; test -e /bin/vi || echo vi-gone; echo $STAGE; pwd")
    assert r.text == "new\nkeep\nvi-gone\nimported\n/data\n", r.stderr


# ---------------------------------------------------------------------- pack_diff


def test_pack_diff_round_trips_chains_and_drops_residue(
    client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox()
    sb.run(
        "mkdir -p /work /root/.cache && echo 42 > /work/result.txt && echo secret > /tmp/answer "
        "&& echo 'cat /answer' > /root/.ash_history && echo c > /root/.cache/x && rm /bin/vi"
    )
    v1 = sb.pack_diff("packed:v1")  # while running: frozen only for the copy
    assert [x.kind for x in v1.layers] == ["BASE", "DIFF"]
    assert sb.run("echo still-running").text == "still-running\n"
    sb2 = make_sandbox(image="packed:v1")
    r = sb2.run(
        "cat /work/result.txt; ls /tmp; test -e /root/.ash_history || echo no-history; "
        "test -e /root/.cache || echo no-cache; test -e /bin/vi || echo vi-gone; ls -a /.dsec | wc -l"
    )
    assert r.text.split("\n")[:4] == ["42", "no-history", "no-cache", "vi-gone"], r.text
    sb2.run("echo 43 > /work/second.txt")
    sb2.pause()
    v2 = sb2.pack_diff("packed:v2", exclude=["/work/second.txt"])  # paused stays paused
    assert sb2.refresh().state == "PAUSED"
    assert [x.kind for x in v2.layers] == ["BASE", "DIFF"]  # nothing left after the exclusion
    sb2.run("echo 44 > /work/third.txt")
    v3 = sb2.pack_diff("packed:v3")
    assert [x.kind for x in v3.layers] == ["BASE", "DIFF", "DIFF"]  # diffs chain
    sb3 = make_sandbox(image="packed:v3")
    assert (
        sb3.run("cat /work/result.txt /work/third.txt; ls /work").text
        == "42\n44\nresult.txt\nsecond.txt\nthird.txt\n"
    )


# ----------------------------------------------------------------- bad input


def test_corrupt_blob_is_rejected_and_never_mounted(
    layer_cluster: LocalCluster, client: Client, store: Path, tmp_path: Path
) -> None:
    src = files(tmp_path / "c", {"data.bin": os.urandom(100_000).hex()})  # no dedup
    env = client.import_image(f"dir:{src}", "corrupt:v1", base="busybox", all_root=True)
    digest = env.layers[-1].digest
    blob = store / "layers" / digest.removeprefix("sha256:") / "data.blob"
    with open(blob, "r+b") as f:
        f.seek(100_000)
        byte = f.read(1)
        f.seek(100_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(LayerCorrupt) as err:
        client.create(image="corrupt:v1", cpu=0.2, memory_mb=64)
    assert digest in err.value.message and "corrupt" in err.value.message
    meta = (
        layer_cluster.home
        / "edges"
        / EDGE
        / "container"
        / "layer-cache"
        / "meta"
        / f"{digest.removeprefix('sha256:')}.erofs"
    )
    assert str(meta) not in Path("/proc/self/mountinfo").read_text()
    os.truncate(blob, 4096)
    with pytest.raises(LayerCorrupt, match="truncated"):
        client.create(image="corrupt:v1", cpu=0.2, memory_mb=64)


def test_missing_layer_fails_the_create_with_not_found(
    client: Client, store: Path, tmp_path: Path
) -> None:
    src = files(tmp_path / "m", {"f": "missing soon"})
    env = client.import_image(f"dir:{src}", "missing:v1", base="busybox", all_root=True)
    digest = env.layers[-1].digest
    layer_dir = store / "layers" / digest.removeprefix("sha256:")
    os.rename(layer_dir, store / "tmp" / "parked")
    try:
        with pytest.raises(LayerNotFound) as err:
            client.create(image="missing:v1", cpu=0.2, memory_mb=64)
        assert digest in err.value.message
    finally:
        os.rename(store / "tmp" / "parked", layer_dir)
    with pytest.raises(ImageNotFound):
        client.create(image="never-imported:v9", cpu=0.2, memory_mb=64)


def test_unreachable_store_fails_creates_fast_and_running_sandboxes_keep_working(
    client: Client, make_sandbox: Callable[..., Sandbox], store: Path
) -> None:
    sb = make_sandbox(image="packed:v1") if _exists(client, "packed:v1") else make_sandbox()
    moved = store.with_name("store-away")
    os.rename(store, moved)
    try:
        start = time.monotonic()
        with pytest.raises(Unavailable) as err:
            client.create(image="busybox", cpu=0.2, memory_mb=64)
        assert err.value.reason == "STORE_UNAVAILABLE"
        assert time.monotonic() - start < 5.0
        # the running sandbox reads its layers (data blobs stay open) and writes its upper
        r = sb.run("md5sum /bin/busybox >/dev/null && echo alive > /work/alive && cat /work/alive")
        assert r.ok and r.text == "alive\n"
    finally:
        os.rename(moved, store)
    assert make_sandbox().run("echo back").text == "back\n"


def _exists(client: Client, name: str) -> bool:
    try:
        client.get_environment(name)
        return True
    except ImageNotFound:
        return False


# -------------------------------------------------------------------------- gc


def test_gc_collects_layers_nothing_references(
    client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox()
    sb.run("echo first > /work/gc.txt")
    first = sb.pack_diff("gc:v1").layers[-1].digest
    sb.run("echo second > /work/gc.txt")
    second = sb.pack_diff("gc:v1").layers[-1].digest  # the name moves on
    assert first != second

    def layers() -> set[str]:
        return {x.digest for x in client.list_layers()}

    wait_for(lambda: first not in layers(), timeout_s=20)  # grace 1 s, every 0.5 s
    assert second in layers()
    user = make_sandbox(image="gc:v1")
    assert user.run("cat /work/gc.txt").text == "second\n"
    assert client.delete_environment("gc:v1")
    time.sleep(2.5)  # past the grace period: still there, a running sandbox has it mounted
    assert second in layers()
    user.stop()
    wait_for(lambda: second not in layers(), timeout_s=20)


# -------------------------------------------------------------------- recovery


def test_edge_restart_removes_layer_leftovers(layer_cluster: LocalCluster, store: Path) -> None:
    cache = layer_cluster.home / "edges" / EDGE / "container" / "layer-cache"
    layer_cluster.kill(f"edge-{EDGE}", signal.SIGKILL)  # a crash mid-import, say
    (cache / "tmp" / "docker-deadbeef" / "tree").mkdir(parents=True)
    (store / "tmp" / f"{EDGE}-999-build-deadbeef" / "layer").mkdir(parents=True)
    stray = cache / "mnt" / "stray"
    stray.mkdir(parents=True)
    env = (store / "environments" / "busybox%3Alatest.json").read_text()
    busybox = store / "layers" / json.loads(env)["layers"][0]["digest"].removeprefix("sha256:")
    mounts.mount(
        busybox / "meta.erofs", stray, "erofs", mounts.MS_RDONLY, f"device={busybox / 'data.blob'}"
    )
    layer_cluster.restart(f"edge-{EDGE}")
    assert not mounts.is_mountpoint(stray)
    assert not any((cache / "tmp").iterdir()) and not any((cache / "mnt").iterdir())
    assert not (store / "tmp" / f"{EDGE}-999-build-deadbeef").exists()


def test_pack_diff_config_applies_to_new_sandboxes_and_its_project_may_delete_it(
    layer_cluster: LocalCluster, client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    """``config``: env.* and workdir reach sandboxes made from the environment, other keys are
    kept; the API server records the packing project (``dsec.project``, not the caller's
    claim), whose members may delete it while another project's may not."""
    from libdsec.errors import PermissionDenied

    other = client.create_project(f"pack-other-{uuid.uuid4().hex[:6]}")
    member = client.create_token("pack-member", agent=True).secret
    stranger = client.create_token("pack-stranger", project=other.project_id, agent=True).secret
    sb = make_sandbox()
    sb.run("mkdir -p /srv/app && echo made > /srv/app/file")
    config = {"env.GREETING": "hi there", "workdir": "/srv/app", "mine": "kept"}
    env = sb.pack_diff("configured:v1", config={**config, "dsec.project": "spoofed"})
    me = client.whoami().project_id
    assert {k: env.config.get(k) for k in config} == config
    assert env.config["dsec.project"] == me
    made = make_sandbox(image="configured:v1")
    assert made.run('echo "$GREETING"; pwd; cat file').text == "hi there\n/srv/app\nmade\n"
    with Client(layer_cluster.apiserver, token=stranger) as c:
        with pytest.raises(PermissionDenied):
            c.delete_environment("configured:v1")
    with Client(layer_cluster.apiserver, token=member) as c:
        assert c.delete_environment("configured:v1")
    with pytest.raises(ImageNotFound):
        client.get_environment("configured:v1")
