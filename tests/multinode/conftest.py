"""A multi-node dsec cluster on this machine: every node a lab host with its own address.

Layout (``dsecctl.hosts`` makes the hosts, network namespaces on one bridge):

| host | runs |
|---|---|
| ``store`` | the MooseFS master and a chunkserver (the shared layer store) |
| ``cp`` | IAM (on PostgreSQL, a real server the test starts), the watcher, the compat front end |
| ``sched`` | placement |
| ``node1`` .. ``node3`` | an edge each (container backend); an API server on node1 and node2; a chunkserver on node1 |

Each edge keeps what a real node keeps local under its host's own directory: state (sandbox
records, writable layers, the layer metadata cache, its swap area), its claim on a sandbox
bridge (the bridge itself lives in the host's namespace) and its cgroup parent; every edge
mounts the one layer store through a MooseFS client of its own. Clients (the SDK, the CLI,
the e2b SDK) run in the test's namespace and reach the hosts over the lab bridge.

The cluster is shared by the modules in this directory (session scope); a test that breaks a
node brings it back before it ends (:func:`restore_node`), also when it fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsecctl.cluster import EdgeSpec, LocalCluster
from dsecctl.hosts import Host, HostLab
from dsecctl.moosefs import MooseFS
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
    #: Per node: its layer store mount (a MooseFS client of its own).
    store: dict[str, Path]

    def host(self, name: str) -> Host:
        return self.lab.hosts[name]

    def edge_of(self, node: str) -> str:
        return f"edge-{node}"

    def client(self, apiserver: str = "apiserver") -> Client:
        return Client(self.cluster.process(apiserver).address, token=self.cluster.token)

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
def multinode_cluster(root: Path, watcher_env: dict[str, str] | None = None) -> Iterator[MultiNode]:
    """Starts the whole layout above under ``root``; stops all of it on exit."""
    require_images("busybox")
    lab = HostLab(root / "hosts")
    fs: MooseFS | None = None
    pg: PostgresServer | None = None
    cluster: LocalCluster | None = None
    try:
        lab.start()
        for name in ("store", "cp", "sched", *NODES):
            lab.add_host(name)
        lab.wait_reachable()
        fs = MooseFS(root / "mfs", lab.hosts["store"], [lab.hosts["store"], lab.hosts["node1"]])
        fs.start()
        store = {n: fs.mount(lab.hosts[n], lab.hosts[n].local("store")) for n in NODES}
        pg = start_postgres()
        hosts = {
            "iam": lab.hosts["cp"],
            "watcher": lab.hosts["cp"],
            "compat": lab.hosts["cp"],
            "placement": lab.hosts["sched"],
            "apiserver": lab.hosts["node1"],
            "apiserver1": lab.hosts["node2"],
            **{f"edge-{n}": lab.hosts[n] for n in NODES},
        }
        cluster = LocalCluster(
            root / "home",
            edges=[edge_spec(lab, n, store[n]) for n in NODES],
            apiservers=2,
            iam_database=pg.create_database("multinode"),
            hosts=hosts,
            log_level="DEBUG" if os.environ.get("DSEC_TEST_DEBUG") else "INFO",
            extra_env={f"DSEC_WATCHER_{k}": v for k, v in (watcher_env or {}).items()},
        )
        cluster.start(timeout_s=120)
        yield MultiNode(lab, fs, pg, cluster, store)
    finally:
        if cluster is not None:
            cluster.stop()
        if fs is not None:
            fs.close()
        if pg is not None:
            pg.stop()
        lab.close()
        for n in NODES:
            with contextlib.suppress(OSError):
                shutil.rmtree(f"/sys/fs/bpf/dsec-{lab.tag}-{n}")


#: The node-loss test shortens the watcher's "gone" rule from 120 s: a lost node's sandboxes
#: are reported EDGE_LOST and their quota released within seconds, not minutes.
WATCHER_ENV = {"RELEASE_GONE_AFTER_S": "8", "UNHEALTHY_AFTER": "2", "RECONCILE_GRACE_S": "5"}


@pytest.fixture(scope="session")
def multinode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiNode]:
    with multinode_cluster(tmp_path_factory.mktemp("multinode"), WATCHER_ENV) as m:
        yield m


def _store_answers(path: Path) -> bool:
    try:
        os.statvfs(path)
        return os.path.ismount(path)
    except OSError:  # ENOTCONN: a FUSE mount whose daemon is gone
        return False


def restore_node(m: MultiNode, node: str, timeout_s: float = 60.0) -> None:
    """Brings a node back as it was: its link up, its edge running and healthy again."""
    host = m.host(node)
    host.link_up()
    store = m.store[node]
    if not _store_answers(store):  # its MooseFS client was killed with the node
        m.fs.unmount(store)
        m.fs.mount(host, store)
    p = m.cluster.process(m.edge_of(node))
    if p.proc is None or p.proc.poll() is not None:
        m.cluster._spawn(p)
        m.cluster.wait_serving([p], timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            m.cluster.wait_edges_registered(timeout_s=2)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise
