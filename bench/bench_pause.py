"""Pause that gives memory back (issue: RL preemption and density), with `docker pause` of
the same workload as the same-run baseline.

1. Working sets of 64 MiB, 256 MiB and 1 GiB (a Python process holding random bytes in a
   bookworm sandbox): pause time, the sandbox's resident memory before and after (its memory
   cgroup, as the edge reports it in `info.memory`), the host's MemAvailable before and after,
   resume time, resume -> first command (a `run("true")` on the paused sandbox: the transparent
   resume plus the command), and the time until the whole working set has been read again.
   Baseline: `docker run` of the same program on the same image, `docker pause` /
   `docker unpause` (the freezer only: it frees nothing).
   "1st pause" is the first pause of the sandbox (every page written to swap); the medians are
   over the repeats, whose pauses find most pages still in swap (unchanged since the resume).
2. Task preemption: `pause_task` and `resume_task` over S sandboxes of one task, each holding
   ~8 MiB in a shell variable: wall time, memory given back (the edge's pause status), and a
   command in every sandbox afterwards.

Targets (the issue): >= 90% of the sandbox's memory freed; pause <= 1 s and resume -> first
command <= 0.5 s at 256 MiB.

3. A pause that lasts: one sandbox holding 256 MiB paused and resumed at once (the baseline),
   then paused for --long-hold-s (120 s: longer than every liveness timer) and resumed by its
   first command; resume -> first command, the whole set read back, its digest unchanged.

usage: python bench/bench_pause.py [--sets 64,256,1024] [--repeat 3] [--task 200] [--no-docker]
       [--long-hold-s 120] [--long-set 256]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from bench.common import cluster, docker_available, table
from dsec.edge.v1 import edge_pb2, edge_pb2_grpc
from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client, Sandbox

MiB = 1 << 20
DOCKER_IMAGE = "dsec/bookworm:latest"

# Holds `size` MiB of random bytes; each time {d}/ask appears it reads every byte again (a
# digest) and writes {d}/done: "the whole working set is back".
HOLD = """
import hashlib, os, sys, time
data = bytearray({size} << 20)
for i in range(0, len(data), 1 << 20):  # filled in place: no second copy at the peak
    data[i : i + (1 << 20)] = os.urandom(1 << 20)
open("{d}/sum0", "w").write(hashlib.sha256(data).hexdigest())
open("{d}/ready", "w").write("1")
while True:
    if os.path.exists("{d}/ask"):
        os.remove("{d}/ask")
        open("{d}/sum1", "w").write(hashlib.sha256(data).hexdigest())
        open("{d}/done", "w").write("1")
    time.sleep(0.01)
"""


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def wait(pred: object, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"benchmark workload did not answer in {timeout_s} s")
        time.sleep(0.01)


def dsec_set(dsec: Client, size: int, repeat: int) -> dict[str, float]:
    sb = dsec.create(image="bookworm", cpu=1, memory_mb=size + 256, ttl_s=3600)
    try:
        sb.files.write("/work/hold.py", HOLD.format(size=size, d="/work"))
        holder = sb.start("python3 /work/hold.py")
        wait(lambda: sb.files.exists("/work/ready") or not holder.wait(timeout_s=0.01).running)
        if not sb.files.exists("/work/ready"):
            raise RuntimeError(f"the holder of {size} MiB ended: {holder.wait(timeout_s=0.01)}")
        rows: dict[str, list[float]] = {}
        for _ in range(repeat):
            time.sleep(0.5)
            before = sb.refresh().memory
            assert before is not None
            avail0 = mem_available()
            t = time.perf_counter()
            sb.pause()
            pause_s = time.perf_counter() - t
            after = sb.refresh().memory
            assert after is not None
            avail1 = mem_available()
            t = time.perf_counter()
            assert sb.run("true").exit_code == 0  # transparent resume + a command
            first_s = time.perf_counter() - t
            sb.run("rm -f /work/done; touch /work/ask")
            t = time.perf_counter()
            wait(lambda: sb.files.exists("/work/done"))
            whole_s = time.perf_counter() - t
            # An explicit resume, timed alone.
            sb.pause()
            t = time.perf_counter()
            sb.resume()
            resume_s = time.perf_counter() - t
            for k, v in {
                "resident_before": before.resident_bytes / MiB,
                "resident_after": after.resident_bytes / MiB,
                "swapped": after.swapped_bytes / MiB,
                "freed_pct": 100 * (1 - after.resident_bytes / before.resident_bytes),
                "avail_gain": (avail1 - avail0) / MiB,
                "pause_ms": pause_s * 1000,
                "resume_ms": resume_s * 1000,
                "first_ms": first_s * 1000,
                "whole_ms": whole_s * 1000,
            }.items():
                rows.setdefault(k, []).append(v)
        out = {k: statistics.median(v) for k, v in rows.items()}
        out["first_pause_ms"] = rows["pause_ms"][0]  # every page written to swap
        return out
    finally:
        sb.stop(grace_s=0)


def dsec_long(dsec: Client, size: int, hold_s: float) -> dict[str, float]:
    """One pause held ``hold_s`` (a preemption), then the first command (the transparent
    resume) and the whole working set read back, its digest compared with the one taken
    before the pause. Immediately-resumed pauses of the same sandbox are the baseline."""
    sb = dsec.create(image="bookworm", cpu=1, memory_mb=size + 256, ttl_s=3600)
    try:
        sb.files.write("/work/hold.py", HOLD.format(size=size, d="/work"))
        sb.start("python3 /work/hold.py")
        wait(lambda: sb.files.exists("/work/ready"))
        out: dict[str, float] = {}
        for label, hold in (("now", 0.0), ("long", hold_s)):
            sb.pause()
            time.sleep(hold)
            t = time.perf_counter()
            assert sb.run("true").exit_code == 0  # the transparent resume + a command
            out[f"{label}_first_ms"] = (time.perf_counter() - t) * 1000
            sb.run("rm -f /work/done /work/sum1; touch /work/ask")
            t = time.perf_counter()
            wait(lambda: sb.files.exists("/work/done"))
            out[f"{label}_whole_ms"] = (time.perf_counter() - t) * 1000
            intact = sb.files.read("/work/sum1") == sb.files.read("/work/sum0")
            out[f"{label}_intact"] = float(intact)
        return out
    finally:
        sb.stop(grace_s=0)


def docker_memory(cid: str) -> int:
    full = subprocess.run(
        ["docker", "inspect", "-f", "{{.Id}}", cid], capture_output=True, text=True, check=True
    ).stdout.strip()
    for base in ("/sys/fs/cgroup/memory/docker", "/sys/fs/cgroup/memory/system.slice"):
        f = Path(base) / full / "memory.usage_in_bytes"
        if f.exists():
            return int(f.read_text())
    return 0


def docker_set(size: int, repeat: int) -> dict[str, float]:
    cid = subprocess.run(
        [
            "docker", "run", "-d", "--network", "none", f"--memory={size + 256}m",
            DOCKER_IMAGE, "python3", "-c", HOLD.format(size=size, d="/tmp"),
        ],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    try:
        wait(
            lambda: (
                subprocess.run(["docker", "exec", cid, "test", "-e", "/tmp/ready"]).returncode == 0
            )
        )
        rows: dict[str, list[float]] = {}
        for _ in range(repeat):
            time.sleep(0.5)
            before = docker_memory(cid)
            avail0 = mem_available()
            t = time.perf_counter()
            subprocess.run(["docker", "pause", cid], check=True, capture_output=True)
            pause_s = time.perf_counter() - t
            after = docker_memory(cid)
            avail1 = mem_available()
            t = time.perf_counter()
            subprocess.run(["docker", "unpause", cid], check=True, capture_output=True)
            resume_s = time.perf_counter() - t
            subprocess.run(["docker", "exec", cid, "true"], check=True, capture_output=True)
            first_s = time.perf_counter() - t
            for k, v in {
                "resident_before": before / MiB,
                "resident_after": after / MiB,
                "swapped": 0.0,
                "freed_pct": 100 * (1 - after / before) if before else 0.0,
                "avail_gain": (avail1 - avail0) / MiB,
                "pause_ms": pause_s * 1000,
                "resume_ms": resume_s * 1000,
                "first_ms": first_s * 1000,
                "whole_ms": float("nan"),
            }.items():
                rows.setdefault(k, []).append(v)
        out = {k: statistics.median(v) for k, v in rows.items()}
        out["first_pause_ms"] = rows["pause_ms"][0]
        return out
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True)


def node_pause(c: LocalCluster) -> edge_pb2.PauseStatus:
    with grpc.insecure_channel(c.process("edge-bench").address) as ch:
        st = edge_pb2_grpc.EdgeServiceStub(ch).GetNodeStatus(
            edge_pb2.GetNodeStatusRequest(), timeout=10
        )
    return st.pause


def task_preemption(c: LocalCluster, dsec: Client, n: int) -> list[list[object]]:
    task = f"bench-preempt-{int(time.time())}"
    hold = "x=$(head -c 8000000 /dev/zero | tr '\\0' x); echo ready > /tmp/ready; sleep 3600"
    t = time.perf_counter()
    sbs = [
        s
        for s in dsec.create_many(n, image="busybox", cpu=0.05, memory_mb=64, task_id=task)
        if isinstance(s, Sandbox)
    ]
    create_s = time.perf_counter() - t
    try:
        for s in sbs:
            s.start(hold)
        for s in sbs:
            wait(lambda s=s: s.files.exists("/tmp/ready"))
        avail0 = mem_available()
        t = time.perf_counter()
        paused = dsec.pause_task(task)
        pause_s = time.perf_counter() - t
        avail1 = mem_available()
        st = node_pause(c)
        t = time.perf_counter()
        resumed = dsec.resume_task(task)
        resume_s = time.perf_counter() - t
        t = time.perf_counter()
        ok = sum(s.run("true").exit_code == 0 for s in sbs)
        first_s = time.perf_counter() - t
        return [
            ["sandboxes", len(sbs), f"created in {create_s:.1f} s"],
            ["pause_task wall (s)", round(pause_s, 2), f"{sum(r.ok for r in paused)} paused"],
            ["memory given back (MiB, edge)", st.released_mb, f"{st.paused} paused"],
            ["swapped (MiB, its sandboxes)", st.swapped_bytes >> 20, ""],
            ["host MemAvailable gain (MiB)", round((avail1 - avail0) / MiB), ""],
            ["resume_task wall (s)", round(resume_s, 2), f"{sum(r.ok for r in resumed)} resumed"],
            ["a command in each, after (s)", round(first_s, 2), f"{ok} answered"],
        ]
    finally:
        dsec.stop_task(task)


def _ms(v: float) -> object:
    return "-" if v != v else round(v)  # NaN: not measured


def main() -> int:
    # SIGTERM (timeout, kill) ends the run through the finally blocks: no cluster left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", default="64,256,1024")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--task", type=int, default=200, help="sandboxes of the preempted task")
    ap.add_argument("--no-docker", action="store_true")
    ap.add_argument("--long-hold-s", type=float, default=120.0, help="0: no long-pause row")
    ap.add_argument("--long-set", type=int, default=256, help="MiB held across the long pause")
    args = ap.parse_args()
    sets = [int(x) for x in args.sets.split(",")]
    use_docker = not args.no_docker and docker_available()
    edge = EdgeSpec(
        edge_id="bench",
        runtime="container",
        max_sandboxes=args.task + 20,
        extra_env={
            "DSEC_EDGE_FNCALL_POOLS": "",
            "DSEC_EDGE_CPU_OVERCOMMIT": "200",
            "DSEC_EDGE_PAUSE_SWAP_MB": str(max(sets) * 2 + 1024),
        },
    )
    with cluster(edges=[edge]) as c, Client(c.apiserver, token=c.token) as dsec:
        dsec.create(image="bookworm", cpu=1, memory_mb=128).stop()  # toolkit, image mounted
        cols = [
            "system", "set MiB", "RSS before", "RSS after", "freed %", "MemAvail +MiB",
            "1st pause ms", "pause ms", "resume ms", "resume->1st cmd ms", "whole set back ms",
        ]  # fmt: skip
        rows: list[list[object]] = []
        for size in sets:
            for name, r in [
                ("dsec pause (swap)", dsec_set(dsec, size, args.repeat)),
                *([("docker pause", docker_set(size, args.repeat))] if use_docker else []),
            ]:
                rows.append(
                    [
                        name, size, round(r["resident_before"]), round(r["resident_after"], 1),
                        round(r["freed_pct"], 1), round(r["avail_gain"]),
                        round(r["first_pause_ms"]), round(r["pause_ms"]),
                        round(r["resume_ms"]), round(r["first_ms"]), _ms(r["whole_ms"]),
                    ]
                )  # fmt: skip
        table(f"pause/resume, median of {args.repeat} (same run)", cols, rows)
        if args.long_hold_s:
            r = dsec_long(dsec, args.long_set, args.long_hold_s)
            table(
                f"pause that lasts: {args.long_set} MiB, the same sandbox paused twice",
                ["pause held", "resume->1st cmd ms", "whole set back ms", "memory intact"],
                [
                    [
                        f"{hold:.0f} s",
                        round(r[f"{k}_first_ms"]),
                        round(r[f"{k}_whole_ms"]),
                        "yes" if r[f"{k}_intact"] else "NO",
                    ]
                    for k, hold in (("now", 0.0), ("long", args.long_hold_s))
                ],
            )
        if args.task:
            table(
                f"task preemption: {args.task} sandboxes of one task",
                ["", "value", "note"],
                task_preemption(c, dsec, args.task),
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
