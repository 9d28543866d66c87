"""Network policies without sockets or eBPF: parsing, errors naming the rule, compilation into
the tables the kernel programs read (checked by evaluating them here exactly as the program
does: longest-prefix match, then first matching rule), and the sandboxes' DNS resolver."""

from __future__ import annotations

import ipaddress
import socket
import struct
from typing import Any

import pytest

from edge.network import dns
from edge.network.policy import (
    PROTO_TCP,
    PROTO_UDP,
    Platform,
    Policy,
    Tables,
    check_compilable,
    compile_tables,
    gated,
    parse,
    parse_network,
)
from edge.network.programs import (
    ACTION_ALLOW,
    ACTION_END,
    RULE_SIZE,
    RULES_PER_ENTRY,
    ipv4_program,
    ipv6_program,
    lpm_key,
)
from libdsec.errors import InvalidArgument
from libdsec.types import NetworkPolicy

PLATFORM = Platform(ipaddress.IPv4Network("10.231.0.0/16"), ipaddress.IPv4Address("10.231.0.1"))


def _policy(**kw: Any) -> Policy:
    from google.protobuf import json_format

    pb = NetworkPolicy(**kw).to_pb()
    return parse(json_format.MessageToDict(pb, preserving_proto_field_name=True))


def verdict(tables: Tables, ip: str, port: int, proto: int = PROTO_TCP) -> bool:
    """What the eBPF program answers for a connect to ip:port (True = allowed)."""
    addr = ipaddress.ip_address(ip)
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    entries = tables.v4 if addr.version == 4 else tables.v6
    bits = addr.max_prefixlen
    value = None
    for plen in range(bits, -1, -1):
        net = int(addr) >> (bits - plen) << (bits - plen) if plen else 0
        value = entries.get((plen, net.to_bytes(bits // 8, "big")))
        if value is not None:
            break
    assert value is not None, "0/0 is always present"
    for i in range(RULES_PER_ENTRY):
        lo, hi, p, action = struct.unpack_from("<HHBB", value, i * RULE_SIZE)
        if action == ACTION_END:
            return False
        if (p == 0 or p == proto) and lo <= port <= hi:
            return action == ACTION_ALLOW
    return False


def test_the_papers_example() -> None:
    policy = _policy(allow=["pypi.org:443"], deny=["registry.npmjs.org"])
    tables = compile_tables(
        policy, PLATFORM, {"pypi.org": ["151.101.0.223"], "registry.npmjs.org": ["104.16.1.34"]}
    )
    assert verdict(tables, "151.101.0.223", 443)
    assert not verdict(tables, "151.101.0.223", 80)
    assert not verdict(tables, "104.16.1.34", 443)  # not allowed by anything
    assert not verdict(tables, "8.8.8.8", 443)  # allowlist: everything else is refused
    assert policy.name_verdict("pypi.org") is True
    assert policy.name_verdict("REGISTRY.npmjs.org.") is False
    assert policy.name_verdict("github.com") is None


def test_two_names_on_one_address_are_the_gates_to_decide() -> None:
    """An allow and a deny by name on one (CDN) address: the tries let TCP to it through to
    the name gate (the deny is the gate's: by address it would refuse the allowed name too);
    UDP to it is refused (no name to check)."""
    policy = _policy(allow=["pypi.org:443"], deny=["registry.npmjs.org"])
    shared = {"pypi.org": ["151.101.0.223"], "registry.npmjs.org": ["151.101.0.223"]}
    tables = compile_tables(policy, PLATFORM, shared)
    assert verdict(tables, "151.101.0.223", 443)
    assert not verdict(tables, "151.101.0.223", 443, PROTO_UDP)
    assert gated(policy, shared) == {("151.101.0.223", 443, 443)}
    assert [r.where for r in policy.name_allows("PyPI.org.", 443)] == ["allow[0]"]
    assert policy.name_allows("pypi.org", 80) == ()
    assert policy.name_allows("registry.npmjs.org", 443) == ()
    assert policy.name_allows("github.com", 443) == ()
    assert not policy.gates_everything
    assert _policy(open=True, deny=["registry.npmjs.org"]).gates_everything
    assert not _policy(open=True, deny=["10.0.0.0/8"]).gates_everything


def test_ports_an_ip_rule_opens_on_a_names_address_keep_the_fast_path() -> None:
    """An IP or CIDR allow covering a name's address: its ports go direct (no name needed),
    the name rule's other ports go to the gate; OPEN gates nothing by address."""
    shared = {"pypi.org": ["151.101.0.223", "151.101.64.223"]}
    policy = _policy(allow=["pypi.org", "151.101.0.0/18:443", "151.101.0.223:8000-8080"])
    assert gated(policy, shared) == {
        ("151.101.0.223", 0, 442),
        ("151.101.0.223", 444, 7999),
        ("151.101.0.223", 8081, 65535),
        ("151.101.64.223", 0, 65535),  # outside the /18
    }
    assert gated(_policy(allow=["pypi.org:443", "151.101.0.0/16"]), shared) == set()
    udp_only = _policy(allow=["pypi.org:443", "151.101.0.0/16:443/udp"])
    assert gated(udp_only, shared) == {("151.101.0.223", 443, 443), ("151.101.64.223", 443, 443)}
    assert gated(_policy(open=True, allow=["pypi.org:443"]), shared) == set()


def test_a_domain_rule_for_udp_is_refused() -> None:
    with pytest.raises(InvalidArgument) as err:
        parse({"mode": "NETWORK_MODE_ALLOWLIST", "allow": [
            {"target": "pypi.org", "port_min": 443, "protocol": "PROTOCOL_UDP"}]})  # fmt: skip
    assert "allow[0]" in err.value.message and "UDP" in err.value.message


def test_open_mode_deny_wins_over_allow_and_over_the_default() -> None:
    policy = _policy(open=True, deny=["10.0.0.0/8", "203.0.113.7:22/tcp"], allow=["10.1.2.3"])
    tables = compile_tables(policy, PLATFORM)
    assert verdict(tables, "8.8.4.4", 443)
    assert not verdict(tables, "10.1.2.3", 80)  # deny beats a more specific allow
    assert not verdict(tables, "203.0.113.7", 22)
    assert verdict(tables, "203.0.113.7", 22, PROTO_UDP)
    assert verdict(tables, "203.0.113.7", 23)
    assert verdict(tables, "2001:db8::1", 443)


def test_platform_rules_come_first() -> None:
    tables = compile_tables(_policy(open=True, allow=["0.0.0.0/0"]), PLATFORM)
    assert verdict(tables, "127.0.0.1", 5000) and verdict(tables, "::1", 5000)
    assert verdict(tables, "::ffff:127.0.0.1", 5000)
    assert verdict(tables, "10.231.0.1", 53, PROTO_UDP)  # the edge's resolver
    assert not verdict(tables, "10.231.0.1", 22)  # the host behind it
    assert not verdict(tables, "10.231.0.9", 8080)  # another sandbox
    assert not verdict(tables, "8.8.8.8", 53, PROTO_UDP)  # DNS elsewhere
    assert not verdict(tables, "169.254.169.254", 80)  # cloud metadata
    assert not verdict(tables, "fe80::1", 80)
    # Not even the user can open them.
    tables = compile_tables(_policy(allow=["10.231.0.9:8080", "169.254.169.254"]), PLATFORM)
    assert not verdict(tables, "10.231.0.9", 8080) and not verdict(tables, "169.254.169.254", 80)


def test_port_ranges_and_protocols() -> None:
    tables = compile_tables(_policy(allow=["192.0.2.0/24:8000-8010/udp"]), PLATFORM)
    assert verdict(tables, "192.0.2.9", 8005, PROTO_UDP)
    assert not verdict(tables, "192.0.2.9", 8005, PROTO_TCP)
    assert not verdict(tables, "192.0.2.9", 8011, PROTO_UDP)
    assert not verdict(tables, "192.0.3.9", 8005, PROTO_UDP)


def test_a_thousand_rules_compile_to_one_entry_each() -> None:
    allow = [f"10.{i // 250}.{i % 250}.7:443" for i in range(1000)]
    tables = compile_tables(_policy(allow=allow), PLATFORM)
    assert len(tables) < 1000 + 20
    assert verdict(tables, "10.3.249.7", 443) and not verdict(tables, "10.3.249.8", 443)


@pytest.mark.parametrize(
    ("raw", "where", "fragment"),
    [
        ({"allow": [{"target": "10.0.0.0/33"}]}, "allow[0]", "prefix length"),
        ({"allow": [{"target": "1.2.3.4"}, {"target": "300.1.1.1"}]}, "allow[1]", "address"),
        ({"deny": [{"target": "example.com", "port_min": 70000}]}, "deny[0]", "out of range"),
        ({"allow": [{"target": "x.org", "port_min": 90, "port_max": 80}]}, "allow[0]", "empty"),
        ({"allow": [{"target": "x.org", "port_max": 80}]}, "allow[0]", "out of range"),
        ({"allow": [{"target": "bad_name!.org"}]}, "allow[0]", "domain name"),
        ({"allow": [{"target": "*.org"}]}, "allow[0]", "wildcard"),
        ({"allow": [{"target": "x.org"}, {"target": "a.*.org"}]}, "allow[1]", "whole first label"),
        ({"deny": [{"target": "pypi*.org"}]}, "deny[0]", "whole first label"),
        ({"allow": [{"target": "a..org"}]}, "allow[0]", "empty label"),
        ({"allow": [{"target": ".pypi.org"}]}, "allow[0]", "empty label"),
        ({"allow": [{"target": ("a" * 60 + ".") * 5 + "org"}]}, "allow[0]", "253 characters"),
        ({"allow": [{"target": "a" * 64 + ".org"}]}, "allow[0]", "63 characters"),
        ({"allow": [{"target": ""}]}, "allow[0]", "empty"),
        ({"allow": [{"target": "x.org", "protocol": "PROTOCOL_SCTP"}]}, "allow[0]", "protocol"),
    ],
)
def test_malformed_rules_are_named(raw: dict[str, Any], where: str, fragment: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse({"mode": "NETWORK_MODE_OPEN", **raw})
    assert err.value.reason == "INVALID_NETWORK_POLICY"
    assert where in err.value.message and fragment in err.value.message
    assert err.value.metadata["rule"] == where


def test_mode_none_takes_no_rules_and_is_the_default() -> None:
    assert not parse({}).networked
    assert not parse(None).networked
    with pytest.raises(InvalidArgument):
        parse({"mode": "NETWORK_MODE_NONE", "allow": [{"target": "1.1.1.1"}]})
    with pytest.raises(InvalidArgument):
        parse({"mode": "NETWORK_MODE_NOPE"})


def test_too_many_rules_on_one_range_are_refused() -> None:
    policy = _policy(allow=[f"192.0.2.0/24:{p}" for p in range(1, 40)])
    with pytest.raises(InvalidArgument) as err:
        check_compilable(policy, PLATFORM)
    assert "192.0.2.0/24" in err.value.message


def test_wildcards_match_names_below() -> None:
    policy = _policy(allow=["*.pythonhosted.org:443"], deny=["evil.pythonhosted.org"])
    assert policy.name_verdict("files.pythonhosted.org") is True
    assert policy.name_verdict("pythonhosted.org") is None
    assert policy.name_verdict("evil.pythonhosted.org") is False


def test_parse_network() -> None:
    assert parse_network("10.1.2.3/8") == (4, 10 << 24, 8)
    assert parse_network("::1") == (6, 1, 128)
    with pytest.raises(ValueError):
        parse_network("10.1.2/8")


def test_programs_assemble_within_limits() -> None:
    for prog in (ipv4_program((3, 4), 5, 6), ipv6_program((3, 4), (7, 8), 5, 6)):
        assert 100 < len(prog) < 4096
        assert prog[-1].code == 0x95  # exit
    assert lpm_key(24, bytes([10, 1, 2, 0])) == struct.pack("<I", 24) + bytes([10, 1, 2, 0])


def _answer(query: bytes) -> bytes:
    """An upstream answer to `query` with a compressed name and a CNAME chain."""
    return (
        struct.pack("!6H", 0x1234, 0x8180, 1, 2, 0, 0)
        + query[12:]
        + b"\xc0\x0c"
        + struct.pack("!HHIH", 5, 1, 60, 6)  # CNAME
        + b"\x03cdn\xc0\x11"
        + b"\xc0\x26"
        + struct.pack("!HHIH", 1, 1, 30, 4)  # A
        + socket.inet_aton("192.0.2.10")
    )


async def test_dns_resolver_answers_refuses_and_learns() -> None:
    """The sandboxes' resolver: a denied name gets NXDOMAIN, an unlisted one REFUSED (both a
    header-and-question reply), an allowed one is relayed as upstream sent it after its
    addresses were learned, and a CNAME chain into a denied name is refused like the name."""
    import asyncio

    import dns.flags as dns_flags
    import dns.message as dns_message
    import dns.rcode as dns_rcode

    query = dns_message.make_query("PyPI.org", "A", id=0x1234).to_wire()
    answer = _answer(query)

    class _Upstream(asyncio.DatagramProtocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def datagram_received(self, data: bytes, addr: Any) -> None:
            self.transport.sendto(data[:2] + answer[2:], addr)

    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(_Upstream, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    verdicts: dict[str, bool | None] = {"pypi.org": True, "cdn.org": True}
    learned: list[tuple[str, str, list[tuple[str, int]]]] = []

    async def learn(client: str, name: str, addrs: list[tuple[str, int]]) -> None:
        learned.append((client, name, addrs))

    resolver = dns.Resolver(
        dns.Upstream("127.0.0.1", port), lambda _c, n: verdicts.get(n), learn, timeout_s=2.0
    )
    try:
        assert await resolver.handle(query, "10.0.0.2") == answer
        assert learned == [("10.0.0.2", "pypi.org", [("192.0.2.10", 30)])]
        for verdict, rcode in ((False, dns_rcode.NXDOMAIN), (None, dns_rcode.REFUSED)):
            verdicts["pypi.org"] = verdict
            out = await resolver.handle(query, "10.0.0.2")
            assert out is not None
            reply = dns_message.from_wire(out)
            assert (reply.id, reply.rcode(), reply.answer) == (0x1234, rcode, [])
            assert (
                reply.flags & dns_flags.QR
                and reply.question == dns_message.from_wire(query).question
            )
        verdicts["pypi.org"], verdicts["cdn.org"] = True, False
        out = await resolver.handle(query, "10.0.0.2")
        assert out is not None and dns_message.from_wire(out).rcode() == dns_rcode.NXDOMAIN
        assert resolver.refused == {"10.0.0.2": 3}
        assert await resolver.handle(b"\x00\x01", "10.0.0.2") is None  # malformed: dropped
    finally:
        transport.close()
