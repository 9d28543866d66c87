"""edge.network.namegate's decisions, packet by packet: packets without payload pass, the first
bytes are held until they tell a name, then every held packet is released admitted or refused;
later packets of a decided connection get its verdict; a client that says nothing in time is
refused. Packets here are real IPv4/TCP headers around real ClientHellos from Python's TLS
client; the NFQUEUE path through the kernel is covered by tests/adversarial/test_name_gate.py.
"""

from __future__ import annotations

import socket
import struct

from edge.network.namegate import ADMIT, DROP, PASS, REFUSE, Attempt, Flows, parse_packet
from tests.helpers import client_hello

CLIENT = ("10.233.0.7", 40000)
SERVER = ("151.101.0.223", 443)
ISN = 0xFFFFFF00  # near the wrap: offsets are taken modulo 2**32
ACK, SYN, RST = 0x10, 0x02, 0x04


def ipv4_tcp(seq: int, flags: int, payload: bytes = b"", client: tuple[str, int] = CLIENT) -> bytes:
    tcp = struct.pack(
        "!HHIIBBHHH", client[1], SERVER[1], seq % 2**32, 1, 5 << 4, flags, 65535, 0, 0
    )
    ip = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp) + len(payload), 1, 0, 64, 6, 0,
        socket.inet_aton(client[0]), socket.inet_aton(SERVER[0]),
    )  # fmt: skip
    return ip + tcp + payload


class Gate:
    """Flows with a hand-driven clock, a decide that allows pypi.org, and its refusals."""

    def __init__(self) -> None:
        self.now = 100.0
        self.refusals: list[tuple[Attempt, str]] = []
        self.flows = Flows(
            self.decide, lambda a, why: self.refusals.append((a, why)), clock=lambda: self.now
        )
        self.next_id = 0

    @staticmethod
    def decide(a: Attempt) -> str | None:
        if a.peeked is None or not a.peeked.name:
            return "no name"
        return None if a.peeked.name == "pypi.org" else f"name {a.peeked.name} not allowed"

    def send(
        self, seq: int, flags: int, payload: bytes = b"", **kw: tuple[str, int]
    ) -> list[tuple[int, int]]:
        self.next_id += 1
        p = parse_packet(self.next_id, ipv4_tcp(seq, flags, payload, **kw))
        assert p is not None
        return self.flows.packet(p)

    def handshake(self, **kw: tuple[str, int]) -> None:
        assert self.send(ISN, SYN, **kw) == [(self.next_id, PASS)]
        assert self.send(ISN + 1, ACK, **kw) == [(self.next_id, PASS)]


def test_a_packet_is_parsed_for_its_addresses_ports_and_payload() -> None:
    p = parse_packet(7, ipv4_tcp(ISN, ACK, b"hello"))
    assert p is not None
    assert (p.packet_id, p.client, p.destination, p.seq, p.payload) == (
        7,
        CLIENT,
        SERVER,
        ISN,
        b"hello",
    )
    assert parse_packet(1, b"\x60" + bytes(59)) is None  # IPv6
    assert parse_packet(1, ipv4_tcp(ISN, ACK)[:30]) is None  # truncated


def test_an_allowed_name_in_one_segment_is_admitted_and_stays_admitted() -> None:
    g = Gate()
    g.handshake()
    assert g.send(ISN + 1, ACK, client_hello("pypi.org")) == [(g.next_id, ADMIT)]
    hello_len = len(client_hello("pypi.org"))
    assert g.send(ISN + 1 + hello_len, ACK, b"more") == [(g.next_id, ADMIT)]  # queued before
    assert not g.refusals


def test_a_hello_over_several_segments_is_held_then_released_together() -> None:
    g = Gate()
    g.handshake()
    hello = client_hello("pypi.org")
    first = g.next_id + 1
    assert g.send(ISN + 1, ACK, hello[:100]) == []  # held: not forwarded yet
    assert g.send(ISN + 1, ACK, hello[:100]) == []  # a retransmission, held too
    assert g.send(ISN + 1, ACK) == [(g.next_id, PASS)]  # a bare ACK meanwhile passes
    assert g.send(ISN + 101, ACK, hello[100:]) == [
        (first, ADMIT), (first + 1, ADMIT), (g.next_id, ADMIT)
    ]  # fmt: skip


def test_a_denied_name_no_name_and_raw_bytes_are_refused_and_reported() -> None:
    g = Gate()
    for port, payload in enumerate(
        (
            client_hello("registry.npmjs.org"),
            b"GET / HTTP/1.1\r\nHost: npmjs.org\r\n\r\n",
            client_hello(None),
            b"\x00raw tcp\r\n\r\n",
        ),
        start=50000,
    ):
        client = (CLIENT[0], port)
        g.handshake(client=client)
        assert g.send(ISN + 1, ACK, payload, client=client) == [(g.next_id, REFUSE)]
        assert g.send(ISN + 1, ACK, client=client) == [(g.next_id, REFUSE)]  # then every packet
    assert [why for _, why in g.refusals] == [
        "name registry.npmjs.org not allowed", "name npmjs.org not allowed", "no name", "no name"
    ]  # fmt: skip
    assert g.refusals[0][0].client == (CLIENT[0], 50000) and g.refusals[0][0].destination == SERVER


def test_a_hello_not_completed_in_time_is_refused_and_a_silent_client_only_receives() -> None:
    g = Gate()
    g.handshake()
    held = g.next_id + 1
    assert g.send(ISN + 1, ACK, client_hello("pypi.org")[:50]) == []
    g.now += 6  # past the 5 s peek timeout: the sweep refuses what it holds
    assert g.flows.sweep() == [(held, REFUSE)]
    assert g.refusals[0][0].peeked is None
    # a server-speaks-first connection: bare ACKs pass whenever they come; the first bytes
    # out are read like any other's
    g2 = Gate()
    g2.handshake()
    g2.now += 60
    assert g2.send(ISN + 1, ACK) == [(g2.next_id, PASS)]
    assert g2.send(ISN + 1, ACK, b"\x00raw\r\n") == [(g2.next_id, REFUSE)]


def test_data_far_from_the_streams_start_is_refused_and_a_reset_forgets_the_flow() -> None:
    g = Gate()
    g.handshake()
    assert g.send(ISN + 1 + (1 << 20), ACK, b"x") == [(g.next_id, REFUSE)]
    g2 = Gate()
    g2.handshake()
    assert g2.send(ISN + 1, RST) == [(g2.next_id, PASS)]
    assert not g2.flows.flows


def test_a_new_connection_on_a_decided_four_tuple_is_decided_anew() -> None:
    g = Gate()
    g.handshake()
    assert g.send(ISN + 1, ACK, client_hello("github.com")) == [(g.next_id, REFUSE)]
    g.handshake()  # the same ports again: a SYN starts over
    assert g.send(ISN + 1, ACK, client_hello("pypi.org")) == [(g.next_id, ADMIT)]


def test_decided_flows_are_forgotten_and_bare_packets_make_no_state() -> None:
    g = Gate()
    g.handshake()  # SYN, ACK: passed, nothing kept (a SYN flood makes no state)
    assert not g.flows.flows
    g.send(ISN + 1, ACK, client_hello("pypi.org"))
    assert len(g.flows.flows) == 1
    g.now += Flows.DECIDED_KEEP_S + 1
    assert g.flows.sweep() == [] and not g.flows.flows


def test_a_reset_drops_what_was_held() -> None:
    g = Gate()
    g.handshake()
    held = g.next_id + 1
    assert g.send(ISN + 1, ACK, client_hello("pypi.org")[:50]) == []
    assert g.send(ISN + 1, RST) == [(held, DROP), (g.next_id, PASS)]  # never let out
    assert not g.flows.flows and not g.refusals


def test_what_one_sandbox_makes_the_gate_keep_is_bounded() -> None:
    """Past its bounds a sandbox's connection is refused and counted; another sandbox's are
    decided as before."""
    g = Gate()
    g.flows.MAX_FLOWS_PER_SANDBOX = 3  # type: ignore[misc]
    half = client_hello("pypi.org")[:50]
    for port in range(3):  # three half hellos, held
        assert g.send(ISN + 1, ACK, half, client=(CLIENT[0], port)) == []
    assert g.send(ISN + 1, ACK, half, client=(CLIENT[0], 9)) == [(g.next_id, REFUSE)]
    assert g.refusals[-1][1] == "too many connections of this sandbox being decided"
    other = ("10.233.0.8", 40000)
    assert g.send(ISN + 1, ACK, client_hello("pypi.org"), client=other) == [(g.next_id, ADMIT)]
    # bytes held: a sandbox's incomplete hellos may hold at most so much
    g2 = Gate()
    g2.flows.MAX_HELD_BYTES_PER_SANDBOX = 120  # type: ignore[misc]
    assert g2.send(ISN + 1, ACK, half, client=(CLIENT[0], 1)) == []
    assert g2.send(ISN + 1, ACK, half, client=(CLIENT[0], 2)) == []
    assert g2.send(ISN + 1, ACK, half, client=(CLIENT[0], 3)) == [(g2.next_id, REFUSE)]
    assert g2.refusals[-1][1] == "too many bytes held for this sandbox's hellos"
