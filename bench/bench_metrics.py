"""What measuring costs (issue 40): unary creates and ``run("true")`` with every service's
metrics on (and scraped) against the same cluster shape with metrics off, in the same run.

Two clusters run side by side, identical but for metrics: one with every instrument live and
each service's /metrics scraped every ``--scrape-s`` (5 s; Prometheus' default is 15 s) by
another process, as a Prometheus would, one with ``DSEC_<SVC>_METRICS=off`` (no-op instruments, no
endpoint). Each has a null-runtime edge (creates: the control plane's and the edge's own
work, no container start to hide a cost in) and a container edge (one sandbox for
``run("true")``: API server -> edge -> aether -> chronus and back). Rounds alternate which
cluster goes first; the table gives p50, p99 and mean per operation and way, and on/off.

The issue's target: metrics cost <= 3%.

usage: python bench/bench_metrics.py [--rounds 6] [--creates 40] [--runs 80]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import IMAGES, pct, table
from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client


@contextmanager
def cluster(metrics: bool) -> Iterator[LocalCluster]:
    edges = [
        EdgeSpec(edge_id="bnull", runtime="null", labels={"kind": "null"}, max_sandboxes=10_000),
        EdgeSpec(
            edge_id="bctr",
            runtime="container",
            labels={"kind": "ctr"},
            extra_env={
                "DSEC_EDGE_IMAGE_DIR": str(IMAGES),
                "DSEC_EDGE_FNCALL_POOLS": "",
                "DSEC_EDGE_VM": "off",
            },
        ),
    ]
    name = "on" if metrics else "off"
    with tempfile.TemporaryDirectory(prefix=f"dsec-bench-metrics-{name}-") as home:
        c = LocalCluster(
            Path(home),
            transport="unix",
            edges=edges,
            log_level="WARNING",
            compat=False,
            metrics=metrics,
        )
        c.start(timeout_s=120)
        try:
            yield c
        finally:
            c.stop()


@contextmanager
def scraping(c: LocalCluster, interval_s: float) -> Iterator[Path]:
    """Every service's /metrics fetched every ``interval_s`` by another process (as a
    Prometheus would: not a thread of this one, whose GIL the timed calls need) until the
    block ends; yields the file where it appends each scrape's size."""
    targets = [f"http://{p.metrics}/metrics" for p in c.processes if p.metrics]
    with tempfile.NamedTemporaryFile(prefix="dsec-bench-scrapes-", delete=False) as f:
        log = Path(f.name)
    code = (
        "import sys, time, urllib.request\n"
        "targets, every, log = sys.argv[3:], float(sys.argv[1]), sys.argv[2]\n"
        "while True:\n"
        "    time.sleep(every)\n"
        "    for t in targets:\n"
        "        n = len(urllib.request.urlopen(t, timeout=5).read())\n"
        "        open(log, 'a').write(f'{n}\\n')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(interval_s), str(log), *targets])
    try:
        yield log
    finally:
        proc.kill()
        proc.wait(timeout=10)


def creates(cl: Client, n: int) -> list[float]:
    out = []
    made = []
    for _ in range(n):
        t0 = time.perf_counter()
        made.append(
            cl.create(image="busybox", cpu=0.01, memory_mb=16, node_selector={"kind": "null"})
        )
        out.append(time.perf_counter() - t0)
    for sb in made:  # untimed: the next round starts on an empty node
        sb.stop(grace_s=0)
    return out


def runs(box: object, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        result = box.run("true")  # type: ignore[attr-defined]
        out.append(time.perf_counter() - t0)
        assert result.exit_code == 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--creates", type=int, default=40)
    ap.add_argument("--runs", type=int, default=80)
    ap.add_argument("--scrape-s", type=float, default=5.0, help="scrape interval (Prometheus: 15)")
    args = ap.parse_args()
    samples: dict[tuple[str, str], list[float]] = {}
    with cluster(True) as on, cluster(False) as off:
        ways = {"on": on, "off": off}
        clients = {w: Client(c.apiserver, token=c.token) for w, c in ways.items()}
        boxes = {
            w: cl.create(image="busybox", cpu=0.1, memory_mb=64, node_selector={"kind": "ctr"})
            for w, cl in clients.items()
        }
        try:
            with scraping(on, args.scrape_s) as scrape_log:
                for w in ways:  # warm both (first calls open channels, fill caches)
                    creates(clients[w], 5)
                    runs(boxes[w], 10)
                for r in range(args.rounds):
                    order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
                    for w in order:
                        samples.setdefault(("create", w), []).extend(
                            creates(clients[w], args.creates)
                        )
                        samples.setdefault(("run(true)", w), []).extend(runs(boxes[w], args.runs))
            scrapes = [int(n) for n in scrape_log.read_text().split()]
            scrape_log.unlink()
        finally:
            for w in ways:
                boxes[w].stop()
                clients[w].close()
    rows: list[list[object]] = []
    for op in ("create", "run(true)"):
        stats = {}
        for w in ("off", "on"):
            ms = [v * 1000 for v in samples[(op, w)]]
            stats[w] = (pct(ms, 50), pct(ms, 99), statistics.fmean(ms))
        for w in ("off", "on"):
            p50, p99, mean = stats[w]
            rows.append([op, w, len(samples[(op, w)]), p50, p99, mean])
        rows.append(
            [
                op,
                "on/off",
                "",
                stats["on"][0] / stats["off"][0],
                stats["on"][1] / stats["off"][1],
                stats["on"][2] / stats["off"][2],
            ]
        )
    table(
        f"metrics on (scraped every {args.scrape_s:g} s: {len(scrapes)} scrapes, "
        f"{statistics.fmean(scrapes) / 1024 if scrapes else 0:.1f} KiB each) vs off",
        ["operation", "metrics", "n", "p50 ms", "p99 ms", "mean ms"],
        rows,
    )


if __name__ == "__main__":
    main()
