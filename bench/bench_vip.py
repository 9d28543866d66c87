"""API servers behind a virtual IP, same run (issue 36): failover times and the ECMP hop's cost.

The layout of tests/multinode/viplab.py: FRR's zebra + bgpd as the router on a lab host of its
own, each API server on a host of its own announcing the virtual IP through its bgpd, the
rest of the control plane and a null edge (sandboxes tracked, nothing started: the numbers
are the control plane's) on another host. Everything shares this machine's 2 cores.

1. Failover, for 2 and 3 instances, ``--rounds`` times each, under a load of ``--clients``
   SDK clients (a connection each) listing sandboxes in a loop:
   - ``kill -9`` of an instance: seconds until the router's route has no next hop to it
     (its agent and bgpd die with it: the BGP session closes), the longest time a client that
     was connected to it went without a completed call, and calls that failed (the SDK
     retries an idempotent call on UNAVAILABLE);
   - the instance hung (SIGSTOP): seconds until withdrawn (its agent's health check fails);
   - its host cut off (link down): seconds until withdrawn (the router's BGP hold timer, 3 s).
2. Unary creates by ``--workers`` threads (a client each), ``--creates`` in all: through the
   virtual IP (router hop, ECMP over 2 instances) against straight to one instance, same run.

usage: python bench/bench_vip.py [--rounds 3] [--clients 8] [--creates 400] [--workers 8]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import pct, table
from libdsec import Client
from libdsec._transport import SDK_KEEPALIVE_MS
from tests.multinode.viplab import Load, VipLab, vip_cluster, wait_withdrawn

#: How long the load runs on after the withdrawal (the victim's clients must have moved).
SETTLE_S = 10.0


def restore(v: VipLab, name: str) -> None:
    p = v.cluster.process(name)
    host = p.host
    assert host is not None
    host.link_up()
    if p.proc is not None and p.proc.poll() is None:
        os.kill(p.proc.pid, signal.SIGCONT)
    else:
        v.cluster._spawn(p)
        v.cluster.wait_serving([p], 60)
    v.router.wait_next_hops(v.vip, v.addresses(), timeout_s=60)


def failover(v: VipLab, how: str, clients: int) -> tuple[float, float, int]:
    """(withdrawn s, longest stall of a client of the victim, failed calls) for one round."""
    victim = v.cluster.process("apiserver")
    host = victim.host
    assert host is not None
    with Load(v, clients) as load:
        time.sleep(1.0)
        t0 = time.monotonic()
        if how == "kill -9":
            os.kill(victim.pid, signal.SIGKILL)
        elif how == "hang":
            os.kill(victim.pid, signal.SIGSTOP)
        else:
            host.link_down()
        withdrawn = wait_withdrawn(v, host.address, t0, timeout_s=30)
        time.sleep(SETTLE_S)
        stall = load.longest_stall(t0, "apiserver")
    restore(v, "apiserver")
    return withdrawn, stall, len(load.failed)


def creates(target: str, token: str, n: int, workers: int) -> tuple[float, list[float]]:
    lat: list[float] = []
    lock = threading.Lock()
    todo = iter(range(n))
    made: list[list[object]] = [[] for _ in range(workers)]

    def work(i: int) -> None:
        with Client(target, token=token) as c:
            while True:
                with lock:
                    if next(todo, None) is None:
                        break
                t = time.monotonic()
                made[i].append(c.create(image="busybox"))
                with lock:
                    lat.append(time.monotonic() - t)
            for sb in made[i]:
                sb.stop()  # type: ignore[attr-defined]

    t0 = time.monotonic()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - t0, lat


def _secs(s: float) -> object:
    """A time, or why there is none (no call of the victim's clients succeeded in time)."""
    return s if s == s and s != float("inf") else f"none in {SETTLE_S:.0f} s"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--creates", type=int, default=400)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    rows: list[list[object]] = []
    throughput: list[list[object]] = []
    for instances in (2, 3):
        with tempfile.TemporaryDirectory(prefix="dsec-bench-vip-") as root:
            with vip_cluster(Path(root), instances=instances, log_level="WARNING") as v:
                for how in ("kill -9", "hang", "host lost"):
                    results = []
                    for i in range(args.rounds):
                        results.append(failover(v, how, args.clients))
                        print(
                            f"  {instances} instances, {how}, round {i + 1}: {results[-1]}",
                            file=sys.stderr,
                            flush=True,
                        )
                    # NaN: no client happened to be on the victim that round
                    stalls = [r[1] for r in results if r[1] == r[1]] or [float("nan")]
                    rows.append(
                        [
                            instances,
                            how,
                            pct([r[0] for r in results], 50),
                            max(r[0] for r in results),
                            _secs(pct(stalls, 50)),
                            _secs(max(stalls)),
                            sum(r[2] for r in results),
                        ]
                    )
                if instances == 2:
                    direct = f"{v.instance_on('api1').host.address}:7100"  # type: ignore[union-attr]
                    for name, target in (
                        ("one instance, direct", direct),
                        ("virtual IP", v.target),
                    ):
                        wall, lat = creates(target, v.cluster.token, args.creates, args.workers)
                        throughput.append(
                            [
                                name,
                                round(args.creates / wall, 1),
                                pct(lat, 50) * 1e3,
                                pct(lat, 99) * 1e3,
                            ]
                        )
    table(
        f"failover under load ({args.clients} clients listing in a loop; {args.rounds} rounds)",
        [
            "instances",
            "failure",
            "withdrawn p50 s",
            "max s",
            "victim's clients: longest stall p50 s",
            "max s",
            "failed calls",
        ],
        rows,
    )
    print(
        "  hang: the victim's clients move at their connection's next HTTP/2 keepalive ping"
        f" ({SDK_KEEPALIVE_MS / 1000:.0f} s), which the route now takes to another instance"
        " (it resets the connection)"
    )
    base = float(throughput[0][1])  # type: ignore[arg-type]
    table(
        f"unary creates ({args.creates} by {args.workers} clients, null edge)",
        ["path", "creates/s", "p50 ms", "p99 ms", "vs direct"],
        [[*r, round(float(r[1]) / base, 2)] for r in throughput],  # type: ignore[arg-type]
    )


if __name__ == "__main__":
    main()
