"""What the operation log (edge/oplog.py, edge/operations.py) costs: a ``run("true")`` round
trip and a burst of 1,000 small file writes, log on vs off, and the log's disk use.

One cluster, two container edges on this machine: ``on`` (the default) and ``off``
(DSEC_EDGE_OPLOG=off), a busybox sandbox on each. Rounds alternate between the modes (ABBA),
and the figures are medians over rounds, so both see the same machine. Three modes:

* ``off``: the edge logs nothing (the baseline); calls carry no operation id.
* ``on, no id``: every call is logged under an id the edge makes (provenance only).
* ``on, with id``: the SDK's calls: exactly once (reserved before it runs, detached from
  its caller, answered from the log on a repeat).

The calls go through the API server with the raw stub (the SDK always sends an id, which the
``off`` edge refuses).

usage: python bench/bench_oplog.py [--calls 300] [--writes 1000] [--rounds 4]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import IMAGES, cluster, table
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


async def round_trips(c: AsyncClient, sandbox_id: str, calls: int, with_id: bool) -> list[float]:
    rpc = c.transport
    out = []
    for _ in range(calls):
        req = types_pb2.ExecRequest(
            sandbox_id=sandbox_id, command="true", operation_id=_id(with_id)
        )
        t0 = time.perf_counter()
        await rpc.unary(rpc.exec.Exec, req, timeout=30)
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


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--writes", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    with cluster(edges=[edge("boff", "off"), edge("bon", "on")]) as c:
        async with AsyncClient(c.apiserver, token=c.token) as client:
            boxes = {}
            for oplog in ("off", "on"):
                sb = await client.create(image="busybox", node_selector={"oplog": oplog}, cpu=1)
                boxes[oplog] = sb.id
            target = {m: boxes["off" if m == "off" else "on"] for m in MODES}
            rt: dict[str, list[float]] = {m: [] for m in MODES}  # per round: mean ms
            p50: dict[str, list[float]] = {m: [] for m in MODES}
            burst: dict[str, list[float]] = {m: [] for m in MODES}  # per round: writes/s
            for m in MODES:  # warm-up
                await round_trips(client, target[m], 20, m == "on, with id")
            for i in range(args.rounds):
                order = MODES if i % 2 == 0 else MODES[::-1]
                for m in order:
                    times = await round_trips(client, target[m], args.calls, m == "on, with id")
                    rt[m].append(statistics.fmean(times) * 1000)
                    p50[m].append(statistics.median(times) * 1000)
                for m in order:
                    secs = await write_burst(client, target[m], args.writes, m == "on, with id")
                    burst[m].append(args.writes / secs)
            base_rt = statistics.median(rt["off"])
            base_burst = statistics.median(burst["off"])
            rows = []
            for m in MODES:
                mean_rt, w = statistics.median(rt[m]), statistics.median(burst[m])
                rows.append(
                    [
                        m,
                        statistics.median(p50[m]),
                        mean_rt,
                        f"{mean_rt / base_rt:.3f}x",
                        w,
                        f"{w / base_burst:.3f}x",
                    ]
                )
            table(
                f"operation log: run('true') round trip ({args.calls} calls x {args.rounds} "
                f"rounds) and {args.writes} small writes (32 at a time); medians of rounds",
                ["mode", "p50 ms", "mean ms", "vs off", "writes/s", "vs off"],
                rows,
            )
            state = c.home / "edges" / "bon"
            before = db_bytes(state)
            for _ in range(10):
                await round_trips(client, target["on, with id"], 100, True)
            mid = db_bytes(state)
            await write_burst(client, target["on, with id"], 1000, True)
            after = db_bytes(state)
            table(
                "operation log: disk use per 1,000 operations (oplog.db + WAL growth)",
                ["operations", "KiB per 1,000"],
                [
                    ["run('true'), with id", (mid - before) / 1024],
                    ["write 100 B, with id", (after - mid) / 1024],
                ],
            )


if __name__ == "__main__":
    asyncio.run(main())
