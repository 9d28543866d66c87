"""``dsec deploy --ray`` on a real multi-node Ray cluster (tests/multinode/raylab.py).

Four lab hosts (dsecctl.hosts): Ray's head on r0, workers on r1 and r2, r3 kept for a node
that joins later; a MooseFS (master on r0, chunkservers on r1 and r2) mounted once as the layer
store (the hosts share this machine's mounts). The CLI runs as a user's would, from the test's
own namespace through Ray Client, with a ``DSEC_HOME`` of its own; sandboxes are created through
``libdsec.Client()`` from that home alone.

One test walks the deployment's life (each step needs the previous one's state): bad
addresses refused before anything starts; deploy; twice refused; container sandboxes on several
nodes; an edge killed with SIGKILL restarted by its actor, its sandboxes answering again; the
edge's actor killed, restarted by Ray, taking the edge over; the deployment actor killed,
restarted, finding its actors again (``dsec status`` from the home alone); a node
joining gets an edge that takes creates; that node leaving has its edge actor dropped and the
edge unhealthy in the watcher; an undeploy keeping the sandboxes, whose next deploy re-adopts
them; undeploy leaves no service process and no sandbox.
Everything is stopped also when a step fails: the lab's processes (Ray, the services) by PID,
the sandboxes' processes by their cgroups, the mounts, MooseFS.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsecctl.cluster import release_mounts, release_swaps
from dsecctl.hosts import Host, HostLab
from dsecctl.moosefs import MooseFS
from dsecctl.ray_deploy import edge_id_for
from dsecctl.vip_router import VipRouter, lab_vips
from libdsec import Client
from tests.conftest import IMAGES
from tests.helpers import wait_for
from tests.multinode.raylab import REPO, RayLab

pytestmark = [pytest.mark.integration, pytest.mark.images("busybox")]


@dataclass
class World:
    lab: HostLab
    hosts: list[Host]
    ray: RayLab
    store: Path
    node_dir: Path
    home: Path
    #: The nodes' BGP router (a host that is not a Ray node) and the API servers' virtual IP.
    router: VipRouter
    vip: str


def _sandbox_cgroups(node_dir: Path) -> list[Path]:
    """The cgroup parents the deployment's edges put their sandboxes in (every hierarchy)."""
    suffix = "-" + hashlib.sha1(str(node_dir).encode()).hexdigest()[:8]
    out = []
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        with contextlib.suppress(OSError):
            out += [d for d in hierarchy.glob("dsec-n*") if d.name.endswith(suffix)]
    return out


def sandbox_pids(node_dir: Path) -> set[int]:
    """Every process in a sandbox of the deployment's edges."""
    pids: set[int] = set()
    for parent in _sandbox_cgroups(node_dir):
        for procs in parent.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids |= {int(p) for p in procs.read_text().split()}
    return pids


def _kill_sandboxes(node_dir: Path) -> None:
    """After a failure: the sandboxes an edge killed with SIGKILL left running."""
    for _ in range(3):
        for pid in sandbox_pids(node_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("raydeploy")
    lab = HostLab(root / "lab")
    ray_lab = RayLab()
    fs: MooseFS | None = None
    router: VipRouter | None = None
    node_dir = root / "nodes"
    try:
        lab.start()
        hosts = [lab.add_host(n) for n in ("r0", "r1", "r2", "r3")]
        lab.add_host("rt")
        lab.wait_reachable()
        router = VipRouter(lab.hosts["rt"]).start()
        vip = lab_vips(lab)[0]
        lab.route(f"{vip}/32", lab.hosts["rt"])
        fs = MooseFS(root / "mfs", hosts[0], hosts[1:3]).start()
        store = fs.mount(hosts[0], root / "store")
        t0 = time.monotonic()
        ray_lab.start_head(hosts[0])
        for h in hosts[1:3]:
            ray_lab.add_worker(h)
        print(f"\nRay: head and 2 workers started in {time.monotonic() - t0:.1f} s")
        yield World(lab, hosts, ray_lab, store, node_dir, root / "home", router, vip)
    finally:
        ray_lab.close()  # Ray, and the services its actors started (same namespaces)
        if router is not None:
            router.close()
        _kill_sandboxes(node_dir)
        for h in lab.hosts.values():  # the edges' claim directories an undeploy did not remove
            shutil.rmtree(f"/run/dsec/ray/{edge_id_for(h.address)}", ignore_errors=True)
        if node_dir.exists():
            release_mounts(node_dir)
            release_swaps(node_dir)
        if fs is not None:
            fs.close()
        lab.close()


def dsec(w: World, *args: str, host: Host | None = None, timeout: float = 400) -> Any:
    """``dsec ARGS`` with the deployment's ``DSEC_HOME`` and the Ray nodes' environment (on
    ``host``'s network, else the test's)."""
    argv = [sys.executable, "-m", "dsecctl", *args]
    return subprocess.run(
        host.command(argv) if host is not None else argv,
        env={**w.ray.env, "DSEC_HOME": str(w.home)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def deployment(w: World, address: str = "") -> dict[str, Any]:
    r = dsec(w, "deploy", "--ray", address or w.ray.client_address, "--status", "--json")
    assert r.stdout, r.stderr
    return dict(json.loads(r.stdout))


def services(st: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in st["services"]}


def edge_health(st: dict[str, Any], edge_id: str) -> str:
    """The watcher's health of ``edge_id`` ("" = unknown to it)."""
    import grpc

    from dsec.watcher.v1 import watcher_pb2, watcher_pb2_grpc

    with grpc.insecure_channel(services(st)["watcher"]["address"]) as ch:
        snap = (
            watcher_pb2_grpc.WatcherServiceStub(ch)
            .GetClusterSnapshot(watcher_pb2.GetClusterSnapshotRequest(), timeout=5)
            .snapshot
        )
    for e in snap.edges:
        if e.info.edge_id == edge_id:
            return str(watcher_pb2.EdgeHealth.Name(e.health))
    return ""


def service_processes(w: World) -> list[int]:
    """dsec services (``python -m <svc>``) running on the lab's hosts."""
    modules = {b"iam", b"watcher", b"placement", b"apiserver", b"compat", b"edge"}
    out = []
    for h in w.hosts:
        for pid in h.pids():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"-m" in argv and modules & set(argv):
                    out.append(pid)
    return out


def _answers(w: World, old_pid: int) -> bool:
    """Whether the deployment answers from another actor process than ``old_pid``, with
    every service it had."""
    r = dsec(w, "deploy", "--ray", w.ray.client_address, "--status", "--json", timeout=120)
    if r.returncode != 0 or not r.stdout:
        return False
    st = json.loads(r.stdout)
    return bool(st["actor_pid"] != old_pid and len(st["services"]) >= 9)


def test_deploy_on_ray(world: World) -> None:
    w = world
    r3 = w.hosts[3]
    edge_ids = [edge_id_for(h.address) for h in w.hosts]

    # Bad addresses: refused within seconds, before anything starts.
    absent = str(w.lab.subnet.network_address + 250) if w.lab.subnet else ""
    for address in (f"ray://{r3.address}:10001", f"{absent}:6379"):
        t0 = time.monotonic()
        r = dsec(w, "deploy", "--ray", address, timeout=60)
        took = time.monotonic() - t0
        assert r.returncode != 0 and "RAY_UNREACHABLE" in r.stderr, r.stderr
        assert address in r.stderr and took < 10, (took, r.stderr)
    assert not (w.home / "cluster.json").exists() and r3.pids() == []
    r = dsec(w, "undeploy", "--ray", w.ray.client_address, timeout=60)
    assert r.returncode != 0 and "NOT_DEPLOYED" in r.stderr, r.stderr

    # Deploy.
    edge_env = {
        "DSEC_EDGE_IMAGE_DIR": str(IMAGES),
        "DSEC_EDGE_VM": "off",
        "DSEC_EDGE_MICROVM": "off",
        "DSEC_EDGE_FNCALL_POOLS": "",
        "DSEC_EDGE_PAUSE_SWAP_MB": "0",
    }
    args = ["--layer-store", str(w.store), "--node-dir", str(w.node_dir)]
    # The API servers behind a virtual IP, announced to the nodes' router.
    args += ["--vip", w.vip, "--vip-router", w.router.host.address]
    for k, v in edge_env.items():
        args += ["--edge-env", f"{k}={v}"]
    # An edge that cannot start: the deploy fails naming it, and leaves nothing behind.
    r = dsec(
        w, "deploy", "--ray", w.ray.client_address, *args, "--edge-env", "DSEC_EDGE_MAX_SANDBOXES=0"
    )
    assert r.returncode != 0 and "DSEC_EDGE_MAX_SANDBOXES" in r.stderr, r.stderr
    assert "edge-n" in r.stderr and not (w.home / "cluster.json").exists(), r.stderr
    assert service_processes(w) == []
    r = dsec(w, "deploy", "--ray", w.ray.client_address, "--status", timeout=60)
    assert r.returncode != 0 and "NOT_DEPLOYED" in r.stderr, r.stderr

    t0 = time.monotonic()
    r = dsec(w, "deploy", "--ray", w.ray.client_address, *args)
    print(f"deploy: {time.monotonic() - t0:.1f} s\n{r.stdout}")
    assert r.returncode == 0, r.stdout + r.stderr
    st = deployment(w)
    svcs = services(st)
    nodes = {h.address for h in w.hosts[:3]}
    assert {f"edge-{e}" for e in edge_ids[:3]} <= set(svcs)
    assert all(s["health"] == "SERVING" for s in svcs.values()), svcs
    assert svcs["iam"]["node"] == w.hosts[0].address
    assert svcs["apiserver1"]["node"] != svcs["apiserver"]["node"]
    assert {s["node"] for s in svcs.values()} == nodes
    assert json.loads((w.home / "cluster.json").read_text())["apiserver"] == st["apiserver"]
    # Both API servers announce the virtual IP; clients (cluster.json) are given it.
    assert st["apiserver"] == f"{w.vip}:7100"
    w.router.wait_next_hops(w.vip, {svcs["apiserver"]["node"], svcs["apiserver1"]["node"]}, 30)
    # The GCS address, from a Ray node, sees the same deployment.
    r = dsec(w, "deploy", "--ray", w.ray.gcs_address, "--status", host=w.hosts[1])
    assert r.returncode == 0 and "edge-" + edge_ids[2] in r.stdout, r.stdout + r.stderr

    # Deploying twice: refused, naming the deployment there.
    r = dsec(w, "deploy", "--ray", w.ray.client_address, *args, timeout=60)
    assert r.returncode != 0 and "ALREADY_DEPLOYED" in r.stderr, r.stderr
    assert st["apiserver"] in r.stderr

    os.environ["DSEC_HOME"] = str(w.home)  # Client() from the home alone, as a user's
    try:
        with Client() as c:
            sandboxes = [c.create(image="busybox", cpu=0.25, memory_mb=128) for _ in range(3)]
            on = {sb.refresh().edge_id for sb in sandboxes}
            assert len(on) >= 2, on
            for sb in sandboxes:
                assert sb.run(f"echo hi from {sb.id}").text.strip() == f"hi from {sb.id}"

            # An edge killed with SIGKILL: its actor starts it again; its sandboxes answer.
            victim = sandboxes[0].refresh().edge_id
            before = services(st)[f"edge-{victim}"]
            os.kill(before["pid"], signal.SIGKILL)
            t0 = time.monotonic()

            def restarted() -> bool:
                s = services(deployment(w))[f"edge-{victim}"]
                return s["restarts"] == 1 and s["health"] == "SERVING" and s["pid"] != before["pid"]

            wait_for(restarted, timeout_s=60)
            print(f"edge restarted in {time.monotonic() - t0:.1f} s")
            for sb in sandboxes:
                if sb.refresh().edge_id == victim:
                    assert sb.run("echo still here").text.strip() == "still here"

            # The edge's actor killed (its Ray worker, the edge's parent): Ray starts the
            # actor again, which takes the edge over; the sandboxes answer.
            edge = services(deployment(w))[f"edge-{victim}"]
            os.kill(edge["actor_pid"], signal.SIGKILL)
            t0 = time.monotonic()

            def taken_over() -> bool:
                s = services(deployment(w))[f"edge-{victim}"]
                return s["actor_pid"] != edge["actor_pid"] and s["health"] == "SERVING"

            wait_for(taken_over, timeout_s=90)
            print(f"edge actor restarted, edge serving: {time.monotonic() - t0:.1f} s")
            for sb in sandboxes:
                if sb.refresh().edge_id == victim:
                    assert sb.run("echo taken over").text.strip() == "taken over"

            # The deployment actor killed: Ray starts it again; it finds its actors by name
            # and goes on watching the nodes (the join below needs that).
            dep_pid = deployment(w)["actor_pid"]
            os.kill(dep_pid, signal.SIGKILL)
            wait_for(lambda: _answers(w, dep_pid), timeout_s=90)
            r = dsec(w, "status")
            assert r.returncode == 0 and f"edge-{edge_ids[2]}" in r.stdout, r.stdout + r.stderr
            assert deployment(w)["created_at"] == st["created_at"]

            # A node joins: an edge starts there and takes creates.
            t0 = time.monotonic()
            w.ray.add_worker(r3)
            joined = f"edge-{edge_ids[3]}"
            wait_for(
                lambda: services(deployment(w)).get(joined, {}).get("health") == "SERVING",
                timeout_s=120,
            )
            print(f"node join -> edge healthy: {time.monotonic() - t0:.1f} s")
            sb = c.create(
                image="busybox", cpu=0.25, memory_mb=128, node_selector={"node": edge_ids[3]}
            )
            sandboxes.append(sb)
            assert sb.refresh().edge_id == edge_ids[3]
            assert sb.run("echo new node").text.strip() == "new node"
            assert sandbox_pids(w.node_dir)

            # That node leaves (everything on it killed; its sandbox stopped first, as
            # nothing could stop it later): its edge actor is dropped, the watcher stops
            # counting on that edge.
            sb.stop(grace_s=0.5)
            sandboxes.remove(sb)
            t0 = time.monotonic()
            r3.kill_all()
            wait_for(lambda: joined not in services(deployment(w)), timeout_s=60)
            print(f"node leave -> edge actor dropped: {time.monotonic() - t0:.1f} s")
            wait_for(lambda: edge_health(st, edge_ids[3]) != "EDGE_HEALTH_HEALTHY", timeout_s=30)
            assert any("left" in e for e in deployment(w)["events"])

            # Undeploy keeping the sandboxes: the services go, the sandboxes stay; the next
            # deploy's edges (same nodes, same ids) re-adopt them.
            kept = sandbox_pids(w.node_dir)
            r = dsec(w, "undeploy", "--ray", w.ray.client_address, "--keep-sandboxes")
            assert r.returncode == 0, r.stdout + r.stderr
            assert service_processes(w) == [] and kept <= sandbox_pids(w.node_dir)
            r = dsec(w, "deploy", "--ray", w.ray.client_address, *args)
            assert r.returncode == 0, r.stdout + r.stderr
            for sb in sandboxes:
                assert sb.refresh().state == "RUNNING"
                assert sb.run("echo re-adopted").text.strip() == "re-adopted"
    finally:
        os.environ.pop("DSEC_HOME", None)

    # Undeploy: no service process, no sandbox, the home forgets the deployment.
    pids = [s["pid"] for s in deployment(w)["services"] if s.get("pid")]
    t0 = time.monotonic()
    r = dsec(w, "undeploy", "--ray", w.ray.client_address)
    print(f"undeploy: {time.monotonic() - t0:.1f} s\n{r.stdout}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [p for p in pids if Path(f"/proc/{p}").exists()] == []
    assert service_processes(w) == []
    assert sandbox_pids(w.node_dir) == set()
    assert not (w.home / "cluster.json").exists() and not (w.home / "token").exists()
    r = dsec(w, "deploy", "--ray", w.ray.client_address, "--status", timeout=60)
    assert r.returncode != 0 and "NOT_DEPLOYED" in r.stderr, r.stderr
