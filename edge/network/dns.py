"""The edge's DNS: a small wire-format codec, a resolver client and the sandboxes' resolver.

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

The codec handles what that needs (header, question, answer records with compression); it is
not a general DNS library.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

TYPE_A = 1
TYPE_CNAME = 5
TYPE_AAAA = 28
RCODE_NOERROR = 0
RCODE_SERVFAIL = 2
RCODE_NXDOMAIN = 3
RCODE_REFUSED = 5
MAX_UDP = 4096


class DnsError(Exception):
    pass


@dataclass
class Message:
    id: int
    flags: int
    questions: list[tuple[str, int, int]] = field(default_factory=list)  # (name, type, class)
    answers: list[tuple[str, int, int, bytes]] = field(
        default_factory=list
    )  # (name, type, ttl, rdata)

    @property
    def rcode(self) -> int:
        return self.flags & 0xF

    def addresses(self) -> list[tuple[str, int]]:
        """(address, ttl) of every A/AAAA record."""
        out = []
        for _name, rtype, ttl, rdata in self.answers:
            if rtype == TYPE_A and len(rdata) == 4:
                out.append((str(ipaddress.IPv4Address(rdata)), ttl))
            elif rtype == TYPE_AAAA and len(rdata) == 16:
                out.append((str(ipaddress.IPv6Address(rdata)), ttl))
        return out


def _read_name(data: bytes, off: int, depth: int = 0) -> tuple[str, int]:
    labels = []
    while True:
        if off >= len(data):
            raise DnsError("truncated name")
        n = data[off]
        if n & 0xC0 == 0xC0:
            if depth > 16 or off + 1 >= len(data):
                raise DnsError("bad compression pointer")
            ptr = ((n & 0x3F) << 8) | data[off + 1]
            rest, _ = _read_name(data, ptr, depth + 1)
            if rest:
                labels.append(rest)
            return ".".join(labels), off + 2
        off += 1
        if n == 0:
            return ".".join(labels), off
        if off + n > len(data):
            raise DnsError("truncated label")
        labels.append(data[off : off + n].decode("ascii", "replace"))
        off += n


def parse(data: bytes) -> Message:
    if len(data) < 12:
        raise DnsError("short message")
    mid, flags, qd, an, _ns, _ar = struct.unpack_from("!6H", data)
    msg = Message(mid, flags)
    off = 12
    for _ in range(qd):
        name, off = _read_name(data, off)
        if off + 4 > len(data):
            raise DnsError("truncated question")
        qtype, qclass = struct.unpack_from("!HH", data, off)
        off += 4
        msg.questions.append((name.lower(), qtype, qclass))
    for _ in range(an):
        name, off = _read_name(data, off)
        if off + 10 > len(data):
            raise DnsError("truncated record")
        rtype, _rclass, ttl, rdlen = struct.unpack_from("!HHIH", data, off)
        off += 10
        msg.answers.append((name.lower(), rtype, ttl, data[off : off + rdlen]))
        off += rdlen
    return msg


def encode_name(name: str) -> bytes:
    out = b""
    for label in name.rstrip(".").split("."):
        if label:
            raw = label.encode("ascii")
            if len(raw) > 63:
                raise DnsError(f"label too long in {name!r}")
            out += bytes([len(raw)]) + raw
    return out + b"\0"


def query(name: str, qtype: int, qid: int | None = None) -> bytes:
    qid = random.getrandbits(16) if qid is None else qid
    return (
        struct.pack("!6H", qid, 0x0100, 1, 0, 0, 0)
        + encode_name(name)
        + struct.pack("!HH", qtype, 1)
    )


def reply(request: bytes, rcode: int) -> bytes:
    """A header-and-question-only answer to `request` with `rcode` (NXDOMAIN, REFUSED, ...)."""
    mid, flags, qd = struct.unpack_from("!3H", request)
    end = 12
    for _ in range(qd):
        _, end = _read_name(request, end)
        end += 4
    flags = 0x8000 | (flags & 0x0100) | 0x0080 | rcode  # QR, RD copied, RA
    return struct.pack("!6H", mid, flags, qd, 0, 0, 0) + request[12:end]


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
    addresses: list[str] = []
    nx = True
    for qtype in (TYPE_A, TYPE_AAAA):
        msg = parse(exchange(upstream, query(name, qtype), timeout_s))
        if msg.rcode == RCODE_NOERROR:
            nx = False
            addresses += [a for a, _ in msg.addresses()]
        elif msg.rcode not in (RCODE_NXDOMAIN,):
            raise OSError(f"resolver {upstream.host} answered rcode {msg.rcode} for {name}")
    if nx or not addresses:
        raise Unresolvable(name)
    return addresses


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
            msg = parse(request)
        except DnsError:
            return None
        if not msg.questions or msg.flags & 0x8000:
            return None
        name = msg.questions[0][0]
        verdict = self.decide(client, name)
        if verdict is None:
            self.refused[client] = self.refused.get(client, 0) + 1
            return reply(request, RCODE_REFUSED)
        if verdict is False:
            self.refused[client] = self.refused.get(client, 0) + 1
            return reply(request, RCODE_NXDOMAIN)
        try:
            answer = await asyncio.wait_for(
                asyncio.to_thread(exchange, self.upstream, request, self.timeout_s),
                self.timeout_s + 0.5,
            )
            parsed = parse(answer)
        except (OSError, TimeoutError, DnsError) as exc:
            log.info("upstream resolver failed for %s: %s", name, exc)
            return reply(request, RCODE_SERVFAIL)
        # A CNAME chain into a denied name is refused like the name itself.
        for rname, rtype, _ttl, _rdata in parsed.answers:
            if (
                rtype in (TYPE_CNAME, TYPE_A, TYPE_AAAA)
                and rname != name
                and self.decide(client, rname) is False
            ):
                self.refused[client] = self.refused.get(client, 0) + 1
                return reply(request, RCODE_NXDOMAIN)
        addresses = parsed.addresses()
        if addresses:
            await self.learn(client, name, addresses)
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
