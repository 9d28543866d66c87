"""The edge's DNS: a resolver client and the sandboxes' resolver (messages through dnspython).

Every networked sandbox's resolv.conf names its edge (the bridge address), and its eBPF policy
refuses port 53 anywhere else, so this resolver sees every name a sandbox looks up. For each
query it decides from the sandbox's policy (`Policy.name_verdict`):

- a name a deny rule matches: NXDOMAIN (and in OPEN mode the edge also resolves denied names
  itself and blocks their addresses, so a hard-coded address does not get through);
- a name an allow rule matches: forwarded upstream; the A/AAAA addresses of the answer are
  added to the sandbox's eBPF tables *before* the answer is relayed, with that rule's ports and
  protocol, so the connect that follows is allowed -- this is how domain rules stay current as
  DNS answers change (CDNs rotate addresses);
- any other name: forwarded in OPEN mode, REFUSED in ALLOWLIST mode (no DNS tunnelling out
  through the edge).

Messages are decoded and built with dnspython; a forwarded query and its answer are relayed as
the bytes they arrived as. Names are compared as lower-case text without the final dot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype

log = logging.getLogger(__name__)

MAX_UDP = 4096

#: Any malformed message (dnspython's base error).
DnsError = dns.exception.DNSException


def name_text(name: dns.name.Name) -> str:
    """How the policy sees a name: lower case, no final dot ("" for the root)."""
    return "" if name == dns.name.root else name.to_text(omit_final_dot=True).lower()


def addresses(msg: dns.message.Message) -> list[tuple[str, int]]:
    """(address, ttl) of every A/AAAA record of the answer section."""
    return [
        (rdata.address, rrset.ttl)
        for rrset in msg.answer
        if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA)
        for rdata in rrset
    ]


def reply(request: dns.message.Message, rcode: dns.rcode.Rcode) -> bytes:
    """A header-and-question-only answer to `request` with `rcode` (NXDOMAIN, REFUSED, ...)."""
    out = dns.message.make_response(request)
    out.flags |= dns.flags.RA
    out.use_edns(False)
    out.set_rcode(rcode)
    return out.to_wire()


# ------------------------------------------------------------------------ resolving


@dataclass(frozen=True)
class Upstream:
    host: str
    port: int = 53

    @classmethod
    def parse(cls, text: str) -> Upstream:
        host, _, port = text.rpartition(":") if text.count(":") == 1 else (text, "", "")
        return cls(host or text, int(port) if port else 53)

    @classmethod
    def from_resolv_conf(cls, path: str = "/etc/resolv.conf") -> Upstream | None:
        try:
            with open(path) as fh:
                for line in fh:
                    parts = line.split()
                    if parts[:1] == ["nameserver"] and len(parts) > 1:
                        return cls(parts[1])
        except OSError:
            pass
        return None


def exchange(upstream: Upstream, request: bytes, timeout_s: float = 2.0) -> bytes:
    """One UDP round trip (blocking)."""
    fam = socket.AF_INET6 if ":" in upstream.host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout_s)
        s.connect((upstream.host, upstream.port))
        s.send(request)
        qid = request[:2]
        while True:
            data = s.recv(MAX_UDP)
            if data[:2] == qid:
                return data


class Unresolvable(Exception):
    """The name does not exist or has no address (NXDOMAIN / empty answer)."""


def resolve(upstream: Upstream, name: str, timeout_s: float = 2.0) -> list[str]:
    """A and AAAA addresses of `name` (blocking). Raises Unresolvable, or OSError when the
    resolver does not answer."""
    found: list[str] = []
    nx = True
    for qtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
        request = dns.message.make_query(name, qtype)
        msg = dns.message.from_wire(exchange(upstream, request.to_wire(), timeout_s))
        if msg.rcode() == dns.rcode.NOERROR:
            nx = False
            found += [a for a, _ in addresses(msg)]
        elif msg.rcode() != dns.rcode.NXDOMAIN:
            raise OSError(f"resolver {upstream.host} answered rcode {msg.rcode()} for {name}")
    if nx or not found:
        raise Unresolvable(name)
    return found


# -------------------------------------------------------------------------- the stub

#: (sandbox source address, query name) -> True (forward), False (NXDOMAIN), None (REFUSED)
Decide = Callable[[str, str], "bool | None"]
#: (sandbox source address, query name, [(address, ttl)]) -> awaitable, before relaying
Learn = Callable[[str, str, list[tuple[str, int]]], Awaitable[None]]


class Resolver:
    """The sandboxes' resolver on the bridge address: UDP and TCP, port 53."""

    def __init__(
        self, upstream: Upstream, decide: Decide, learn: Learn, *, timeout_s: float = 2.0
    ) -> None:
        self.upstream = upstream
        self.decide = decide
        self.learn = learn
        self.timeout_s = timeout_s
        self.refused: dict[str, int] = {}  # client address -> names refused
        self.refused_total = 0  # every name refused since the start (the edge's metrics)
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, address: str, port: int = 53) -> None:
        loop = asyncio.get_running_loop()
        resolver = self

        class _Proto(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                task = loop.create_task(resolver._answer_udp(data, addr))
                resolver._tasks.add(task)
                task.add_done_callback(resolver._tasks.discard)

        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        transport, _ = await loop.create_datagram_endpoint(_Proto, sock=sock)
        self._udp = transport  # type: ignore[assignment]
        self._tcp = await asyncio.start_server(self._serve_tcp, address, port, reuse_address=True)

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            with contextlib.suppress(Exception):
                await self._tcp.wait_closed()
        for task in list(self._tasks):
            task.cancel()

    async def handle(self, request: bytes, client: str) -> bytes | None:
        try:
            msg = dns.message.from_wire(request)
        except DnsError:
            return None
        if not msg.question or msg.flags & dns.flags.QR:
            return None
        name = name_text(msg.question[0].name)
        verdict = self.decide(client, name)
        if verdict is None:
            self.refused[client] = self.refused.get(client, 0) + 1
            self.refused_total += 1
            return reply(msg, dns.rcode.REFUSED)
        if verdict is False:
            self.refused[client] = self.refused.get(client, 0) + 1
            self.refused_total += 1
            return reply(msg, dns.rcode.NXDOMAIN)
        try:
            answer = await asyncio.wait_for(
                asyncio.to_thread(exchange, self.upstream, request, self.timeout_s),
                self.timeout_s + 0.5,
            )
            parsed = dns.message.from_wire(answer)
        except (OSError, TimeoutError, DnsError) as exc:
            log.info("upstream resolver failed for %s: %s", name, exc)
            return reply(msg, dns.rcode.SERVFAIL)
        # A CNAME chain into a denied name is refused like the name itself.
        for rrset in parsed.answer:
            rname = name_text(rrset.name)
            if (
                rrset.rdtype in (dns.rdatatype.CNAME, dns.rdatatype.A, dns.rdatatype.AAAA)
                and rname != name
                and self.decide(client, rname) is False
            ):
                self.refused[client] = self.refused.get(client, 0) + 1
                self.refused_total += 1
                return reply(msg, dns.rcode.NXDOMAIN)
        learned = addresses(parsed)
        if learned:
            await self.learn(client, name, learned)
        return answer

    async def _answer_udp(self, data: bytes, addr: tuple[str, int]) -> None:
        out = await self.handle(data, addr[0])
        if out is not None and self._udp is not None:
            self._udp.sendto(out, addr)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            while True:
                head = await asyncio.wait_for(reader.readexactly(2), 10)
                data = await reader.readexactly(struct.unpack("!H", head)[0])
                out = await self.handle(data, peer[0])
                if out is None:
                    return
                writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, TimeoutError, OSError):
            return
        finally:
            writer.close()
