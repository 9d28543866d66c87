"""What the operation log (edge/oplog.py, edge/operations.py) costs: a ``run("true")`` round
trip and a burst of 1,000 small file writes, log on vs off, and the log's disk use.

One cluster, two container edges on this machine: ``on`` (the default) and ``off``
(DSEC_EDGE_OPLOG=off), a busybox sandbox on each. Rounds alternate between the modes (ABBA),
and the figures are medians over rounds, so both see the same machine. Three modes:

* ``off``: the edge logs nothing (the baseline); calls carry no operation id.
* ``on, no id``: every call is logged under an id the edge makes (provenance only).
* ``on, with id``: the SDK's calls: exactly once (reserved before it runs, detached from
  its caller, answered from the log on a repeat).

The round trips go through the API server (the raw stub: the SDK always sends an id, which the
``off`` edge refuses) and straight to each edge (what the edge adds, without the API server's
share of the machine's noise).

usage: python bench/bench_oplog.py [--calls 150] [--writes 1000] [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from bench.common import IMAGES, cluster, table
from dsec.edge.v1 import edge_pb2_grpc
from dsec.types.v1 import types_pb2
from dsecctl.cluster import EdgeSpec
from libdsec.aio import AsyncClient

MODES = ("off", "on, no id", "on, with id")


def edge(edge_id: str, oplog: str) -> EdgeSpec:
    return EdgeSpec(
        edge_id=edge_id,
        labels={"oplog": oplog},
        extra_env={
            "DSEC_EDGE_IMAGE_DIR": str(IMAGES),
            "DSEC_EDGE_FNCALL_POOLS": "",
            "DSEC_EDGE_VM": "off",
            "DSEC_EDGE_MICROVM": "off",
            "DSEC_EDGE_OPLOG": oplog,
        },
    )


def _id(with_id: bool) -> str:
    return f"bench-{uuid.uuid4().hex}" if with_id else ""


async def round_trips(exec_call: Any, sandbox_id: str, calls: int, with_id: bool) -> list[float]:
    """``calls`` sequential ``run("true")`` through ``exec_call`` (an Exec of a stub, through
    the API server or straight to the edge): their times in seconds."""
    out = []
    for _ in range(calls):
        req = types_pb2.ExecRequest(
            sandbox_id=sandbox_id, command="true", operation_id=_id(with_id)
        )
        t0 = time.perf_counter()
        await exec_call(req)
        out.append(time.perf_counter() - t0)
    return out


async def write_burst(c: AsyncClient, sandbox_id: str, writes: int, with_id: bool) -> float:
    """Seconds for ``writes`` 100-byte files, 32 at a time."""
    rpc = c.transport
    sem = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        req = types_pb2.WriteFileRequest(
            sandbox_id=sandbox_id, path=f"/tmp/w/{i}", data=b"x" * 100, make_parents=True
        )
        req.operation_id = _id(with_id)
        async with sem:
            await rpc.unary(rpc.files.WriteFile, req, timeout=60)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(writes)))
    return time.perf_counter() - t0


def db_bytes(state_dir: Path) -> int:
    """The log database's size with its WAL folded in (a checkpoint from a second connection,
    which SQLite allows beside the edge's own)."""
    db = sqlite3.connect(str(state_dir / "oplog.db"))
    try:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.close()
    return (state_dir / "oplog.db").stat().st_size


def ratios(title: str, per_round: dict[str, list[list[float]]]) -> None:
    """A table of the modes' round trips: medians over rounds of each round's p50 and mean,
    each against ``off``."""
    p50 = {
        m: statistics.median(statistics.median(r) for r in rs) * 1000 for m, rs in per_round.items()
    }
    mean = {
        m: statistics.median(statistics.fmean(r) for r in rs) * 1000 for m, rs in per_round.items()
    }
    rows = [
        [m, p50[m], f"{p50[m] / p50['off']:.3f}x", mean[m], f"{mean[m] / mean['off']:.3f}x"]
        for m in per_round
    ]
    table(title, ["mode", "p50 ms", "vs off", "mean ms", "vs off"], rows)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=150)
    ap.add_argument("--writes", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    with cluster(edges=[edge("boff", "off"), edge("bon", "on")]) as c:
        async with AsyncClient(c.apiserver, token=c.token) as client:
            rpc = client.transport
            boxes = {}
            for oplog in ("off", "on"):
                sb = await client.create(image="busybox", node_selector={"oplog": oplog}, cpu=1)
                boxes[oplog] = sb.id
            target = {m: boxes["off" if m == "off" else "on"] for m in MODES}
            channels = {
                o: grpc.aio.insecure_channel(c.process(f"edge-b{o}").address) for o in ("off", "on")
            }
            edges = {o: edge_pb2_grpc.EdgeServiceStub(ch) for o, ch in channels.items()}
            via: dict[str, dict[str, Any]] = {
                "API server": {m: lambda r: rpc.unary(rpc.exec.Exec, r, timeout=30) for m in MODES},
                "edge alone": {m: edges["off" if m == "off" else "on"].Exec for m in MODES},
            }
            trips: dict[str, dict[str, list[list[float]]]] = {
                path: {m: [] for m in MODES} for path in via
            }
            burst: dict[str, list[float]] = {m: [] for m in MODES}  # per round: writes/s
            for calls in via.values():  # warm-up
                for m in MODES:
                    await round_trips(calls[m], target[m], 20, m == "on, with id")
            for i in range(args.rounds):  # ABBA: no mode always first
                order = MODES if i % 2 == 0 else MODES[::-1]
                for path, calls in via.items():
                    for m in order:
                        trips[path][m].append(
                            await round_trips(calls[m], target[m], args.calls, m == "on, with id")
                        )
                if i % 2 == 0:
                    for m in order:
                        secs = await write_burst(client, target[m], args.writes, m == "on, with id")
                        burst[m].append(args.writes / secs)
            for path in via:
                ratios(
                    f"operation log: run('true') round trip through the {path} "
                    f"({args.calls} calls x {args.rounds} rounds; medians of rounds)",
                    trips[path],
                )
            base = statistics.median(burst["off"])
            table(
                f"operation log: {args.writes} small writes (100 B, 32 at a time), "
                f"medians of {len(burst['off'])} rounds",
                ["mode", "writes/s", "vs off"],
                [
                    [m, statistics.median(burst[m]), f"{statistics.median(burst[m]) / base:.3f}x"]
                    for m in MODES
                ],
            )
            state = c.home / "edges" / "bon"
            before = db_bytes(state)
            for _ in range(10):
                await round_trips(
                    via["API server"]["on, with id"], target["on, with id"], 100, True
                )
            mid = db_bytes(state)
            await write_burst(client, target["on, with id"], 1000, True)
            after = db_bytes(state)
            table(
                "operation log: disk use per 1,000 operations (oplog.db after a checkpoint)",
                ["operations", "KiB per 1,000"],
                [
                    ["run('true'), with id", (mid - before) / 1024],
                    ["write 100 B, with id", (after - mid) / 1024],
                ],
            )
            for ch in channels.values():
                await ch.close()


if __name__ == "__main__":
    asyncio.run(main())
