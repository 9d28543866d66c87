"""Several nodes, same run (issue 35): what one more node buys, what the shared store saves,
and how long a lost node takes to be written off.

Every node is a lab host on this machine (tests/multinode/lab.py: network namespaces, an edge
each, IAM on PostgreSQL, two API servers, placement and the watcher on hosts of their own,
the layer store on MooseFS). All of them share this machine's 2 cores, so more nodes cannot
create faster here: the first table shows what the cluster costs (the control plane's share of
the CPU) and that spreading over nodes keeps latency flat, not a speed-up a real cluster of
machines would show.

1. Creates: ``--creates`` sandboxes by ``--workers`` threads (create, then the first command,
   ``true``), on 1, 2 and 4 nodes: throughput, create -> first command p50/p99, and the CPU
   seconds spent by the control plane (IAM, watcher, placement, API servers) and the edges.
2. A burst of ``--burst`` sandboxes of a ``--image-mb`` image across 4 nodes: every node reads
   the image from the shared store (``verify=store``: hashed once, at import), against the
   same image imported into each node's own local store first (the copy included in its
   time). Bytes read from the store (the MooseFS clients' reads) and bytes written on the
   nodes' disks (layer stores and metadata caches).
3. A node lost (every process of it killed, its link cut): seconds until its sandboxes are
   reported EDGE_LOST and their quota released, with the watcher's gone rule
   (``--gone-after-s``) printed beside it.

usage: python bench/bench_cluster.py [--creates 48] [--workers 4] [--burst 64] [--image-mb 1024]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import IMAGES, pct, table
from libdsec.errors import DSecError
from tests.multinode.lab import MultiNode, multinode_cluster

CONTROL = ("iam", "watcher", "placement", "apiserver", "apiserver1", "compat")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its waited-for children (runc, mounts)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def cpu_by_role(m: MultiNode) -> dict[str, float]:
    out = {"control plane": 0.0, "edges": 0.0}
    for p in m.cluster.processes:
        if not p.pid:
            continue
        role = "edges" if p.module == "edge" else "control plane" if p.name in CONTROL else ""
        if role:
            try:
                out[role] += cpu_s(p.pid)
            except OSError:
                pass
    return out


def creates(m: MultiNode, n: int, workers: int) -> tuple[float, list[float], dict[str, float]]:
    lat: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    made = []
    todo = iter(range(n))

    def work() -> None:
        with m.client() as c:
            while True:
                with lock:
                    if next(todo, None) is None:
                        return
                t = time.monotonic()
                try:
                    sb = c.create(image="busybox", memory_mb=64, cpu=0.1)
                    sb.run("true")
                except Exception as exc:  # counted, reported
                    with lock:
                        errors.append(repr(exc))
                    continue
                with lock:
                    lat.append(time.monotonic() - t)
                    made.append(sb.id)

    cpu0 = cpu_by_role(m)
    t0 = time.monotonic()
    threads = [threading.Thread(target=work) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    cpu1 = cpu_by_role(m)
    with m.client() as c:
        for sid in made:
            c.get(sid).stop()
    if errors:
        print(f"  {len(errors)} failed creates, e.g. {errors[0]}")
    return wall, lat, {k: cpu1[k] - cpu0[k] for k in cpu0}


def make_image(root: Path, mb: int) -> Path:
    """A workspace of ``mb`` MiB: one big file nobody reads, a few small ones."""
    root.mkdir(parents=True)
    (root / "task.txt").write_text("fix the bug\n")
    with open(root / "weights.bin", "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))
    return root


def du(path: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def burst(m: MultiNode, src: Path, n: int, shared: bool) -> dict[str, float]:
    local0 = sum(du(m.state_dir(x)) for x in m.nodes)
    reads0 = sum(m.fs.client_read_bytes(m.store[x]) for x in m.nodes) if shared else 0
    t0 = time.monotonic()
    if shared:
        with m.client() as c:
            c.import_image(f"dir:{src}", "bench-ws:v1", base="busybox")
    else:
        # No shared file system: the image goes into every node's own store first.
        for x in m.nodes:
            tool = [sys.executable, "-m", "edge.layers", "--store", str(m.store[x]),
                    "--cache", str(m.state_dir(x) / "import-cache"), "--node", x,
                    "--image-dir", str(IMAGES)]  # fmt: skip
            subprocess.run([*tool, "import-base", "busybox"], check=True, capture_output=True)
            subprocess.run(
                [*tool, "import", f"dir:{src}", "--name", "bench-ws:v1", "--base", "busybox"],
                check=True,
                capture_output=True,
            )
    t_import = time.monotonic() - t0
    if shared:  # what the import itself moved is not the burst's
        reads0 = sum(m.fs.client_read_bytes(m.store[x]) for x in m.nodes)
    t1 = time.monotonic()
    with m.client() as c:
        made = c.create_many(n, image="bench-ws:v1", memory_mb=64, cpu=0.1)
        ok = [s for s in made if not isinstance(s, Exception)]
        for s in ok:
            assert s.run("cat /task.txt").exit_code == 0
        t_burst = time.monotonic() - t1
        nodes = {s.info.edge_id for s in ok}
        for s in ok:
            s.stop()
    reads = sum(m.fs.client_read_bytes(m.store[x]) for x in m.nodes) - reads0 if shared else 0
    local = sum(du(m.state_dir(x)) for x in m.nodes) - local0
    if not shared:
        local += sum(du(m.store[x]) for x in m.nodes)
    return {
        "import_s": t_import,
        "burst_s": t_burst,
        "ok": len(ok),
        "nodes": len(nodes),
        "store_read_mb": reads / 1e6,
        "local_mb": local / 1e6,
    }


def node_loss(m: MultiNode, per_node: int = 4) -> float:
    lost = m.nodes[-1]
    with m.client() as c:
        sbs = [
            c.create(image="busybox", memory_mb=64, node_selector={"node": lost})
            for _ in range(per_node)
        ]
        usage = c.get_project().usage.sandboxes
        time.sleep(3)  # the watcher's poll (2 s) has seen them
        m.host(lost).kill_all()
        m.host(lost).link_down()
        t0 = time.monotonic()
        while True:
            try:
                reasons = [c.get(s.id).info.termination_reason for s in sbs]
            except DSecError as err:  # not declared lost yet: its edge does not answer
                reasons = [repr(err)]
            held = c.get_project().usage.sandboxes
            if reasons == ["EDGE_LOST"] * per_node and held <= usage - per_node:
                return time.monotonic() - t0
            if time.monotonic() - t0 > 600:
                raise TimeoutError(f"node loss not reported in 600 s: {reasons}, usage {held}")
            time.sleep(0.25)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--creates", type=int, default=48)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--image-mb", type=int, default=1024)
    ap.add_argument("--gone-after-s", type=float, default=30.0)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: creates,burst,loss")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    with tempfile.TemporaryDirectory(prefix="dsec-bench-cluster-") as tmp:
        root = Path(tmp)
        if "creates" not in skip:
            rows: list[list[object]] = []
            for nodes in (1, 2, 4):
                with multinode_cluster(root / f"c{nodes}", nodes=nodes, log_level="WARNING") as m:
                    creates(m, 4, 2)  # warm: the base image's first use on each node
                    wall, lat, cpu = creates(m, args.creates, args.workers)
                    total = cpu["control plane"] + cpu["edges"]
                    rows.append([
                        nodes, len(lat), len(lat) / wall, pct(lat, 50) * 1000,
                        pct(lat, 99) * 1000, cpu["control plane"], cpu["edges"],
                        f"{100 * cpu['control plane'] / total:.0f}%" if total else "-",
                    ])  # fmt: skip
            table(
                f"creates -> first command ({args.workers} threads), all nodes on this machine's "
                f"{os.cpu_count()} cores",
                ["nodes", "ok", "per s", "p50 ms", "p99 ms", "control CPU s", "edges CPU s",
                 "control share"],
                rows,
            )  # fmt: skip
        if "burst" not in skip:
            src = make_image(root / "image", args.image_mb)
            rows = []
            for shared in (True, False):
                name = "shared store (MooseFS)" if shared else "copied to each node"
                with multinode_cluster(
                    root / f"b{int(shared)}", nodes=4, shared_store=shared, log_level="WARNING"
                ) as m:
                    r = burst(m, src, args.burst, shared)
                rows.append([
                    name, r["ok"], r["nodes"], r["import_s"], r["burst_s"],
                    r["import_s"] + r["burst_s"], r["store_read_mb"], r["local_mb"],
                ])  # fmt: skip
            table(
                f"burst of {args.burst} sandboxes of a {args.image_mb} MiB image over 4 nodes",
                ["image", "ok", "nodes", "import/copy s", "burst s", "total s",
                 "read from store MB", "written on nodes MB"],
                rows,
            )  # fmt: skip
        if "loss" not in skip:
            env = {
                "RELEASE_GONE_AFTER_S": str(args.gone_after_s),
                "UNHEALTHY_AFTER": "3",
                "RECONCILE_GRACE_S": "5",
            }
            with multinode_cluster(root / "loss", env, nodes=3, log_level="WARNING") as m:
                took = node_loss(m)
            table(
                "a node lost (kill -9 + link down) -> its sandboxes EDGE_LOST, quota released",
                ["gone rule s", "reported after s"],
                [[args.gone_after_s, took]],
            )  # fmt: skip


if __name__ == "__main__":
    main()
