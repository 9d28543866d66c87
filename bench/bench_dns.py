"""The sandboxes' resolver per query, dnspython vs the hand-written codec it replaced
(issue 32), same run.

``Resolver.handle`` (edge/network/dns.py) answers each DNS query a sandbox sends: it decodes
the query, asks the policy, and either builds a REFUSED/NXDOMAIN reply or relays the query
to the upstream resolver and decodes the answer to learn its addresses. It runs once per
lookup, not per packet (packets are filtered in the kernel by eBPF), so what matters is its
cost beside an upstream round trip and beside the rest of answering a datagram. Three cases:

- refused: the policy says no; decode + build the reply (no network);
- forwarded: to an upstream on loopback (the cheapest upstream there is; a real one is
  milliseconds away) answering with a CNAME chain and an A record, addresses learned;
- refused over UDP: the resolver serving its socket, a client sending a query and waiting
  for the reply, one at a time (what a sandbox flooding its resolver costs the edge per query).

The baseline is edge/network/dns.py of a git revision (default 048d1f9, the hand-written
codec), loaded beside the current one; rounds alternate and the table gives each side's best
round (µs per query) and the ratio.

usage: python bench/bench_dns.py [--baseline REV] [--queries 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import table  # noqa: E402
from edge.network import dns as current  # noqa: E402


def _baseline(rev: str, tmp: Path) -> ModuleType:
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:edge/network/dns.py"],
        check=True,
        capture_output=True,
    ).stdout
    path = tmp / "dns_baseline.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("dns_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["dns_baseline"] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def _query() -> bytes:
    """A recursive A query for pypi.org (id 0x1234), as a stub resolver sends it."""
    name = b"".join(bytes([len(p)]) + p for p in (b"pypi", b"org")) + b"\0"
    return struct.pack("!6H", 0x1234, 0x0100, 1, 0, 0, 0) + name + struct.pack("!HH", 1, 1)


def _answer(query: bytes) -> bytes:
    """pypi.org CNAME cdn.org, cdn.org A 192.0.2.10 (compressed names)."""
    return (
        struct.pack("!6H", 0x1234, 0x8180, 1, 2, 0, 0)
        + query[12:]
        + b"\xc0\x0c"
        + struct.pack("!HHIH", 5, 1, 60, 6)
        + b"\x03cdn\xc0\x11"
        + b"\xc0\x26"
        + struct.pack("!HHIH", 1, 1, 30, 4)
        + socket.inet_aton("192.0.2.10")
    )


async def _round(modules: dict[str, Any], queries: int) -> dict[tuple[str, str], float]:
    query = _query()
    answer = _answer(query)

    class Upstream(asyncio.DatagramProtocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def datagram_received(self, data: bytes, addr: Any) -> None:
            self.transport.sendto(data[:2] + answer[2:], addr)

    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(Upstream, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]

    async def learn(client: str, name: str, addresses: list[tuple[str, int]]) -> None:
        assert addresses == [("192.0.2.10", 30)]

    out: dict[tuple[str, str], float] = {}
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.setblocking(False)
    try:
        for side, mod in modules.items():
            upstream = mod.Upstream("127.0.0.1", port)
            for case, verdict, n in (
                ("refused", None, queries),
                ("forwarded", True, queries // 10),
            ):
                resolver = mod.Resolver(upstream, lambda _c, _n, v=verdict: v, learn)
                assert await resolver.handle(query, "10.0.0.2") is not None
                t = time.perf_counter()
                for _ in range(n):
                    await resolver.handle(query, "10.0.0.2")
                out[(side, case)] = (time.perf_counter() - t) / n * 1e6
            # A refused query the whole way: a sandbox's datagram in, the reply back out.
            resolver = mod.Resolver(upstream, lambda _c, _n: None, learn)
            await resolver.start("127.0.0.1", 0)
            try:
                address = resolver._udp.get_extra_info("sockname")
                t = time.perf_counter()
                for _ in range(queries):
                    await loop.sock_sendto(client, query, address)
                    await loop.sock_recv(client, 512)
                out[(side, "udp")] = (time.perf_counter() - t) / queries * 1e6
            finally:
                await resolver.close()
    finally:
        client.close()
        transport.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="048d1f9", help="git revision of the baseline codec")
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsec-bench-dns-") as tmp:
        modules = {"baseline": _baseline(args.baseline, Path(tmp)), "dnspython": current}
        best: dict[tuple[str, str], float] = {}
        for i in range(args.rounds):
            order = modules if i % 2 == 0 else dict(reversed(list(modules.items())))
            for key, us in asyncio.run(_round(order, args.queries)).items():
                best[key] = min(best.get(key, us), us)
    rows: list[list[object]] = []
    for case, what in (
        ("refused", "refused (decode, REFUSED reply)"),
        ("forwarded", "forwarded to a loopback upstream (relay, decode, learn)"),
        ("udp", "refused, over UDP from a client socket to its reply"),
    ):
        base, now = best[("baseline", case)], best[("dnspython", case)]
        rows.append([what, base, now, f"{now / base:.2f}x"])
    table(
        f"Resolver.handle, µs per query (best of {args.rounds} alternated rounds;"
        f" baseline {args.baseline})",
        ["query", "hand-written µs", "dnspython µs", "ratio"],
        rows,
    )


if __name__ == "__main__":
    main()
