"""MicroVM fork (issue 37, item 2), with baselines measured in the same run (containers:
bench/bench_fork_container.py).

A 256 MB busybox microVM with up to 200 MB of its RAM dirtied
(random data in /dev/shm: what fits beside the guest's kernel and aether, ~120 MB at 256 MB;
`--memory-mb 384` holds 200) forked 16 ways, against 16 creates from the
shape's template and 16 cold boots (an edge with DSEC_EDGE_MICROVM_TEMPLATES=false) of the same
image and shape, made with one `create_many`:

- until every child answers: the call (fork / create_many) and then `run("true")` on each of
  the 16 at once; the call alone; per sandbox, from the edge's start lines (`started in`);
- host memory of the 16: the PSS of their QEMU processes (a fork's children and a template's
  clones share the RAM file they map copy-on-write: PSS splits it) and the sum of their memory
  cgroups' usage (what each is charged: the pages it wrote, its QEMU);
- the source's stall: `ForkResult.stall_s` (stop to `cont`, as the edge measured it: the
  source is saved live, stopped only for the last pages and its disk's copy) and, from
  outside, the longest `run("true")` round trip on the source while the fork ran (a thread
  calls it back to back; the guest's own clocks stop with it, so it cannot time itself; the
  save's dirty tracking and the fork's other work on this 2-core machine slow it meanwhile);
- every child checked: the dirtied data's checksum is the source's (a broken fork is an error,
  not a figure).

Runs in a private cluster (bench/bench_microvm.py's: templated, cold-boot and warm edges,
private node-wide cache), everything removed at the end, also on failure. Under TCG (no usable
KVM here) absolute times are this machine's; the ratios to the same-run baselines are the claim.

usage: python bench/bench_fork_microvm.py [--n 16] [--memory-mb 256] [--dirty-mb 200]
                                         [--keep-logs DIR]
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_microvm import (
    COLD,
    TMPL,
    Bench,
    CpuMeter,
    _terminate,
    edge_log,
    microvm_cluster,
    rollup,
)
from bench.common import pct, table
from libdsec import Sandbox
from libdsec.errors import DSecError

#: What the source's dirtied data is checked by, in the source and every child.
SUM = "md5sum /dev/shm/fill | cut -d' ' -f1"


def dirty(sb: Sandbox, want_mb: int) -> tuple[int, float]:
    """Up to `want_mb` of random data in the guest's /dev/shm (what fits: MemAvailable less
    a margin for aether). Returns (MB written, seconds)."""
    meminfo = sb.run("cat /proc/meminfo").text
    avail = re.search(r"MemAvailable:\s+(\d+)", meminfo)
    assert avail is not None, meminfo
    fill = min(want_mb, int(avail.group(1)) // 1024 - 48)
    r = sb.run(f"mount -o remount,size={fill + 16}m /dev/shm")
    if r.exit_code != 0:
        raise RuntimeError(f"cannot grow the guest's /dev/shm: {r.stderr!r}")
    t = time.perf_counter()
    r = sb.run(f"dd if=/dev/urandom of=/dev/shm/fill bs=1M count={fill}", timeout_s=600)
    if r.exit_code != 0:
        raise RuntimeError(f"dirtying the guest's RAM failed: {r.exit_code} {r.stderr!r}")
    return fill, time.perf_counter() - t


def all_answer(sandboxes: list[Sandbox]) -> float:
    """Seconds until every sandbox has answered `run("true")`, all called at once."""
    t = time.perf_counter()
    with ThreadPoolExecutor(len(sandboxes)) as pool:
        codes = list(pool.map(lambda sb: sb.run("true").exit_code, sandboxes))
    if any(codes):
        raise RuntimeError(f"run('true') failed: {codes}")
    return time.perf_counter() - t


def memory_mb(b: Bench, sandboxes: list[Sandbox]) -> tuple[float, float]:
    """(PSS of their QEMU processes, their memory cgroups' usage), MB summed."""
    pss = sum(rollup(b.qemu_pid(sb)).get("Pss", 0) for sb in sandboxes) / 1024
    usage = sum(b.memcg(sb).get("usage", 0) for sb in sandboxes) / 2**20
    return pss, usage


def started_ms(b: Bench, edge: str, ids: set[str]) -> list[float]:
    """The edge's `started in` durations (ms) of the sandboxes `ids`, with the time each
    waited for its turn (starts take turns: a create's figure counts it, a fork child's
    logs it apart as `queued_ms`)."""
    out = []
    for e in edge_log(b, edge, "started in"):
        if e.get("sandbox_id") in ids:
            own = float(e["msg"].split("started in", 1)[1].split()[0])
            out.append(own + float(e.get("queued_ms", 0.0)))
    return out


class Ticker:
    """`run("true")` on the source back to back while the fork runs: the longest round trip
    is the stall as a caller sees it."""

    def __init__(self, sb: Sandbox) -> None:
        self.sb = sb
        self.longest = 0.0
        self.calls = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.is_set():
            t = time.perf_counter()
            self.sb.run("true")
            self.longest = max(self.longest, time.perf_counter() - t)
            self.calls += 1

    def __enter__(self) -> Ticker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(60)


def section_microvm(b: Bench, n: int, guest_mb: int, dirty_mb: int) -> None:
    source = b.create("microvm", TMPL, memory_mb=guest_mb)
    fill, fill_s = dirty(source, dirty_mb)
    want = source.run(SUM, timeout_s=120).text
    print(f"  source {source.id}: {fill} MB of random data in /dev/shm in {fill_s:.1f} s")
    rows: list[list[object]] = []
    mem_rows: list[list[object]] = []

    def measure(
        what: str, edge: str, make: Callable[[], list[Sandbox | DSecError]], check: bool
    ) -> float:
        t = time.perf_counter()
        made = make()
        call_s = time.perf_counter() - t
        errors = [m for m in made if isinstance(m, DSecError)]
        if errors:
            raise RuntimeError(f"{what}: {len(errors)} of {n} failed: {errors[0]}")
        sandboxes = [m for m in made if isinstance(m, Sandbox)]
        try:
            total_s = call_s + all_answer(sandboxes)
            per = started_ms(b, edge, {sb.id for sb in sandboxes})
            pss, usage = memory_mb(b, sandboxes)
            if check:
                with ThreadPoolExecutor(4) as pool:
                    sums = list(pool.map(lambda sb: sb.run(SUM, timeout_s=120).text, sandboxes))
                bad = [sb.id for sb, s in zip(sandboxes, sums, strict=True) if s != want]
                if bad:
                    raise RuntimeError(f"{what}: children whose data is not the source's: {bad}")
        finally:
            for sb in sandboxes:
                b.stop(sb)
        rows.append([what, total_s, call_s, pct(per, 50) / 1000, pct(per, 100) / 1000, total_s / n])
        mem_rows.append([what, round(pss), round(usage), round(pss / n), round(usage / n)])
        return total_s

    result: list[object] = []

    def fork() -> list[Sandbox | DSecError]:
        with Ticker(source) as ticker:
            r = source.fork(n, task_id=b.run_id)
        result.extend([r.stall_s, ticker.longest, ticker.calls])
        return r.children

    def creates(sel: dict[str, str]) -> Callable[[], list[Sandbox | DSecError]]:
        return lambda: b.dsec.create_many(
            n,
            backend="microvm",
            image="busybox",
            cpu=1,
            memory_mb=guest_mb,
            node_selector=sel,
            task_id=b.run_id,
        )

    try:
        fork_s = measure(f"fork {n} (source {fill} MB dirtied)", "tmpl", fork, check=True)
        tmpl_s = measure(f"{n} creates from the template", "tmpl", creates(TMPL), check=False)
        cold_s = measure(f"{n} cold boots", "cold", creates(COLD), check=False)
    finally:
        b.stop(source)
    table(
        f"microVM: {n} children of a {guest_mb} MB guest vs {n} new guests (s; the call, then "
        "run('true') on all at once)",
        ["what", "all answer", "the call", "start p50", "start max", "per sandbox"],
        rows,
    )
    table(
        f"microVM: host memory of the {n} (MB; PSS of their QEMUs, their memory cgroups)",
        ["what", "PSS", "cgroups", "PSS each", "cgroup each"],
        mem_rows,
    )
    stall_s, longest_s, calls = result
    assert isinstance(stall_s, float) and isinstance(longest_s, float)
    table(
        "microVM: the source's stall",
        ["what", "ms"],
        [
            ["stop -> cont (ForkResult.stall_s)", round(stall_s * 1000, 1)],
            [
                f"longest run('true') on the source during the fork ({calls} calls)",
                round(longest_s * 1000, 1),
            ],
        ],
    )
    print(
        f"  fork {n} vs {n} creates from the template: {fork_s / tmpl_s:.2f}x the time; "
        f"vs {n} cold boots: {fork_s / cold_s:.2f}x",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16, help="children / sandboxes per system")
    ap.add_argument("--memory-mb", type=int, default=256, help="the guests' RAM (MB)")
    ap.add_argument(
        "--dirty-mb", type=int, default=200, help="the source's dirtied RAM (MB, at most what fits)"
    )
    ap.add_argument("--keep-logs", type=Path, help="copy the services' and guests' logs here")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _terminate)
    t0 = time.monotonic()
    with microvm_cluster(2 * args.n + 4, args.keep_logs) as b:
        print(f"cluster up in {time.monotonic() - t0:.1f} s", flush=True)
        meter = CpuMeter()
        section_microvm(b, args.n, args.memory_mb, args.dirty_mb)
        meter.report("microvm fork")
    print(f"\ntotal {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
