"""The name gate: a connection allowed only by a domain rule goes on only if the name it asks
for is allowed, and nothing is relayed in user space.

Where a sandbox's policy allows TCP to an address only because of a domain rule (or a deny
by name might concern it), the edge's nftables rules queue that connection's packets from
the sandbox to this gate (NFQUEUE, through an iptables ``mangle FORWARD`` rule: this kernel's
nftables has no native ``queue``) until it decides. For each connection:

1. packets without payload pass: bare ACKs and FINs are not even queued (nftables tells them
   by their lengths), SYNs are, and pass at once (a SYN tells the gate that a new connection
   starts on those ports: it is decided anew);
2. packets with payload are held (not forwarded) until their bytes, read from the start of
   the stream, tell a name: a TLS ClientHello's server name or an HTTP/1.x Host
   (:func:`edge.network.peek.peek`), at most :data:`peek.MAX_PEEK_BYTES`;
3. ``decide(attempt)`` says whether it may go on: None, or why not (no name, a name the
   policy does not allow, an address the edge never resolved for that name);
4. the held packets are released with a mark: ADMIT makes conntrack remember the connection as
   admitted, and the rest of it never comes here again (the kernel forwards it as any other:
   no relay, no TLS termination, no certificates); REFUSE remembers it as refused, and the
   nftables rule answers that packet, and every later one of the connection, with a TCP
   reset. Refusals are reported through ``refused(attempt, why)``.

A client that starts a hello and does not complete it within ``peek_timeout_s`` is refused
(its held packets are reset); one that sends nothing can only receive (a server-speaks-first
protocol), and its first byte out is checked like any other. Packets the gate cannot place
are dropped, and a queue nobody reads drops everything queued to it (no ``--queue-bypass``):
the gate fails closed, also while the edge restarts. Connections admitted before a restart stay
admitted (the mark is conntrack's).

:class:`Flows` holds the per-connection logic and is pure (packets in, verdicts out);
:class:`NameGate` binds it to a netlink NFQUEUE socket on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edge.network.peek import MAX_PEEK_BYTES, NEED_MORE, Peeked, peek

log = logging.getLogger(__name__)

#: Packet marks between nftables and the gate (edge.network.links): QUEUED asks the iptables
#: rule to queue a packet; the gate's verdict marks it ADMIT or REFUSE, which nftables copies
#: to the connection's conntrack mark; PASS lets one packet through undecided.
QUEUED, ADMIT, REFUSE, PASS = 0x0D5E0000, 0x0D5E0001, 0x0D5E0002, 0
#: Not a mark: the packet is dropped (NF_DROP).
DROP = -1

TCP_FIN, TCP_SYN, TCP_RST = 0x01, 0x02, 0x04
SEQ_MOD = 1 << 32


@dataclass(frozen=True)
class Packet:
    """An IPv4 TCP packet from a sandbox, as queued."""

    packet_id: int
    client: tuple[str, int]
    destination: tuple[str, int]
    seq: int
    flags: int
    payload: bytes


def parse_packet(packet_id: int, raw: bytes) -> Packet | None:
    """The fields the gate needs from an IPv4 packet carrying TCP; None if it is not one."""
    if len(raw) < 20 or raw[0] >> 4 != 4 or raw[9] != socket.IPPROTO_TCP:
        return None
    ihl = (raw[0] & 0x0F) * 4
    total = struct.unpack_from("!H", raw, 2)[0]
    if ihl < 20 or len(raw) < ihl + 20:
        return None
    sport, dport, seq = struct.unpack_from("!HHI", raw, ihl)
    doff = (raw[ihl + 12] >> 4) * 4
    flags = raw[ihl + 13]
    if doff < 20:
        return None
    # GSO packets may say 0 (or less than they hold) in the IP length: trust the bytes then.
    end = total if ihl + doff <= total <= len(raw) else len(raw)
    return Packet(
        packet_id,
        (socket.inet_ntoa(raw[12:16]), sport),
        (socket.inet_ntoa(raw[16:20]), dport),
        seq,
        flags,
        raw[ihl + doff : end],
    )


@dataclass(frozen=True)
class Attempt:
    """A connection the gate is deciding on."""

    client: tuple[str, int]
    destination: tuple[str, int]
    peeked: Peeked | None  # None: the client said too little in time


Decide = Callable[[Attempt], str | None]
Refused = Callable[[Attempt, str], None]
Verdicts = list[tuple[int, int]]  # (packet id, mark)
_Key = tuple[tuple[str, int], tuple[str, int]]  # client, destination


@dataclass
class _Flow:
    start_seq: int  # the sequence number of the stream's first byte
    first_at: float
    segments: dict[int, bytes] = field(default_factory=dict)  # offset -> payload
    held: list[int] = field(default_factory=list)  # ids of packets not yet released
    verdict: int = 0  # ADMIT / REFUSE once decided
    last_at: float = 0.0


class Flows:
    """The gate's per-connection state and decisions; pure (the caller sends the verdicts).

    Only packets with payload make state (a SYN flood makes none), and what one sandbox can
    make the gate keep is bounded: connections being decided or just decided, and bytes held
    while a hello is incomplete. Past either bound that sandbox's connection is refused (and
    counted); other sandboxes are not affected."""

    #: Decided connections are remembered this long, for packets queued before conntrack
    #: held the verdict (an undecided one is decided by the peek timeout at the latest).
    DECIDED_KEEP_S = 5.0
    MAX_FLOWS_PER_SANDBOX = 4096
    MAX_HELD_BYTES_PER_SANDBOX = 1 << 20

    def __init__(
        self,
        decide: Decide,
        refused: Refused,
        *,
        peek_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.decide = decide
        self.refused = refused
        self.peek_timeout_s = peek_timeout_s
        self.clock = clock
        self.flows: dict[_Key, _Flow] = {}
        self._flows_of: dict[str, int] = {}  # sandbox address -> its flows
        self._held_of: dict[str, int] = {}  # sandbox address -> bytes held for it

    def packet(self, p: Packet) -> Verdicts:
        """What to do with `p` (and any packets held with it) now; [] to keep holding it."""
        now = self.clock()
        key = (p.client, p.destination)
        flow = self.flows.get(key)
        syn = bool(p.flags & TCP_SYN)
        out: Verdicts = []
        if syn and flow is not None and flow.verdict:  # a new connection on those ports
            out += self._forget(key)
            flow = None
        if not p.payload:  # nothing to read (nor to let out); no state for it
            if p.flags & TCP_RST and flow is not None and not flow.verdict:
                return [*self._forget(key), (p.packet_id, PASS)]  # what it held: dropped
            return [*out, (p.packet_id, flow.verdict if flow is not None else PASS)]
        if flow is None:
            if self._flows_of.get(p.client[0], 0) >= self.MAX_FLOWS_PER_SANDBOX:
                out += self.sweep()  # (its verdicts go out with this packet's)
            if self._flows_of.get(p.client[0], 0) >= self.MAX_FLOWS_PER_SANDBOX:
                why = "too many connections of this sandbox being decided"
                return out + self._refuse_now(p, why)
            # A SYN's sequence number is the one before the stream's first byte (TCP Fast Open
            # puts data in it); otherwise the first payload seen starts the stream.
            flow = _Flow((p.seq + 1) % SEQ_MOD if syn else p.seq, now)
            self.flows[key] = flow
            self._flows_of[p.client[0]] = self._flows_of.get(p.client[0], 0) + 1
        flow.last_at = now
        if flow.verdict:
            return [*out, (p.packet_id, flow.verdict)]
        offset = (p.seq + (1 if syn else 0) - flow.start_seq) % SEQ_MOD
        if offset >= MAX_PEEK_BYTES:  # data from beyond any first bytes (or a wrapped seq)
            return out + self._decide(key, flow, None, extra=[p.packet_id])
        if offset not in flow.segments:
            flow.segments[offset] = p.payload
            self._held_of[p.client[0]] = self._held_of.get(p.client[0], 0) + len(p.payload)
        flow.held.append(p.packet_id)
        head = self._head(flow)
        got = peek(head)
        if got is NEED_MORE and len(head) < MAX_PEEK_BYTES:
            if now - flow.first_at > self.peek_timeout_s:
                return out + self._decide(key, flow, None)
            if self._held_of[p.client[0]] > self.MAX_HELD_BYTES_PER_SANDBOX:
                why = "too many bytes held for this sandbox's hellos"
                return out + self._decide(key, flow, None, why=why)
            return out
        return out + self._decide(key, flow, got)  # NEED_MORE after MAX_PEEK_BYTES: no name

    def sweep(self) -> Verdicts:
        """Refuses connections that held packets past the peek timeout; forgets old ones."""
        now = self.clock()
        out: Verdicts = []
        for key, flow in list(self.flows.items()):
            if flow.verdict:
                if now - flow.last_at > self.DECIDED_KEEP_S:
                    out += self._forget(key)
            elif now - flow.first_at > self.peek_timeout_s:  # (an undecided flow holds some)
                out += self._decide(key, flow, None)
        return out

    def _forget(self, key: _Key) -> Verdicts:
        """Drops the connection's state; packets it still held are dropped (DROP)."""
        flow = self.flows.pop(key)
        client = key[0][0]
        dropped = [(pid, DROP) for pid in flow.held]
        self._release(client, flow)
        _take(self._flows_of, client, 1)
        return dropped

    def _release(self, client: str, flow: _Flow) -> None:
        _take(self._held_of, client, sum(map(len, flow.segments.values())))
        flow.held, flow.segments = [], {}

    def _refuse_now(self, p: Packet, why: str) -> Verdicts:
        self.refused(Attempt(p.client, p.destination, None), why)
        return [(p.packet_id, REFUSE)]

    @staticmethod
    def _head(flow: _Flow) -> bytes:
        """The stream's bytes from its start, as far as they are contiguous."""
        head = b""
        while (seg := flow.segments.get(len(head))) is not None:
            head += seg
        # A retransmission may start inside what we have: take its new bytes too.
        for offset, seg in sorted(flow.segments.items()):
            if offset < len(head) < offset + len(seg):
                head += seg[len(head) - offset :]
        return head[:MAX_PEEK_BYTES]

    def _decide(
        self,
        key: _Key,
        flow: _Flow,
        peeked: Peeked | None,
        extra: list[int] | None = None,
        why: str | None = None,
    ) -> Verdicts:
        client, destination = key
        attempt = Attempt(client, destination, peeked)
        if why is None:
            why = self.decide(attempt)
        flow.verdict = ADMIT if why is None else REFUSE
        if why is not None:
            self.refused(attempt, why)
        held = flow.held + (extra or [])
        self._release(client[0], flow)
        return [(pid, flow.verdict) for pid in held]


def _take(counts: dict[str, int], key: str, n: int) -> None:
    """``counts[key] -= n``; a count that reaches 0 is removed (the dicts stay as small as
    the number of sandboxes with something in the gate)."""
    if not n:
        return
    if (left := counts[key] - n) > 0:
        counts[key] = left
    else:
        del counts[key]


# ----------------------------------------------------------------------------- NFQUEUE

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLMSG_ERROR = 0x2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR, NFQA_MARK, NFQA_PAYLOAD = 1, 2, 3, 10
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_UNBIND = 1, 2
NFQNL_COPY_PACKET = 2
NFQA_CFG_F_GSO = 0x4  # GSO packets queued whole, not segmented first
NF_DROP, NF_ACCEPT = 0, 1
QUEUE_MAXLEN = 8192
RCVBUF_BYTES = 16 << 20
_NLMSG = struct.Struct("=IHHII")


def _attr(kind: int, data: bytes) -> bytes:
    n = 4 + len(data)
    return struct.pack("=HH", n, kind) + data + b"\0" * (-n % 4)


def _attrs(buf: memoryview) -> dict[int, memoryview]:
    out: dict[int, memoryview] = {}
    off = 0
    while off + 4 <= len(buf):
        n, kind = struct.unpack_from("=HH", buf, off)
        if n < 4:
            break
        out[kind & 0x7FFF] = buf[off + 4 : off + n]
        off += (n + 3) & ~3
    return out


class NameGate:
    """A :class:`Flows` on NFQUEUE `queue`, driven by the running event loop."""

    def __init__(self, decide: Decide, refused: Refused, *, peek_timeout_s: float = 5.0) -> None:
        self.flows = Flows(decide, refused, peek_timeout_s=peek_timeout_s)
        self.queue = 0
        self._sock: socket.socket | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._seq = 0

    async def start(self, queue: int) -> None:
        """Binds NFQUEUE `queue` (OSError EBUSY: another process has it) and starts serving."""
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            sock.bind((0, 0))
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, 33, RCVBUF_BYTES)  # SO_RCVBUFFORCE
            self.queue = queue
            self._sock = sock
            self._config(_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 2)))
            self._config(
                _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0xFFFF, NFQNL_COPY_PACKET))
                + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))
                + _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO))
                + _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO))
            )
        except BaseException:
            self._sock = None
            sock.close()
            raise
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), self._readable)
        self._sweeper = loop.create_task(self._sweep_loop())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(BaseException):
                await self._sweeper
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()  # the kernel drops what is still queued: closed, not open
            self._sock = None

    def _message(self, kind: int, flags: int, payload: bytes) -> bytes:
        self._seq += 1
        body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(self.queue)) + payload
        head = _NLMSG.pack(
            _NLMSG.size + len(body),
            (NFNL_SUBSYS_QUEUE << 8) | kind,
            NLM_F_REQUEST | flags,
            self._seq,
            0,
        )
        return head + body

    def _config(self, payload: bytes) -> None:
        """One configuration request, acknowledged (blocking: at start only)."""
        assert self._sock is not None
        self._sock.send(self._message(NFQNL_MSG_CONFIG, NLM_F_ACK, payload))
        while True:
            data = self._sock.recv(65536)
            _, kind, _, seq, _ = _NLMSG.unpack_from(data)
            if kind == NLMSG_ERROR and seq == self._seq:
                err = struct.unpack_from("=i", data, _NLMSG.size)[0]
                if err:
                    raise OSError(-err, f"NFQUEUE {self.queue}: {os.strerror(-err)}")
                return

    def _readable(self) -> None:
        assert self._sock is not None
        verdicts: Verdicts = []
        for _ in range(64):  # then let the loop run other work; the reader fires again
            try:
                data = self._sock.recv(1 << 17)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:  # the kernel dropped some: clients resend
                    log.warning("name gate: queue %d overran; packets dropped", self.queue)
                    continue
                raise
            verdicts += self._packets(memoryview(data))
        if verdicts:
            self._send(verdicts)

    def _packets(self, data: memoryview) -> Verdicts:
        out: Verdicts = []
        off = 0
        while off + _NLMSG.size <= len(data):
            length, kind, _, _, _ = _NLMSG.unpack_from(data, off)
            if length < _NLMSG.size:
                break
            if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                attrs = _attrs(data[off + _NLMSG.size + 4 : off + length])
                hdr = attrs.get(NFQA_PACKET_HDR)
                if hdr is not None:
                    packet_id = struct.unpack_from("!I", hdr)[0]
                    p = parse_packet(packet_id, bytes(attrs.get(NFQA_PAYLOAD, b"")))
                    if p is None:
                        out.append((packet_id, DROP))  # not IPv4 TCP: not ours to pass
                    else:
                        out += self.flows.packet(p)
            off += (length + 3) & ~3
        return out

    def _send(self, verdicts: Verdicts) -> None:
        assert self._sock is not None
        batch = b"".join(
            self._message(
                NFQNL_MSG_VERDICT,
                0,
                _attr(
                    NFQA_VERDICT_HDR, struct.pack("!II", NF_DROP if m == DROP else NF_ACCEPT, pid)
                )
                + (_attr(NFQA_MARK, struct.pack("!I", m)) if m != DROP else b""),
            )
            for pid, m in verdicts
        )
        try:
            self._sock.send(batch)
        except OSError as exc:  # unsent verdicts: those packets are dropped when we unbind
            log.warning("name gate: sending %d verdicts failed: %s", len(verdicts), exc)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            if verdicts := self.flows.sweep():
                self._send(verdicts)
