"""Container sandbox benchmarks (issue: Container sandboxes), with Docker baselines
measured in the same run on the same busybox image.

1. create-to-first-command latency over N sandboxes (sequential): dsec create + run("true")
   vs `docker run -d` + `docker exec true`.
2. run("true") round trip through SDK -> apiserver -> edge -> aether -> chronus, interleaved
   with get() and files.stat() on the same path as same-run baselines.
3. burst: B sandboxes created concurrently (create_many) vs B concurrent `docker run -d`.
4. memory: PSS of aether + chronus per idle sandbox with B idle sandboxes (no per-sandbox host
   process exists: runc exits after start).
5. create-to-first-command again with the B burst sandboxes still running, against section 1's
   idle-node figure of the same run.
6. create-to-first-command on a second edge of the same machine that keeps W warm sandboxes
   (edge/backends/warm.py, DSEC_EDGE_WARM_POOL), against section 1 (cold) and Docker.
7. a burst of B on that edge (W of them warm at the start, the rest cold), against section 3.
8. the cost of the writable-layer limit every sandbox has (template copy + loop + mount + unmount of
   the default 10 GiB sparse image, from a template formatted once), measured directly, against section 1.

Sections 1-5 run on the cold edge (node_selector pool=cold) while the warm edge sits idle
with its pool full; 6-7 on the warm edge.

usage: python bench/bench_containers.py [--n 50] [--burst 200] [--warm 64] [--no-docker]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import cluster, descendants, docker_available, pct, pss_kb, summary_ms, table
from dsecctl.cluster import EdgeSpec
from libdsec import AsyncClient, Client

IMAGE = "busybox"
DOCKER_IMAGE = "dsec/busybox:latest"


def docker_create_exec(n: int) -> list[float]:
    out = []
    ids = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            cid = subprocess.run(
                ["docker", "run", "-d", "--network", "none", DOCKER_IMAGE, "sleep", "600"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            subprocess.run(["docker", "exec", cid, "true"], check=True, capture_output=True)
            out.append(time.perf_counter() - t)
            ids.append(cid)
    finally:
        docker_rm(ids)
    return out


def docker_rm(ids: list[str]) -> None:
    for i in range(0, len(ids), 50):
        subprocess.run(["docker", "rm", "-f", *ids[i : i + 50]], capture_output=True)


def docker_burst(n: int) -> float:
    def one(_: int) -> str:
        return subprocess.run(
            ["docker", "run", "-d", "--network", "none", DOCKER_IMAGE, "sleep", "600"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(n, 64)) as pool:
        ids = list(pool.map(one, range(n)))
    elapsed = time.perf_counter() - t
    docker_rm(ids)
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--burst", type=int, default=200)
    ap.add_argument("--rtt", type=int, default=500)
    ap.add_argument("--warm", type=int, default=64, help="warm sandboxes of the warm edge")
    ap.add_argument("--no-docker", action="store_true")
    args = ap.parse_args()
    use_docker = not args.no_docker and docker_available()

    env = {"DSEC_EDGE_CPU_OVERCOMMIT": "200", "DSEC_EDGE_FNCALL_POOLS": ""}
    cold_edge = EdgeSpec(
        edge_id="bench",
        runtime="container",
        labels={"pool": "cold"},
        max_sandboxes=args.burst + 50,
        extra_env=env,
    )
    # The same machine, with warm sandboxes of the image (edge/backends/warm.py): sections 6 and 7.
    warm_edge = EdgeSpec(
        edge_id="warm",
        runtime="container",
        labels={"pool": "warm"},
        max_sandboxes=args.burst + 50,
        extra_env={**env, "DSEC_EDGE_WARM_POOL": f"{IMAGE}={args.warm}"},
    )
    with cluster(edges=[cold_edge, warm_edge]) as c, Client(c.apiserver, token=c.token) as dsec:
        # toolkit built, image mounted on both edges
        dsec.create(image=IMAGE, cpu=1, memory_mb=64, node_selector=COLD).stop()
        dsec.create(image=IMAGE, cpu=1, memory_mb=64, node_selector=WARM).stop()
        wait_warm(c, args.warm)  # the warm edge's refill idle before anything is measured

        # 1. create -> first command
        lat = create_first(dsec, args.n)
        d_lat = docker_create_exec(args.n) if use_docker else []
        p50, p99, _ = summary_ms(lat)
        p50_idle, p99_idle = p50, p99
        dp50, dp99, _ = summary_ms(d_lat)
        table(
            f"create -> first command, {args.n} sandboxes (ms)",
            ["system", "p50", "p99", "p50 ratio"],
            [
                ["dsec (runc + aether)", p50, p99, 1.0],
                *([["docker run -d + exec", dp50, dp99, dp50 / p50]] if d_lat else []),
            ],
        )

        # 2. run("true") round trip, interleaved with two same-run baselines on the same path:
        #    GetSandbox (SDK -> apiserver -> edge) and files.stat (... -> aether -> chronus, no
        #    process started), so machine noise shows in all three alike.
        sb = dsec.create(image=IMAGE, cpu=1, memory_mb=64, node_selector=COLD)
        for _ in range(20):
            assert sb.run("true").exit_code == 0
        rtt: list[float] = []
        get: list[float] = []
        stat: list[float] = []
        for _ in range(args.rtt):
            t = time.perf_counter()
            r = sb.run("true")
            rtt.append(time.perf_counter() - t)
            assert r.exit_code == 0, r
            t = time.perf_counter()
            dsec.get(sb.id)
            get.append(time.perf_counter() - t)
            t = time.perf_counter()
            sb.files.stat("/")
            stat.append(time.perf_counter() - t)
        sb.stop(grace_s=0)
        p50, p99, mean = summary_ms(rtt)
        g50, g99, gmean = summary_ms(get)
        s50, s99, smean = summary_ms(stat)
        table(
            f'run("true") round trip, {args.rtt} calls each, interleaved (ms)',
            ["call", "p50", "p99", "mean"],
            [
                ['run("true"): SDK -> apiserver -> edge -> aether -> chronus', p50, p99, mean],
                ["baseline: files.stat('/') (same path, no process)", s50, s99, smean],
                ["baseline: get() (SDK -> apiserver -> edge)", g50, g99, gmean],
            ],
        )

        # 3. burst
        async def burst(task: str, sel: dict[str, str]) -> tuple[float, list[str], int]:
            async with AsyncClient(c.apiserver, token=c.token) as ac:
                t = time.perf_counter()
                res = await ac.create_many(
                    args.burst, image=IMAGE, cpu=1, memory_mb=32, task_id=task, node_selector=sel
                )
                elapsed = time.perf_counter() - t
                ok = [r.id for r in res if not isinstance(r, Exception)]
                return elapsed, ok, len(res) - len(ok)

        elapsed, ids, failed = asyncio.run(burst("burst", COLD))
        d_elapsed = docker_burst(args.burst) if use_docker else float("nan")
        table(
            f"burst of {args.burst} concurrent creates",
            ["system", "seconds", "sandboxes/s", "failed"],
            [
                ["dsec create_many", elapsed, len(ids) / elapsed, failed],
                *(
                    [["docker run -d x" + str(args.burst), d_elapsed, args.burst / d_elapsed, 0]]
                    if use_docker
                    else []
                ),
            ],
        )

        # 4. memory of idle sandboxes (the burst's, all RUNNING and idle)
        runc_root = Path(c.home) / "edges" / "bench" / "container" / "runtime" / "runc"
        pids = []
        for sid in ids:
            st = subprocess.run(
                ["runc", "--root", str(runc_root), "state", sid], capture_output=True, text=True
            )
            if st.returncode == 0:
                import json

                pids.append(json.loads(st.stdout)["pid"])
        time.sleep(2)
        per_sandbox = []
        for pid in pids:
            total_pss = total_uss = 0
            for p in descendants(pid):
                try:
                    pss, uss = pss_kb(p)
                except OSError:
                    continue
                total_pss += pss
                total_uss += uss
            per_sandbox.append((total_pss, total_uss))
        if per_sandbox:
            mean_pss = sum(p for p, _ in per_sandbox) / len(per_sandbox) / 1024
            mean_uss = sum(u for _, u in per_sandbox) / len(per_sandbox) / 1024
            table(
                f"memory per idle sandbox, {len(per_sandbox)} running (MB)",
                ["measure", "mean", "p99"],
                [
                    ["PSS aether+chronus", mean_pss, pct([p / 1024 for p, _ in per_sandbox], 99)],
                    ["USS aether+chronus", mean_uss, pct([u / 1024 for _, u in per_sandbox], 99)],
                    ["per-sandbox host processes", 0.0, 0.0],
                ],
            )

        # 5. create -> first command again, now with the burst's sandboxes running: what a
        #    busy node's creates cost (the host's mount table and cgroup tree hold them all).
        busy = create_first(dsec, min(args.n, 30))
        b50, b99, _ = summary_ms(busy)
        table(
            f"create -> first command with {len(ids)} sandboxes running (ms)",
            ["node", "p50", "p99", "p50 vs idle node"],
            [
                ["idle node (section 1)", p50_idle, p99_idle, 1.0],
                [f"{len(ids)} sandboxes running", b50, b99, b50 / p50_idle],
            ],
        )
        dsec.stop_all(task_id="burst")

        # 6. the same with warm sandboxes: create -> first command claims one
        wait_runc_empty(c, "bench")  # the cold edge's burst torn down: nothing else runs
        wait_warm(c, args.warm)
        w_lat = create_first(dsec, args.n, WARM)
        w50, w99, _ = summary_ms(w_lat)
        table(
            f"create -> first command, {args.n} sandboxes, an edge keeping {args.warm} warm (ms)",
            ["system", "p50", "p99", "p50 vs cold (section 1)"]
            + (["docker p50 / p50"] if d_lat else []),
            [
                ["dsec cold (section 1)", p50_idle, p99_idle, 1.0]
                + ([dp50 / p50_idle] if d_lat else []),
                ["dsec warm", w50, w99, w50 / p50_idle] + ([dp50 / w50] if d_lat else []),
            ],
        )

        # 7. a burst larger than the pool: the first `warm` claim, the rest start cold
        wait_warm(c, args.warm)
        w_elapsed, w_ids, w_failed = asyncio.run(burst("wburst", WARM))
        table(
            f"burst of {args.burst} concurrent creates, {args.warm} of them warm at the start",
            ["system", "seconds", "sandboxes/s", "failed", "vs cold burst (section 3)"],
            [
                ["dsec cold edge (section 3)", elapsed, len(ids) / elapsed, failed, 1.0],
                [
                    f"dsec edge keeping {args.warm} warm",
                    w_elapsed,
                    len(w_ids) / w_elapsed,
                    w_failed,
                    (len(w_ids) / w_elapsed) / (len(ids) / elapsed),
                ],
            ],
        )
        dsec.stop_all(task_id="wburst")

    # 8. what the writable-layer limit every sandbox now has costs a create: its filesystem
    #    made and mounted (sparse copy of a formatted template, loop device, mount) and unmounted, measured
    #    directly, against section 1's whole create-to-first-command of the same run.
    made = _disk_limit_ms(args.n)
    d50, d99, _ = summary_ms(made)
    table(
        "the disk limit's share of a create (default 10 GiB image: template copy + loop device + mount + umount)",
        ["what", "p50 ms", "p99 ms", "share of a cold create p50 (section 1)"],
        [
            ["dsec cold create + first command (section 1)", p50_idle, p99_idle, 1.0],
            ["disk limit: make + mount + unmount", d50, d99, d50 / p50_idle],
        ],
    )
    return 0


def _disk_limit_ms(n: int, size_mb: int = 10240) -> list[float]:
    import tempfile

    from edge.runtime import disk
    from edge.runtime.mounts import umount_quiet

    out = []
    with tempfile.TemporaryDirectory(prefix="dsec-bench-disk-") as tmp:
        for i in range(n):
            d = Path(tmp) / str(i)
            d.mkdir()
            t = time.perf_counter()
            disk.create(d, size_mb)
            umount_quiet(d / "disk")
            out.append(time.perf_counter() - t)
            (d / "disk.img").unlink()
    return out


COLD = {"pool": "cold"}
WARM = {"pool": "warm"}


def _runc_ids(c: object, edge: str) -> list[str]:
    home = Path(c.home)  # type: ignore[attr-defined]
    root = home / "edges" / edge / "container" / "runtime" / "runc"
    out = subprocess.run(
        ["runc", "--root", str(root), "list", "-q"], capture_output=True, text=True
    )
    return out.stdout.split()


def wait_runc_empty(c: object, edge: str, timeout_s: float = 120.0) -> None:
    """Until `edge` runs no container (a stop_all's teardown continues after it returns)."""
    deadline = time.monotonic() + timeout_s
    while _runc_ids(c, edge) and time.monotonic() < deadline:
        time.sleep(0.2)


def wait_warm(c: object, n: int, timeout_s: float = 120.0) -> None:
    """Until the warm edge holds `n` warm sandboxes (its runc root lists them)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(1 for i in _runc_ids(c, "warm") if i.startswith("warm-")) >= n:
            time.sleep(0.6)  # past the pool's quiet period: its refill loop is idle
            return
        time.sleep(0.2)
    raise RuntimeError(f"the warm edge did not reach {n} warm sandboxes in {timeout_s} s")


def create_first(dsec: Client, n: int, sel: dict[str, str] = COLD) -> list[float]:
    """Sequential create + run("true") + stop; the time of the first two."""
    lat: list[float] = []
    for _ in range(n):
        t = time.perf_counter()
        sb = dsec.create(image=IMAGE, cpu=1, memory_mb=64, node_selector=sel)
        r = sb.run("true")
        lat.append(time.perf_counter() - t)
        assert r.exit_code == 0, r  # a failed start is not a fast one
        sb.stop(grace_s=0)
    return lat


if __name__ == "__main__":
    sys.exit(main())
