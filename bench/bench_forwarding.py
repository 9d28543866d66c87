"""Per-call cost of the forwarding table (common/forwarding.py) against a hand-written
forwarder, in process: the edge's generated ``ReadFile`` and a hand-written method of the old
shape (``return await self._unary("read_file", request)``), both over the same hop, whose
channel answers at once, so only the dispatch differs. Alternated rounds (ABBA); the median
per call.

usage: python bench/bench_forwarding.py [--calls 200000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsec.types.v1 import types_pb2
from edge.servicer import EdgeServicer

ANSWER = types_pb2.ReadFileResponse(data=b"x")


class _Channel:
    async def unary(self, call: str, request: Any) -> Any:
        return ANSWER


class _Edge(EdgeServicer):
    """The edge's servicer with a channel that answers at once (no manager needed)."""

    def __init__(self) -> None:
        self.channel = _Channel()

    async def _channel(self, sandbox_id: str) -> Any:
        return self.channel

    # The old shape, written by hand, for comparison.
    async def _unary(self, call: str, request: Any) -> Any:
        channel = await self._channel(request.sandbox_id)
        return await channel.unary(call, request)

    async def ReadFileByHand(
        self, request: types_pb2.ReadFileRequest, context: Any
    ) -> types_pb2.ReadFileResponse:
        return await self._unary("read_file", request)  # type: ignore[no-any-return]


async def _per_call_ns(method: Any, request: Any, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        await method(request, None)
    return (time.perf_counter_ns() - start) / calls


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    s = _Edge()
    req = types_pb2.ReadFileRequest(sandbox_id="sb-e1-aaaaaa01", path="/etc/hostname")
    table, hand = [], []
    for i in range(args.rounds):  # ABBA: neither goes first every time
        pair = [(table, s.ReadFile), (hand, s.ReadFileByHand)]
        for out, method in pair if i % 2 == 0 else pair[::-1]:
            out.append(await _per_call_ns(method, req, args.calls))
    t, h = statistics.median(table), statistics.median(hand)
    print(f"{'forwarder':<24}{'ns/call (median)':>18}{'min':>10}{'max':>10}")
    print(f"{'table (generated)':<24}{t:>18.0f}{min(table):>10.0f}{max(table):>10.0f}")
    print(f"{'hand-written':<24}{h:>18.0f}{min(hand):>10.0f}{max(hand):>10.0f}")
    print(f"difference: {t - h:+.0f} ns per call ({(t - h) / h:+.1%})")


if __name__ == "__main__":
    asyncio.run(main())
