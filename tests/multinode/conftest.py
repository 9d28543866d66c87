"""A multi-node dsec cluster on this machine: every node a lab host with its own address.

Layout (``dsecctl.hosts`` makes the hosts, network namespaces on one bridge; built by
:func:`tests.multinode.lab.multinode_cluster`):

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

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multinode.lab import NODES, MultiNode, multinode_cluster

__all__ = ["NODES", "MultiNode", "restore_apiserver", "restore_node"]

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


def restore_apiserver(m: MultiNode, name: str, timeout_s: float = 60.0) -> None:
    """API server ``name`` running and announcing the virtual IP again (after a test killed it)."""
    p = m.cluster.process(name)
    if p.proc is None or p.proc.poll() is not None:
        m.cluster._spawn(p)
        m.cluster.wait_serving([p], timeout_s)
    assert m.cluster.vip is not None
    hops = {q.host.address for q in m.cluster.processes if q.module == "apiserver" and q.host}
    m.router.wait_next_hops(m.cluster.vip.address, hops, timeout_s)
