"""Edges on one node never fight over a bridge, an address or a port.

`make up` then `make test` used to fail: every edge took the bridge dsec0 with 10.231.0.0/16, so
a test cluster's edge found the local cluster's resolver on 10.231.0.1:53 ("address already in
use") and would have handed out its addresses again. Here two clusters run at once (a local
cluster's and a test's), the second with two edges: three container edges with sandbox
networking on this host, none configured with a bridge or subnet. Each claims its own
(edge.network.claims), each sandbox resolves names through its own edge's resolver and reaches
the (private) internet, and every claim is released when its cluster stops.
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsecctl.cluster import EdgeSpec
from libdsec import Client, NetworkPolicy, Sandbox
from tests.adversarial.netlab import NetLab
from tests.integration.conftest import ClusterWith, container_edge

pytestmark = pytest.mark.images("busybox")
INDEX = 200 + os.getpid() % 50  # the adversarial suite and test_readme use 100..199
PYPI = f"10.199.{INDEX}.3"
CLAIMS = Path("/run/dsec/net")


@pytest.fixture(scope="module")
def internet() -> Iterator[NetLab]:
    lab = NetLab(INDEX, {"pypi.org": PYPI}, tag="n").start()
    try:
        yield lab
    finally:
        lab.close()


def _edges(dns: str, *edge_ids: str) -> list[EdgeSpec]:
    env = {"DSEC_EDGE_MICROVM": "off", "DSEC_EDGE_DNS_UPSTREAM": dns}
    return [container_edge(e, env, labels={"node": e}) for e in edge_ids]


def _claims_of(home: Path) -> dict[str, dict[str, str]]:
    """The network claims of the cluster at ``home``, by edge state dir."""
    out = {}
    for path in CLAIMS.glob("*.json"):
        data = json.loads(path.read_text())
        if data["state_dir"].startswith(str(home.resolve()) + "/"):
            out[Path(data["state_dir"]).name] = data
    return out


def _nc(sb: Sandbox, host: str, port: int) -> tuple[int, bytes]:
    """busybox nc asking for ``host`` as an HTTP client does (the name gate reads the Host)."""
    request = f"GET / HTTP/1.1\\r\\nHost: {host}\\r\\n\\r\\n"
    r = sb.run(f"printf '{request}' | nc -w 3 {host} {port}", timeout_s=30)
    return r.exit_code, r.stdout + r.stderr


def test_edges_of_two_clusters_network_sandboxes_at_once(
    internet: NetLab, cluster_with: ClusterWith
) -> None:
    with cluster_with("nodeone", edges=_edges(internet.dns, "nodea")) as first:
        with cluster_with("nodetwo", edges=_edges(internet.dns, "nodeb", "nodec")) as second:
            placed = [(first, "nodea"), (second, "nodeb"), (second, "nodec")]
            gateways = set()
            for cluster, edge in placed:
                with Client(cluster.apiserver, token=cluster.token) as c:
                    sb = c.create(
                        image="busybox",
                        cpu=0.2,
                        memory_mb=64,
                        network=NetworkPolicy(allow=["pypi.org:80"]),
                        node_selector={"node": edge},
                    )
                    try:
                        assert sb.info.edge_id == edge
                        resolv = sb.files.read("/etc/resolv.conf").decode()
                        gateway = resolv.split("nameserver", 1)[1].split()[0]
                        gateways.add(gateway)
                        r = sb.run("nslookup pypi.org", timeout_s=20)
                        assert PYPI.encode() in r.stdout, (edge, r.stdout + r.stderr)
                        assert _nc(sb, "pypi.org", 80) == (0, b"pypi.org\n"), edge
                    finally:
                        sb.stop()
            assert len(gateways) == 3, gateways  # three resolvers, one per edge's bridge
            claims = {**_claims_of(first.home), **_claims_of(second.home)}
            assert sorted(claims) == ["nodea", "nodeb", "nodec"], claims
            assert len({d["bridge"] for d in claims.values()}) == 3, claims
            assert len({d["gate_queue"] for d in claims.values()}) == 3, claims
            nets = [ipaddress.IPv4Network(d["subnet"]) for d in claims.values()]
            assert not any(a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1 :])
            assert {str(next(n.hosts())) for n in nets} == gateways
        assert not _claims_of(second.home)  # released with their bridges
        assert _claims_of(first.home)  # the other cluster's is untouched
    assert not _claims_of(first.home)
