"""Several nodes, one cluster: creates spread over the nodes, every call from any API server,
one layer store shared through MooseFS, the CLI and the E2B front end unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest

from libdsec import Exited, Output
from libdsec.errors import Unavailable
from tests.multinode.conftest import NODES, MultiNode, restore_apiserver
from tests.multinode.viplab import instance_of

pytestmark = [pytest.mark.integration, pytest.mark.images("busybox")]


def test_sandboxes_spread_over_the_nodes_and_any_api_server_serves_any_of_them(
    multinode: MultiNode,
) -> None:
    with multinode.client("apiserver") as a, multinode.client("apiserver1") as b:
        made = a.create_many(9, image="busybox", cpu=0.25, memory_mb=64, labels={"t": "spread"})
        try:
            sandboxes = [s for s in made if not isinstance(s, Exception)]
            assert len(sandboxes) == 9, made
            nodes = Counter(s.info.edge_id for s in sandboxes)
            assert set(nodes) == set(NODES), nodes  # power-of-k over three equal nodes
            for s in sandboxes:
                # Created through node1's API server, driven through node2's.
                r = b.get(s.id).run("cat /proc/sys/kernel/hostname; echo ok")
                assert r.exit_code == 0 and r.stdout.endswith(b"ok\n"), r
        finally:
            for item in made:
                if not isinstance(item, Exception):
                    item.stop()


def test_each_node_keeps_its_own_state_and_mounts_the_one_store(multinode: MultiNode) -> None:
    with multinode.client() as c, c.create(image="busybox", memory_mb=64) as sb:
        node = sb.info.edge_id
        assert sb.run("ls /bin/busybox").exit_code == 0
        # The sandbox's record is on its node only.
        states = {n: multinode.state_dir(n) for n in NODES}
        holders = [n for n, d in states.items() if sb.id in " ".join(p.name for p in d.rglob("*"))]
        assert holders == [node], holders
        # One store: the layer the sandbox runs on is the same file from every node's mount.
        layers = {
            n: sorted(p.name for p in (multinode.store[n] / "layers").iterdir()) for n in NODES
        }
        assert layers["node1"] and layers["node1"] == layers["node2"] == layers["node3"]
        # Only metadata is copied to the node: the metadata cache holds no blob.
        cache = states[node] / "container" / "layer-cache" / "meta"
        assert list(cache.glob("*.erofs")), list(states[node].rglob("layer-cache*"))


def test_the_cli_works_against_the_cluster_unchanged(multinode: MultiNode) -> None:
    env = {
        **os.environ,
        "DSEC_TARGET": multinode.cluster.process("apiserver1").address,
        "DSEC_TOKEN": multinode.cluster.token,
    }
    out = subprocess.run(
        [sys.executable, "-m", "dsecctl", "sandbox", "create", "--image", "busybox"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    sid = out.stdout.strip()
    try:
        run = subprocess.run(
            [sys.executable, "-m", "dsecctl", "sandbox", "exec", sid, "--", "echo", "hi"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert run.returncode == 0 and run.stdout.strip() == "hi", run
    finally:
        subprocess.run(
            [sys.executable, "-m", "dsecctl", "sandbox", "stop", sid],
            capture_output=True,
            env=env,
            timeout=60,
        )


def test_an_attach_through_an_api_server_that_dies_resumes_from_its_offset(
    multinode: MultiNode,
) -> None:
    """Behind the virtual IP: the attach stream of a client whose connection is on the API
    server killed ends with UNAVAILABLE; attached again from the bytes it had (any instance
    serves it), the output is whole, no byte lost or repeated."""
    m = multinode
    candidates = [m.client() for _ in range(30)]
    try:
        c = next(x for x in candidates if instance_of(x) == "apiserver1")
        lines = 300
        want = "".join(f"line{i}\n" for i in range(lines)).encode()
        with c.create(image="busybox", memory_mb=64) as sb:
            p = sb.start(
                f"i=0; while [ $i -lt {lines} ]; do echo line$i; i=$((i+1)); sleep 0.02; done"
            )
            got = bytearray()
            victim = m.cluster.process("apiserver1")
            with pytest.raises(Unavailable):
                for event in p.attach():
                    if isinstance(event, Output) and event.stream == "stdout":
                        got += event.data
                        if len(got) > 200 and victim.proc.poll() is None:  # type: ignore[union-attr]
                            victim.proc.kill()  # type: ignore[union-attr]
            assert 0 < len(got) < len(want)
            for event in p.attach(stdout_offset=len(got)):
                if isinstance(event, Output) and event.stream == "stdout":
                    got += event.data
                elif isinstance(event, Exited):
                    break
            assert bytes(got) == want
    finally:
        for x in candidates:
            x.close()
        restore_apiserver(m, "apiserver1")
