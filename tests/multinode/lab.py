"""The multi-node cluster of the tests and bench/bench_cluster.py, on lab hosts.

See tests/multinode/conftest.py for the layout. ``nodes`` sets how many edge nodes (node1 ..
nodeN); ``shared_store=False`` gives every node a layer store of its own on its local disk
(what a cluster without a shared file system does: every image copied to every node) instead
of the MooseFS mount.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dsecctl.cluster import EdgeSpec, LocalCluster, VipPlan
from dsecctl.hosts import Host, HostLab
from dsecctl.moosefs import MooseFS
from dsecctl.vip_router import VipRouter, lab_vips
from libdsec import Client
from tests.conftest import IMAGES, require_images
from tests.pgserver import PostgresServer, start_postgres

NODES = ("node1", "node2", "node3")


@dataclass
class MultiNode:
    lab: HostLab
    fs: MooseFS
    pg: PostgresServer
    cluster: LocalCluster
    #: Per node: its layer store (a MooseFS client of its own, or a local directory).
    store: dict[str, Path]
    #: The router the API servers and the front ends announce their virtual IPs to.
    router: VipRouter
    nodes: tuple[str, ...] = field(default=NODES)

    def host(self, name: str) -> Host:
        return self.lab.hosts[name]

    def edge_of(self, node: str) -> str:
        return f"edge-{node}"

    def client(self, apiserver: str = "") -> Client:
        """A client of the virtual IP (default), or of one API server instance by name."""
        target = self.cluster.process(apiserver).address if apiserver else self.cluster.apiserver
        return Client(target, token=self.cluster.token)

    def state_dir(self, node: str) -> Path:
        return self.host(node).local("edge")


def edge_spec(lab: HostLab, node: str, store: Path, **env: str) -> EdgeSpec:
    host = lab.hosts[node]
    return EdgeSpec(
        edge_id=node,
        runtime="container",
        labels={"node": node},
        extra_env={
            "DSEC_EDGE_IMAGE_DIR": str(IMAGES),
            "DSEC_EDGE_FNCALL_POOLS": "",
            "DSEC_EDGE_VM": "off",
            "DSEC_EDGE_STATE_DIR": str(host.local("edge")),
            "DSEC_EDGE_LAYER_STORE": str(store),
            "DSEC_EDGE_NET_CLAIM_DIR": str(host.local("run", "net")),
            "DSEC_EDGE_BPF_PIN_DIR": f"/sys/fs/bpf/dsec-{lab.tag}-{node}",
            "DSEC_EDGE_CGROUP_PARENT": f"dsec-{lab.tag}-{node}",
            "DSEC_EDGE_PAUSE_SWAP_MB": "256",
            # Hashed once per cluster (edge.layers.node): a new node reads only what it uses.
            "DSEC_EDGE_LAYER_VERIFY": "store",
            **env,
        },
    )


@contextlib.contextmanager
def multinode_cluster(
    root: Path,
    watcher_env: dict[str, str] | None = None,
    *,
    nodes: int = len(NODES),
    shared_store: bool = True,
    log_level: str = "",
) -> Iterator[MultiNode]:
    """Starts the whole layout under ``root``; stops all of it on exit."""
    names = tuple(f"node{i + 1}" for i in range(nodes))
    require_images("busybox")
    lab = HostLab(root / "hosts")
    fs: MooseFS | None = None
    pg: PostgresServer | None = None
    cluster: LocalCluster | None = None
    router: VipRouter | None = None
    try:
        lab.start()
        for name in ("store", "cp", "sched", "router", *names):
            lab.add_host(name)
        lab.wait_reachable()
        # The API servers (node1, node2) and the front ends (cp, sched) behind virtual IPs.
        router = VipRouter(lab.hosts["router"]).start()
        api_vip, compat_vip = lab_vips(lab)
        for vip in (api_vip, compat_vip):
            lab.route(f"{vip}/32", lab.hosts["router"])
        fs = MooseFS(root / "mfs", lab.hosts["store"], [lab.hosts["store"], lab.hosts["node1"]])
        fs.start()
        if shared_store:
            store = {n: fs.mount(lab.hosts[n], lab.hosts[n].local("store")) for n in names}
        else:
            store = {n: lab.hosts[n].local("localstore") for n in names}
        pg = start_postgres()
        hosts = {
            "iam": lab.hosts["cp"],
            "watcher": lab.hosts["cp"],
            "compat": lab.hosts["cp"],
            "compat1": lab.hosts["sched"],
            "placement": lab.hosts["sched"],
            "apiserver": lab.hosts["node1"],
            "apiserver1": lab.hosts[names[1] if nodes > 1 else "cp"],
            **{f"edge-{n}": lab.hosts[n] for n in names},
        }
        cluster = LocalCluster(
            root / "home",
            # FnCall pools (SandboxFusion's run_code) on the second node only.
            edges=[
                edge_spec(
                    lab, n, store[n], **({"DSEC_EDGE_FNCALL_POOLS": "python=1"} if i == 1 else {})
                )
                for i, n in enumerate(names)
            ],
            apiservers=2,
            vip=VipPlan(api_vip, lab.hosts["router"].address),
            compats=2,
            compat_vip=VipPlan(compat_vip, lab.hosts["router"].address, port=7130),
            iam_database=pg.create_database("multinode"),
            hosts=hosts,
            log_level=log_level or ("DEBUG" if os.environ.get("DSEC_TEST_DEBUG") else "INFO"),
            extra_env={f"DSEC_WATCHER_{k}": v for k, v in (watcher_env or {}).items()},
        )
        cluster.start(timeout_s=120)
        for vip, procs in (
            (api_vip, ("apiserver", "apiserver1")),
            (compat_vip, ("compat", "compat1")),
        ):
            hops = {cluster.process(p).host.address for p in procs}  # type: ignore[union-attr]
            router.wait_next_hops(vip, hops)
        yield MultiNode(lab, fs, pg, cluster, store, router, names)
    finally:
        if cluster is not None:
            cluster.stop()
        if router is not None:
            router.close()
        if fs is not None:
            fs.close()
        if pg is not None:
            pg.stop()
        lab.close()
        for n in names:
            with contextlib.suppress(OSError):
                shutil.rmtree(f"/sys/fs/bpf/dsec-{lab.tag}-{n}")
