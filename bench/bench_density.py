"""Density benchmark (issue 17): N idle container sandboxes on one node, each answering a command.

The node fills in steps (0, N/4, N/2, 3N/4, N running); at each step, with everything idle:

1. create -> first command latency: --probes sequential creates + run("true") + stop on the node
   as it is, against the same measured on the empty node at the start of this run (the
   baseline; the issue's target: within 1.5x at 1,000 running);
2. the edge's CPU while idle (its process's CPU time over --idle-s), and that of every sandbox
   together (their cpuacct cgroups);
   with the number of mounts in the edge's mount table (runc's, which each start reads and
   copies: issue 43 keeps it from growing with the sandbox count);
3. memory per sandbox: PSS (the sum of /proc/<pid>/smaps_rollup Pss over each sandbox's
   processes, from its cgroup; target <= 8 MB), its memory cgroup's charge (page cache and kernel
   memory included), and the host's MemAvailable drop since the start over the sandboxes added;
4. the fill rate of the step (create_many of --batch, then a command in each).

Every sandbox is stopped and the cluster taken down at the end, also on failure or Ctrl-C;
leftovers (containers, mounts under the cluster's home) are reported.

usage: python bench/bench_density.py [--count 1000] [--probes 20] [--idle-s 30] [--batch 50]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import pct, pss_kb, summary_ms, table
from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import AsyncClient, Client

IMAGE = "busybox"
EDGE = "dens"
TASK = "density"
#: Idle sandboxes ask for little; the edge is told to admit --count of them (its cpu overcommit
#: and sandbox limit raised for the bench; memory at its default: 32 MB x 1,000 fits 1.5x RAM).
SHAPE = {"image": IMAGE, "cpu": 0.25, "memory_mb": 32}
_HZ = os.sysconf("SC_CLK_TCK")


def mem_available_kb() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        st = fh.read()
    f = st[st.rindex(")") + 2 :].split()
    return int(f[11]) + int(f[12])


def cgroup_file(controller: str, parent: str, name: str, sandbox_id: str = "") -> Path:
    return Path("/sys/fs/cgroup") / controller / parent / sandbox_id / name


def sandbox_memory(parent: str, ids: list[str]) -> tuple[list[float], list[float]]:
    """Per sandbox: PSS of its processes (MB) and its memory cgroup's usage (MB)."""
    pss, charged = [], []
    for sid in ids:
        try:
            procs = cgroup_file("pids", parent, "cgroup.procs", sid).read_text().split()
            usage = int(cgroup_file("memory", parent, "memory.usage_in_bytes", sid).read_text())
        except FileNotFoundError:
            continue
        total = 0
        for p in procs:
            try:
                total += pss_kb(int(p))[0]
            except OSError:
                pass
        pss.append(total / 1024)
        charged.append(usage / (1 << 20))
    return pss, charged


def probe(dsec: Client, n: int) -> list[float]:
    """Sequential create + run("true") + stop; the time of the first two."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        sb = dsec.create(**SHAPE, task_id="probe")  # type: ignore[arg-type]
        r = sb.run("true")
        out.append(time.perf_counter() - t)
        assert r.exit_code == 0, r
        sb.stop(grace_s=0)
    return out


async def fill(c: LocalCluster, count: int, batch: int) -> list[str]:
    """`count` more sandboxes, `batch` per create_many, each then answering a command."""
    ids: list[str] = []
    async with AsyncClient(c.apiserver, token=c.token, timeout=600) as ac:
        while len(ids) < count:
            made = await ac.create_many(min(batch, count - len(ids)), **SHAPE, task_id=TASK)  # type: ignore[arg-type]
            failed = [m for m in made if isinstance(m, Exception)]
            if failed:
                raise RuntimeError(f"{len(failed)} creates failed, first: {failed[0]!r}")
            results = await asyncio.gather(*(sb.run("echo ok") for sb in made))  # type: ignore[union-attr]
            bad = [r for r in results if r.text != "ok\n"]
            if bad:
                raise RuntimeError(f"{len(bad)} sandboxes did not answer: {bad[0]!r}")
            ids += [sb.id for sb in made]  # type: ignore[union-attr]
    return ids


async def answer_all(c: LocalCluster, ids: list[str]) -> int:
    """How many of `ids` answer a command now (64 at a time)."""
    sem = asyncio.Semaphore(64)
    async with AsyncClient(c.apiserver, token=c.token, timeout=600) as ac:

        async def one(sid: str) -> bool:
            async with sem:
                sb = await ac.get(sid)
                return (await sb.run("echo ok")).text == "ok\n"

        return sum(await asyncio.gather(*(one(s) for s in ids)))


@contextmanager
def density_cluster(count: int, edge_env: dict[str, str] | None = None) -> Iterator[LocalCluster]:
    """A private cluster whose edge admits `count` + probes; on the way out every sandbox is
    stopped (and waited for) before the services are, whatever happened."""
    edge = EdgeSpec(
        edge_id=EDGE,
        runtime="container",
        max_sandboxes=count + 16,
        extra_env={"DSEC_EDGE_FNCALL_POOLS": "", "DSEC_EDGE_CPU_OVERCOMMIT": "200"},
    )
    edge.extra_env.update(edge_env or {})
    with tempfile.TemporaryDirectory(prefix="dsec-bench-dens-") as home:
        c = LocalCluster(Path(home), transport="unix", edges=[edge], log_level="WARNING")
        c.start(timeout_s=120)
        try:
            yield c
        finally:
            try:
                teardown(c)
            finally:
                c.stop(grace_s=300)
                leftovers(c)


def runc_ids(c: LocalCluster) -> list[str]:
    root = c.home / "edges" / EDGE / "container" / "runtime" / "runc"
    out = subprocess.run(
        ["runc", "--root", str(root), "list", "-q"], capture_output=True, text=True
    )
    return out.stdout.split()


def teardown(c: LocalCluster, timeout_s: float = 600.0) -> None:
    """Every sandbox of the bench stopped, and gone from runc."""
    t = time.perf_counter()
    with Client(c.apiserver, token=c.token, timeout=timeout_s) as dsec:
        for task in (TASK, "probe"):
            try:
                dsec.stop_all(task_id=task, timeout=timeout_s)
            except Exception as exc:  # the edge's own shutdown (on_shutdown=stop) is next
                print(f"teardown: stop_all({task}) failed: {exc!r}", flush=True)
    deadline = time.monotonic() + timeout_s
    while runc_ids(c) and time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"teardown: every sandbox stopped in {time.perf_counter() - t:.1f} s", flush=True)


def mount_count(pid: int) -> int:
    """Mounts in process `pid`'s mount table: what runc reads and copies at every start."""
    with open(f"/proc/{pid}/mountinfo") as fh:
        return sum(1 for _ in fh)


def leftovers(c: LocalCluster) -> None:
    home = str(c.home.resolve()) + "/"
    with open("/proc/self/mountinfo") as fh:
        mounts = [line.split()[4] for line in fh if line.split()[4].startswith(home)]
    left = runc_ids(c)
    if mounts or left:
        print(f"LEFTOVERS: {len(left)} containers, {len(mounts)} mounts under {home}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=4, help="measurement points after 0")
    ap.add_argument("--probes", type=int, default=20, help="creates measured per point")
    ap.add_argument("--idle-s", type=float, default=30.0, help="idle CPU window per point")
    ap.add_argument("--batch", type=int, default=50, help="creates per create_many call")
    ap.add_argument(
        "--edge-env", action="append", default=[], help="NAME=VALUE for the edge (experiments)"
    )
    args = ap.parse_args()
    edge_env = dict(kv.partition("=")[::2] for kv in args.edge_env)

    rows_latency: list[list[object]] = []
    rows_cpu: list[list[object]] = []
    rows_mem: list[list[object]] = []
    rows_fill: list[list[object]] = []
    with (
        density_cluster(args.count, edge_env) as c,
        Client(c.apiserver, token=c.token, timeout=600) as dsec,
    ):
        edge_pid = c.process(f"edge-{EDGE}").pid
        parent = c.process(f"edge-{EDGE}").env["DSEC_EDGE_CGROUP_PARENT"]
        probe(dsec, 3)  # toolkit built, image mounted, templates made: none of it is measured
        mem0 = mem_available_kb()
        ids: list[str] = []
        base50 = float("nan")
        targets = [round(args.count * i / args.steps) for i in range(args.steps + 1)]
        for target in targets:
            if target > len(ids):
                t = time.perf_counter()
                before = len(ids)
                ids += asyncio.run(fill(c, target - len(ids), args.batch))
                elapsed = time.perf_counter() - t
                rows_fill.append(
                    [f"{before} -> {len(ids)}", elapsed, (len(ids) - before) / elapsed]
                )
            time.sleep(2)  # the last starts' background work (cgroup2 moves, logs) settles
            lat = probe(dsec, args.probes)
            p50, _, _ = summary_ms(lat)
            base50 = p50 if target == 0 else base50
            rows_latency.append(
                [
                    len(ids),
                    p50,
                    pct([v * 1000 for v in lat], 95),
                    p50 / base50,
                    mount_count(edge_pid),
                ]
            )
            # idle: nothing is asked of any sandbox during the window
            usage0 = int(cgroup_file("cpuacct", parent, "cpuacct.usage").read_text())
            ticks0, t0 = cpu_ticks(edge_pid), time.monotonic()
            time.sleep(args.idle_s)
            wall = time.monotonic() - t0
            edge_cpu = (cpu_ticks(edge_pid) - ticks0) / _HZ / wall * 100
            usage = int(cgroup_file("cpuacct", parent, "cpuacct.usage").read_text()) - usage0
            rows_cpu.append([len(ids), edge_cpu, usage / 1e9 / wall * 100])
            if ids:
                pss, charged = sandbox_memory(parent, ids)
                drop = (mem0 - mem_available_kb()) / 1024 / len(ids)
                rows_mem.append(
                    [
                        len(ids),
                        sum(pss) / len(pss),
                        pct(pss, 99),
                        sum(charged) / len(charged),
                        drop,
                    ]
                )
            print(f"{len(ids)} running: create->first command p50 {p50:.1f} ms", flush=True)
        answered = asyncio.run(answer_all(c, ids))
        print(f"{answered}/{len(ids)} sandboxes answer a command at the end", flush=True)

    table(
        "create -> first command as the node fills (ms; --probes sequential creates per point)",
        ["running", "p50", "p95", "p50 vs empty node", "mounts (edge's table)"],
        rows_latency,
    )
    table(
        f"CPU while idle (% of one core over {args.idle_s:g} s)",
        ["running", "edge process", "all sandboxes"],
        rows_cpu,
    )
    table(
        "memory per idle sandbox (MB)",
        ["running", "PSS mean", "PSS p99", "memory cgroup charge mean", "MemAvailable drop / N"],
        rows_mem,
    )
    table(
        f"filling the node (create_many of {args.batch}, then a command in each)",
        ["sandboxes", "seconds", "sandboxes/s"],
        rows_fill,
    )
    return 0 if answered == len(ids) else 1


if __name__ == "__main__":
    sys.exit(main())
