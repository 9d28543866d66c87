"""Container fork (issue 37, item 3), with the same-run baseline: n creates that replay the
source's file writes.

An "episode" is what an agent did to a sandbox's files before the point to branch from: F small
files (1 KiB of random bytes each) and one file of B MiB, written into a bookworm sandbox. Then:

- fork: `sb.fork(n)`, and `run("true")` on the n children at once: until every child answers;
- baseline: `create_many(n)` of the same image and shape, then the episode's writes replayed in
  every one of them at once: until every sandbox has the files;
- the source's stall (`ForkResult.stall_s`: frozen while the copy of its writable layer was
  brought up to date) and, from outside, the longest `run("true")` round trip on the source
  while the fork ran (a thread calls it back to back);
- every child checked: a digest of the episode's files is the source's (a broken fork is an
  error, not a figure).

Runs in a private cluster (one container edge), everything removed at the end, also on
failure. The ratios to the same-run baseline are the claim, not the absolute times.

usage: python bench/bench_fork_container.py [--n 16] [--episodes 200x0,2000x0,200x100]
       (an episode is FILESxMIB)
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import cluster, table
from dsecctl.cluster import EdgeSpec
from libdsec import Client, Sandbox
from libdsec.errors import DSecError

#: The episode's files, digested (path and content), in the source and in every child.
DIGEST = "cd /work/ep && find . -type f | sort | xargs md5sum | md5sum | cut -d' ' -f1"
SHAPE = {"image": "bookworm", "cpu": 0.5, "memory_mb": 256}


def episode(files: int, mib: int) -> str:
    """The shell commands of an episode: `files` files of 1 KiB and one of `mib` MiB."""
    cmd = (
        "mkdir -p /work/ep && cd /work/ep && i=0; "
        f"while [ $i -lt {files} ]; do head -c 1024 /dev/urandom > f$i; i=$((i+1)); done"
    )
    if mib:
        cmd += f"; head -c {mib}M /dev/urandom > blob"
    return cmd


def run_all(sandboxes: list[Sandbox], cmd: str) -> list[str]:
    """`cmd` in every sandbox at once; their outputs (a failed command is an error)."""
    with ThreadPoolExecutor(len(sandboxes)) as pool:
        results = list(pool.map(lambda sb: sb.run(cmd, timeout_s=600), sandboxes))
    for r in results:
        if not r.ok:
            raise RuntimeError(f"{cmd!r} failed: {r.exit_code} {r.stderr[-300:]!r}")
    return [r.text for r in results]


class Prober:
    """`run("true")` on the source back to back while the fork runs: the longest round trip
    is the stall as a caller sees it."""

    def __init__(self, sb: Sandbox) -> None:
        self.sb = sb
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self.sb.run("true")
            self.longest = max(self.longest, time.perf_counter() - t0)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def stop_all(sandboxes: list[Sandbox]) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda sb: _stop(sb), sandboxes))


def _stop(sb: Sandbox) -> None:
    try:
        sb.stop(grace_s=0.2)
    except DSecError:
        pass


def one_episode(dsec: Client, n: int, files: int, mib: int) -> list[list[object]]:
    src = dsec.create(**SHAPE)  # type: ignore[arg-type]
    made: list[Sandbox] = [src]
    try:
        t0 = time.perf_counter()
        src.run(episode(files, mib), timeout_s=600)
        episode_s = time.perf_counter() - t0
        want = src.run(DIGEST).text
        src.run("true")  # an idle source: the probe's baseline round trip
        with Prober(src) as probe:
            t0 = time.perf_counter()
            result = src.fork(n, timeout=600)
            call_s = time.perf_counter() - t0
        made += result.sandboxes
        if result.errors:
            raise RuntimeError(f"fork: {len(result.errors)} children failed: {result.errors[0]}")
        run_all(result.sandboxes, "true")
        fork_s = time.perf_counter() - t0
        if set(run_all(result.sandboxes, DIGEST)) != {want}:
            raise RuntimeError("a child's files differ from the source's")
        stop_all(result.sandboxes)

        t0 = time.perf_counter()
        fresh = dsec.create_many(n, **SHAPE)  # type: ignore[arg-type]
        ok = [s for s in fresh if isinstance(s, Sandbox)]
        made += ok
        if len(ok) != n:
            raise RuntimeError(f"create_many: {n - len(ok)} failed")
        create_s = time.perf_counter() - t0
        run_all(ok, episode(files, mib))
        replay_s = time.perf_counter() - t0
        size = f"{files} x 1 KiB" + (f" + {mib} MiB" if mib else "")
        return [
            [
                size, f"fork {n}", round(fork_s * 1000), round(call_s * 1000),
                round(result.stall_s * 1000, 1), round(probe.longest * 1000, 1),
                f"{replay_s / fork_s:.1f}x",
            ],
            [
                size, f"create {n} + replay", round(replay_s * 1000), round(create_s * 1000),
                "—", "—", f"(episode alone: {episode_s * 1000:.0f} ms)",
            ],
        ]  # fmt: skip
    finally:
        stop_all(made)


def main() -> int:
    # SIGTERM (timeout, kill) ends the run through the finally blocks: no cluster left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16, help="children / sandboxes per system")
    ap.add_argument("--episodes", default="200x0,2000x0,200x100", help="FILESxMIB,...")
    args = ap.parse_args()
    episodes = [tuple(int(x) for x in e.split("x")) for e in args.episodes.split(",")]
    edge = EdgeSpec(
        edge_id="bench",
        runtime="container",
        max_sandboxes=2 * args.n + 8,
        extra_env={"DSEC_EDGE_FNCALL_POOLS": "", "DSEC_EDGE_CPU_OVERCOMMIT": "400"},
    )
    with cluster(edges=[edge]) as c, Client(c.apiserver, token=c.token) as dsec:
        dsec.create(**SHAPE).stop()  # type: ignore[arg-type]  # toolkit, image mounted
        rows: list[list[object]] = []
        for files, mib in episodes:
            rows += one_episode(dsec, args.n, files, mib)
        table(
            f"container fork of a bookworm sandbox vs creates + replayed writes (same run, n={args.n})",
            [
                "episode", "system", "until all have the files ms", "call ms",
                "stall ms", "source's longest call ms", "fork faster by",
            ],
            rows,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
