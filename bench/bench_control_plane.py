"""Control-plane benchmarks (issue: Control plane at scale), on null-runtime edges:
the SDK, API server, placement, IAM (SQLite) and the edges' admission and
bookkeeping are all real processes; only the sandboxes' runtime is absent.

1. burst: 32,768 sandboxes in one create_many against 16 edges (creations/s),
   every item keyed (the SDK gives each create an idempotency key) and, to price
   the keys, without keys; the two alternate (keyed, unkeyed, unkeyed, keyed):
   a later burst meets a fuller cluster. Baseline in the same run: the same
   number admitted by the 16 edges alone (CreateSandboxes straight to each
   edge: no API server, placement or IAM).
2. unary: creates from 64 concurrent SDK clients (creations/s, latency), keyed
   and unkeyed, alternated the same way.
3. placement quality at the end of the burst: max/mean live sandboxes per edge
   (the watcher's counts) vs uniform random placement of the same number, in
   the same run.
4. quota exactness (exact, not a timing): clients racing in sibling subprojects
   never push any ancestor past its quota, and get exactly what it allows.

usage: python bench/bench_control_plane.py [--burst 32768] [--edges 16] [--clients 64]
                                           [--unary-s 4] [--apiservers 1] [--procs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

import libdsec.aio
import libdsec.options
from bench.common import cluster, pct, table
from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import AsyncClient, Client, Quota
from libdsec.errors import QuotaExceeded

SPEC = {"image": "busybox", "cpu": 0.1, "memory_mb": 64}
#: The order keyed and unkeyed runs alternate in (ABBA: each meets a fuller cluster once).
RUNS = (True, False, False, True)


@contextmanager
def keys(keyed: bool) -> Iterator[None]:
    """Creates as the SDK sends them (keyed: it gives every create without a key its own),
    or with no key at all (the SDK's key maker taken out), to price the keys."""
    if keyed:
        yield
        return
    made = libdsec.aio.new_idempotency_key, libdsec.options.new_idempotency_key
    libdsec.aio.new_idempotency_key = libdsec.options.new_idempotency_key = lambda: ""
    try:
        yield
    finally:
        libdsec.aio.new_idempotency_key, libdsec.options.new_idempotency_key = made


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cluster_cpu(c: LocalCluster) -> float:
    return sum(cpu_s(p.pid) for p in c.processes)


def burst(
    c: LocalCluster, token: str, n: int, task_id: str, keyed: bool
) -> tuple[float, float, int]:
    """(seconds, CPU seconds of every process, sandboxes created)."""
    with Client(c.apiserver, token=token, timeout=600) as cl, keys(keyed):
        cl.create_many(64, task_id="warmup", **SPEC)  # type: ignore[arg-type]
        cpu0 = cluster_cpu(c) + time.process_time()
        t0 = time.perf_counter()
        out = cl.create_many(n, task_id=task_id, **SPEC)  # type: ignore[arg-type]
        dt = time.perf_counter() - t0
        cpu = cluster_cpu(c) + time.process_time() - cpu0
    failed = [o for o in out if isinstance(o, Exception)]
    if failed:
        print(f"burst: {len(failed)} failed, e.g. {failed[0]!r}", flush=True)
    return dt, cpu, n - len(failed)


def edges_alone(c: LocalCluster, n: int) -> tuple[float, float]:
    """The baseline: the same number of sandboxes admitted by the edges directly."""
    from common.ids import new_sandbox_id
    from dsec.edge.v1 import edge_pb2, edge_pb2_grpc
    from dsec.types.v1 import types_pb2

    edges = [p for p in c.processes if p.name.startswith("edge-")]
    spec = types_pb2.SandboxSpec(
        backend=types_pb2.BACKEND_CONTAINER,
        image="busybox",
        resources=types_pb2.Resources(cpu_millis=100, memory_mb=64),
    )
    per_edge = n // len(edges)

    async def run() -> float:
        channels = [grpc.aio.insecure_channel(p.address) for p in edges]
        reqs = []
        for p in edges:
            edge_id = p.name.removeprefix("edge-")
            req = edge_pb2.CreateSandboxesRequest(
                project_id="root/baseline", principal_id="bench", wait_ready=True
            )
            g = req.groups.add()
            g.spec.CopyFrom(spec)
            g.sandbox_ids.extend(new_sandbox_id(edge_id) for _ in range(per_edge))
            reqs.append(req)
        t0 = time.perf_counter()
        await asyncio.gather(
            *(
                edge_pb2_grpc.EdgeServiceStub(ch).CreateSandboxes(r, timeout=120)
                for ch, r in zip(channels, reqs, strict=True)
            )
        )
        dt = time.perf_counter() - t0
        for ch in channels:
            await ch.close()
        return dt

    cpu0 = cluster_cpu(c) + time.process_time()
    dt = asyncio.run(run())
    return dt, cluster_cpu(c) + time.process_time() - cpu0


def placement_quality(
    c: LocalCluster, task_id: str, n: int, edges: int
) -> tuple[list[int], list[int]]:
    """Live sandboxes of a burst per edge from the watcher, and a uniform random placement."""
    from dsec.watcher.v1 import watcher_pb2, watcher_pb2_grpc

    deadline = time.monotonic() + 20
    with grpc.insecure_channel(c.process("watcher").address) as ch:
        stub = watcher_pb2_grpc.WatcherServiceStub(ch)
        while True:
            snap = stub.GetClusterSnapshot(watcher_pb2.GetClusterSnapshotRequest(), timeout=5)
            counts = [e.sandboxes_by_task.get(task_id, 0) for e in snap.snapshot.edges]
            if sum(counts) >= n or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    rng = random.Random()
    uniform = [0] * edges
    for _ in range(sum(counts)):
        uniform[rng.randrange(edges)] += 1
    return counts, uniform


def _unary_worker(
    targets: list[str],
    token: str,
    clients: int,
    duration_s: float,
    keyed: bool,
    start: Any,
    q: Any,
) -> None:
    import uvloop

    async def main() -> None:
        conns = [AsyncClient(targets[i % len(targets)], token=token) for i in range(clients)]
        for cl in conns:
            await cl.whoami()
            await cl.create(task_id="unary-warmup", **SPEC)  # type: ignore[arg-type]
        q.put("ready")
        start.wait()
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        stop_at = t0 + duration_s
        lat: list[float] = []
        errors = 0

        async def loop(cl: AsyncClient) -> None:
            nonlocal errors
            while time.perf_counter() < stop_at:
                t = time.perf_counter()
                try:
                    await cl.create(task_id="unary", **SPEC)  # type: ignore[arg-type]
                except Exception:
                    errors += 1
                    continue
                lat.append(time.perf_counter() - t)

        await asyncio.gather(*(loop(cl) for cl in conns))
        t1 = time.perf_counter()
        cpu = time.process_time() - cpu0
        for cl in conns:
            await cl.close()
        q.put((t0, t1, lat, errors, cpu))

    with keys(keyed):
        uvloop.run(main())


def unary(
    c: LocalCluster, token: str, clients: int, procs: int, duration_s: float, keyed: bool
) -> tuple[float, int, list[float], int, float]:
    """(seconds, creates, latencies, errors, CPU seconds of every process incl. clients)."""
    ctx = mp.get_context("spawn")
    targets = [p.address for p in c.processes if p.name.startswith("apiserver")]
    start = ctx.Event()
    q = ctx.Queue()
    workers = [
        ctx.Process(
            target=_unary_worker,
            args=(
                targets[i % len(targets) :] + targets[: i % len(targets)],
                token,
                clients // procs,
                duration_s,
                keyed,
                start,
                q,
            ),
        )
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    for _ in workers:
        assert q.get(timeout=120) == "ready"
    cpu0 = cluster_cpu(c)
    start.set()
    results = [q.get(timeout=duration_s + 120) for _ in workers]
    cpu = cluster_cpu(c) - cpu0 + sum(r[4] for r in results)
    for w in workers:
        w.join()
    t0 = min(r[0] for r in results)
    t1 = max(r[1] for r in results)
    lat = [x for r in results for x in r[2]]
    return t1 - t0, len(lat), lat, sum(r[3] for r in results), cpu


async def quota_race(c: LocalCluster, clients: int) -> list[object]:
    """Clients race in 4 sibling subprojects; every ancestor must end exactly at its limit."""
    parent_quota, sub_quota, subs, per_client = 300, 100, 4, 24
    with Client(c.apiserver, token=c.token) as admin:
        parent = admin.create_project("race", quota=Quota(sandboxes=parent_quota)).project_id
        tokens = []
        for i in range(subs):
            p = admin.create_project(f"s{i}", parent=parent, quota=Quota(sandboxes=sub_quota))
            tokens.append((p.project_id, admin.create_token("r", project=p.project_id).secret))
    created: list[str] = []
    refused_by: set[str] = set()

    async def client(i: int) -> None:
        _, token = tokens[i % subs]
        target = [p.address for p in c.processes if p.name.startswith("apiserver")]
        async with AsyncClient(target[i % len(target)], token=token) as cl:
            done = 0
            while done < per_client:
                if done % 8 == 4:
                    results: list[object] = list(
                        await cl.create_many(4, task_id="race", **SPEC)  # type: ignore[arg-type]
                    )
                    done += 4
                else:
                    try:
                        results = [await cl.create(task_id="race", **SPEC)]  # type: ignore[arg-type]
                    except QuotaExceeded as err:
                        results = [err]
                    done += 1
                for r in results:
                    if isinstance(r, QuotaExceeded):
                        refused_by.add(r.metadata["project"])
                    elif isinstance(r, Exception):
                        raise r
                    else:
                        created.append(r.id)  # type: ignore[attr-defined]

    await asyncio.gather(*(client(i) for i in range(clients)))
    with Client(c.apiserver, token=c.token) as admin:
        parent_usage = admin.get_project(parent).usage.sandboxes
        sub_usage = [admin.get_project(p).usage.sandboxes for p, _ in tokens]
    asked = clients * per_client
    exact = (
        len(created) == len(set(created)) == parent_quota == parent_usage == sum(sub_usage)
        and max(sub_usage) <= sub_quota
    )
    return [
        clients,
        f"{subs} x {sub_quota}",
        parent_quota,
        asked,
        len(created),
        parent_usage,
        max(sub_usage),
        ",".join(sorted(p.rsplit("/", 1)[-1] for p in refused_by)),
        "yes" if exact else "NO",
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--burst", type=int, default=32_768)
    ap.add_argument("--edges", type=int, default=16)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--procs", type=int, default=2, help="processes the unary clients run in")
    ap.add_argument("--unary-s", type=float, default=4.0)
    ap.add_argument("--apiservers", type=int, default=1)
    args = ap.parse_args()

    per_edge = (len(RUNS) + 1) * (args.burst // args.edges) + 20_000
    edges = [
        EdgeSpec(
            edge_id=f"n{i}",
            runtime="null",
            cpu_millis=per_edge * 100,
            memory_mb=per_edge * 64,
            max_sandboxes=per_edge,
        )
        for i in range(args.edges)
    ]
    print(
        f"{args.edges} null edges, {args.apiservers} API server(s), IAM on SQLite, "
        f"{os.cpu_count()} cores",
        flush=True,
    )
    with cluster(edges=edges, apiservers=args.apiservers) as c:
        with Client(c.apiserver, token=c.token) as admin:
            p = admin.create_project("bench", quota=Quota(sandboxes=10 * args.burst + 100_000))
            token = admin.create_token("bench", project=p.project_id, agent=True).secret

        bursts: dict[bool, list[tuple[float, float, int]]] = {True: [], False: []}
        for i, keyed in enumerate(RUNS):
            bursts[keyed].append(burst(c, token, args.burst, f"burst-{i}", keyed))
        first_n = bursts[RUNS[0]][0][2]
        counts, uniform = placement_quality(c, "burst-0", first_n, args.edges)
        e_s, e_cpu = edges_alone(c, args.burst)
        unaries: dict[bool, list[tuple[float, int, list[float], int, float]]] = {
            True: [],
            False: [],
        }
        for keyed in RUNS:
            unaries[keyed].append(unary(c, token, args.clients, args.procs, args.unary_s, keyed))
        rows: list[list[object]] = []
        for keyed in (True, False):
            how = "every item keyed (the SDK's keys)" if keyed else "no keys"
            runs = bursts[keyed]
            n = sum(r[2] for r in runs)
            s_ = sum(r[0] for r in runs)
            cpu = sum(r[1] for r in runs)
            rows.append(
                [
                    f"create_many burst -> {args.edges} edges, {how}",
                    n,
                    s_,
                    round(n / s_),
                    " / ".join(str(round(r[2] / r[0])) for r in runs),
                    ">= 20000" if keyed else "-",
                    cpu / max(n, 1) * 1000,
                ]
            )
        for keyed in (True, False):
            how = "every create keyed" if keyed else "no keys"
            u_runs = unaries[keyed]
            u_n = sum(r[1] for r in u_runs)
            u_s = sum(r[0] for r in u_runs)
            u_cpu = sum(r[4] for r in u_runs)
            errors = sum(r[3] for r in u_runs)
            rows.append(
                [
                    f"unary creates, {args.clients} SDK clients, {how} ({errors} errors)",
                    u_n,
                    u_s,
                    round(u_n / u_s),
                    " / ".join(str(round(r[1] / r[0])) for r in u_runs),
                    ">= 2000" if keyed else "-",
                    u_cpu / max(u_n, 1) * 1000,
                ]
            )
        rows.append(
            [
                f"baseline: the {args.edges} edges alone (CreateSandboxes, no control plane)",
                args.burst,
                e_s,
                round(args.burst / e_s),
                "-",
                "-",
                e_cpu / args.burst * 1000,
            ]
        )
        table(
            "creation throughput (null runtime; SDK, API server, placement, IAM; "
            "CPU = all processes, clients included; runs alternate keyed, unkeyed, "
            "unkeyed, keyed)",
            ["path", "sandboxes", "seconds", "creations/s", "each run", "target", "CPU ms/create"],
            rows,
        )
        latencies = {k: [x for r in unaries[k] for x in r[2]] for k in (True, False)}
        table(
            "unary create latency (ms)",
            ["creates", "clients", "p50", "p90", "p99", "max"],
            [
                [
                    "keyed" if keyed else "no keys",
                    args.clients,
                    pct(lat, 50) * 1000,
                    pct(lat, 90) * 1000,
                    pct(lat, 99) * 1000,
                    max(lat) * 1000,
                ]
                for keyed, lat in latencies.items()
            ],
        )
        mean = sum(counts) / len(counts)
        umean = sum(uniform) / len(uniform)
        table(
            f"placement quality at the end of the first burst ({sum(counts)} sandboxes, "
            f"{args.edges} edges)",
            ["placement", "max/mean", "min/mean", "max", "min", "target"],
            [
                [
                    "dsec: power-of-2 + overlay (watcher's counts)",
                    max(counts) / mean,
                    min(counts) / mean,
                    max(counts),
                    min(counts),
                    "<= 1.2",
                ],
                [
                    "baseline: uniform random (same run)",
                    max(uniform) / umean,
                    min(uniform) / umean,
                    max(uniform),
                    min(uniform),
                    "-",
                ],
            ],
        )
        row = asyncio.run(quota_race(c, 32))
        table(
            "quota exactness: clients racing in sibling subprojects (unary + create_many)",
            [
                "clients",
                "subprojects",
                "parent quota",
                "asked",
                "created",
                "parent usage",
                "max sub usage",
                "refused by",
                "exact",
            ],
            [row],
        )
        return 0 if row[-1] == "yes" else 1


if __name__ == "__main__":
    sys.exit(main())
