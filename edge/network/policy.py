"""Network policies: parsing and validation, and compilation into the eBPF rule tables.

Pure code (no sockets, no syscalls): `parse` turns a NetworkPolicy (as the dict the edge keeps in
its records) into rules or raises InvalidArgument naming the offending rule; `compile_tables`
turns rules plus the addresses the edge resolved for domain names into LPM-trie entries for
`edge.network.programs`.

Semantics (types.proto NetworkPolicy): ALLOWLIST = egress only where an allow rule matches and no
deny rule does; OPEN = egress anywhere no deny rule matches; NONE = no interface but loopback.
Deny wins over allow. On top of the user's rules the platform adds, always:

    allow  loopback, the sandbox's own address, the edge's DNS resolver on port 53
    deny   the node's sandbox subnet (other sandboxes, the gateway), link-local addresses (cloud
           metadata at 169.254.169.254), DNS to anywhere else (port 53), multicast

Compilation: one LPM-trie entry per distinct prefix (rule CIDRs, resolved addresses as /32 or
/128, the platform's prefixes, and 0/0), whose list holds its own rules and those of every
shorter prefix containing it, ordered platform allows, platform denies, user denies, user
allows, mode default. The kernel then needs one longest-prefix lookup and a first-match scan.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from edge.network.programs import (
    ACTION_ALLOW,
    ACTION_DENY,
    RULES_PER_ENTRY,
    encode_rules,
)
from libdsec.errors import InvalidArgument

MODE_NONE = "NONE"
MODE_ALLOWLIST = "ALLOWLIST"
MODE_OPEN = "OPEN"

PROTO_ANY, PROTO_TCP, PROTO_UDP = 0, 6, 17
_PROTOCOLS = {
    "PROTOCOL_UNSPECIFIED": PROTO_ANY,
    "PROTOCOL_TCP": PROTO_TCP,
    "PROTOCOL_UDP": PROTO_UDP,
    0: PROTO_ANY,
    1: PROTO_TCP,
    2: PROTO_UDP,
}
_MODES = {
    "": MODE_NONE,
    "NETWORK_MODE_UNSPECIFIED": MODE_NONE,
    "NETWORK_MODE_NONE": MODE_NONE,
    "NETWORK_MODE_ALLOWLIST": MODE_ALLOWLIST,
    "NETWORK_MODE_OPEN": MODE_OPEN,
    0: MODE_NONE,
    1: MODE_NONE,
    2: MODE_ALLOWLIST,
    3: MODE_OPEN,
}
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")
MAX_RULES = 10_000

# priority levels of compiled rules (lower first)
_PLATFORM_ALLOW, _PLATFORM_DENY, _USER_DENY, _USER_ALLOW, _DEFAULT = range(5)

#: (IP version, network address as an integer, prefix length): cheaper than ipaddress objects,
#: which matters for a 1,000-rule policy replaced within the 10 ms budget.
Network = tuple[int, int, int]


def parse_network(text: str) -> Network:
    """ "a.b.c.d", "a.b.c.d/n", "v6", "v6/n" -> Network (host bits cleared); ValueError if bad."""
    addr, sep, plen_text = text.partition("/")
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        packed = socket.inet_pton(family, addr)
    except OSError:
        raise ValueError(
            f"{addr!r} is not an IPv{6 if family == socket.AF_INET6 else 4} address"
        ) from None
    bits = len(packed) * 8
    if sep:
        if not plen_text.isdigit() or not 0 <= int(plen_text) <= bits:
            raise ValueError(f"prefix length {plen_text!r} is not in 0..{bits}")
        plen = int(plen_text)
    else:
        plen = bits
    value = int.from_bytes(packed, "big")
    value = value >> (bits - plen) << (bits - plen) if plen else 0
    return (4 if bits == 32 else 6, value, plen)


@dataclass(frozen=True)
class Rule:
    """One user rule. Exactly one of `network` and `domain` is set."""

    where: str  # "allow[3]" / "deny[0]": how errors and logs name it
    text: str  # the target as given
    network: Network | None
    domain: str | None  # lower case, no trailing dot; may start with "*."
    port_min: int  # 0..65535; (0, 65535) = any
    port_max: int
    protocol: int  # PROTO_ANY / PROTO_TCP / PROTO_UDP
    allow: bool

    def matches_name(self, name: str) -> bool:
        if self.domain is None:
            return False
        if self.domain.startswith("*."):
            return name.endswith(self.domain[1:]) and name != self.domain[2:]
        return name == self.domain


@dataclass(frozen=True)
class Policy:
    mode: str
    rules: tuple[Rule, ...] = ()
    #: Terminate the sandbox (POLICY_VIOLATION) after this many blocked connects; 0 = never.
    max_blocked_connects: int = 0

    @property
    def networked(self) -> bool:
        return self.mode != MODE_NONE

    @property
    def domains(self) -> tuple[Rule, ...]:
        return tuple(r for r in self.rules if r.domain is not None)

    @property
    def gates_everything(self) -> bool:
        """OPEN with a deny by name: any TCP connection may be to that name (on an address
        no one resolved for it), so every one not allowed by an IP rule goes to the gate."""
        return self.mode == MODE_OPEN and any(r.domain and not r.allow for r in self.rules)

    def name_denied(self, name: str, port: int) -> Rule | None:
        """The deny-by-name rule that refuses a TCP connection asking for `name` on `port`."""
        return next(self._by_name(name, port, allow=False), None)

    def name_allows(self, name: str, port: int) -> tuple[Rule, ...]:
        """The allow rules under which a TCP connection asking for `name` on `port` may go on
        (none if a deny by name matches: deny wins)."""
        if self.name_denied(name, port) is not None:
            return ()
        return tuple(self._by_name(name, port, allow=True))

    def _by_name(self, name: str, port: int, *, allow: bool) -> Iterator[Rule]:
        """The allow (or deny) rules that name `name` on `port`."""
        name = name.lower().rstrip(".")
        return (
            r
            for r in self.rules
            if r.allow == allow and r.matches_name(name) and r.port_min <= port <= r.port_max
        )

    def name_verdict(self, name: str) -> bool | None:
        """For the DNS resolver: False = refuse `name`, True = answer it (an allow rule names
        it, or the mode is OPEN), None = refuse unless the policy has IP-only allows."""
        name = name.lower().rstrip(".")
        if any(r.matches_name(name) for r in self.rules if not r.allow):
            return False
        if any(r.matches_name(name) for r in self.rules if r.allow):
            return True
        return True if self.mode == MODE_OPEN else None


def _fail(where: str, text: str, why: str) -> InvalidArgument:
    return InvalidArgument(
        f"network policy rule {where} {text!r}: {why}",
        reason="INVALID_NETWORK_POLICY",
        metadata={"rule": where, "target": text},
    )


def _domain(where: str, text: str) -> str:
    name = text.lower().rstrip(".")
    labels = name.split(".")
    if labels[0] == "*":
        labels = labels[1:]
        if len(labels) < 2:
            raise _fail(where, text, "a wildcard needs a domain below it (*.example.com)")
    if any("*" in lb for lb in labels):
        raise _fail(where, text, "a wildcard is only the whole first label (*.example.com)")
    if len(name) > 253:
        raise _fail(where, text, f"a domain name is at most 253 characters, not {len(name)}")
    if "" in labels:
        raise _fail(where, text, "an empty label (two dots in a row, or a leading dot)")
    if any(len(lb) > 63 for lb in labels):
        raise _fail(where, text, "a label is at most 63 characters")
    if len(labels) < 2 or not all(_LABEL.match(lb) for lb in labels):
        raise _fail(where, text, "not an IP address, a CIDR or a domain name")
    if labels[-1].isdigit():
        raise _fail(where, text, "not a valid IP address or CIDR")
    return name


def _rule(where: str, raw: Mapping[str, Any], allow: bool) -> Rule:
    text = str(raw.get("target", "")).strip()
    if not text:
        raise _fail(where, text, "target is empty")
    network: Network | None = None
    domain = None
    if "/" in text or ":" in text or text.replace(".", "").isdigit():
        try:
            network = parse_network(text)
        except ValueError as exc:
            raise _fail(where, text, f"bad address or CIDR ({exc})") from None
    else:
        domain = _domain(where, text)
    try:
        lo = int(raw.get("port_min", 0) or 0)
        hi = int(raw.get("port_max", 0) or 0)
    except (TypeError, ValueError):
        raise _fail(where, text, "ports must be integers") from None
    if lo == 0 and hi == 0:
        lo, hi = 0, 65535
    else:
        if hi == 0:
            hi = lo
        if not 1 <= lo <= 65535 or not 1 <= hi <= 65535:
            raise _fail(
                where, text, f"port {lo if not 1 <= lo <= 65535 else hi} is out of range 1..65535"
            )
        if hi < lo:
            raise _fail(where, text, f"port range {lo}-{hi} is empty")
    proto_raw = raw.get("protocol", 0) or 0
    if proto_raw not in _PROTOCOLS:
        raise _fail(where, text, f"unknown protocol {proto_raw!r}")
    protocol = _PROTOCOLS[proto_raw]
    if domain is not None:
        # A name is checked on the name the connection asks for (TLS server name, HTTP Host):
        # TCP only. UDP (QUIC among it) to a name's address would be a rule about an address.
        if protocol == PROTO_UDP:
            raise _fail(
                where,
                text,
                "a domain rule is checked on TCP (TLS, HTTP); for UDP use an IP or CIDR",
            )
        protocol = PROTO_TCP
    return Rule(where, text, network, domain, lo, hi, protocol, allow)


def parse(raw: Mapping[str, Any] | None) -> Policy:
    """A NetworkPolicy dict (proto field names; enums by name or number) -> Policy."""
    raw = raw or {}
    mode_raw = raw.get("mode", "")
    if mode_raw not in _MODES:
        raise InvalidArgument(
            f"network policy mode {mode_raw!r} is unknown", reason="INVALID_NETWORK_POLICY"
        )
    mode = _MODES[mode_raw]
    allow = list(raw.get("allow", []) or [])
    deny = list(raw.get("deny", []) or [])
    if len(allow) + len(deny) > MAX_RULES:
        raise InvalidArgument(
            f"network policy has {len(allow) + len(deny)} rules; at most {MAX_RULES}",
            reason="INVALID_NETWORK_POLICY",
        )
    rules = [_rule(f"allow[{i}]", r, True) for i, r in enumerate(allow)]
    rules += [_rule(f"deny[{i}]", r, False) for i, r in enumerate(deny)]
    if mode == MODE_NONE and rules:
        raise InvalidArgument(
            f"network policy rule {rules[0].where}: mode NONE takes no rules",
            reason="INVALID_NETWORK_POLICY",
            metadata={"rule": rules[0].where},
        )
    max_blocked = int(raw.get("max_blocked_connects", 0) or 0)
    if max_blocked < 0:
        raise InvalidArgument("max_blocked_connects must not be negative")
    return Policy(mode, tuple(rules), max_blocked)


# ------------------------------------------------------------------------ compilation


@dataclass(frozen=True)
class Platform:
    """What the node contributes: the sandbox subnet, the resolver, the sandbox's address."""

    subnet: ipaddress.IPv4Network
    resolver: ipaddress.IPv4Address
    own_address: ipaddress.IPv4Address | None = None


Prefix = tuple[int, bytes]  # (prefix length, address in network order)


@dataclass
class Tables:
    """Compiled entries: prefix -> encoded rule list, per address family."""

    v4: dict[Prefix, bytes] = field(default_factory=dict)
    v6: dict[Prefix, bytes] = field(default_factory=dict)
    overflow: list[str] = field(default_factory=list)  # prefixes whose lists were cut

    def __len__(self) -> int:
        return len(self.v4) + len(self.v6)


_ANY = (0, 65535, PROTO_ANY)


def _platform_rules(p: Platform) -> list[tuple[str, int, tuple[int, int, int], int]]:
    out: list[tuple[str, int, tuple[int, int, int], int]] = [
        ("127.0.0.0/8", _PLATFORM_ALLOW, _ANY, ACTION_ALLOW),
        ("0.0.0.0/32", _PLATFORM_ALLOW, _ANY, ACTION_ALLOW),
        ("::1/128", _PLATFORM_ALLOW, _ANY, ACTION_ALLOW),
        ("::/128", _PLATFORM_ALLOW, _ANY, ACTION_ALLOW),
        (f"{p.resolver}/32", _PLATFORM_ALLOW, (53, 53, PROTO_ANY), ACTION_ALLOW),
        (str(p.subnet), _PLATFORM_DENY, _ANY, ACTION_DENY),
        ("169.254.0.0/16", _PLATFORM_DENY, _ANY, ACTION_DENY),
        ("fe80::/10", _PLATFORM_DENY, _ANY, ACTION_DENY),
        ("224.0.0.0/4", _PLATFORM_DENY, _ANY, ACTION_DENY),
        ("ff00::/8", _PLATFORM_DENY, _ANY, ACTION_DENY),
        ("0.0.0.0/0", _PLATFORM_DENY, (53, 53, PROTO_ANY), ACTION_DENY),
        ("::/0", _PLATFORM_DENY, (53, 53, PROTO_ANY), ACTION_DENY),
    ]
    if p.own_address is not None:
        out.insert(0, (f"{p.own_address}/32", _PLATFORM_ALLOW, _ANY, ACTION_ALLOW))
    return out


def compile_tables(
    policy: Policy,
    platform: Platform,
    resolved: Mapping[str, Iterable[str]] | None = None,
) -> Tables:
    """The LPM entries of `policy`; `resolved` maps a rule's domain to its current addresses."""
    # (version, int address, prefixlen) -> [(level, seq, (lo, hi, proto), action)]
    entries: dict[tuple[int, int, int], list[tuple[int, int, tuple[int, int, int], int]]] = {}
    seq = 0

    def add(net: Network, level: int, ports: tuple[int, int, int], action: int) -> None:
        nonlocal seq
        entries.setdefault(net, []).append((level, seq, ports, action))
        seq += 1

    for text, level, ports, action in _platform_rules(platform):
        add(parse_network(text), level, ports, action)
    if policy.mode == MODE_OPEN:
        add((4, 0, 0), _DEFAULT, _ANY, ACTION_ALLOW)
        add((6, 0, 0), _DEFAULT, _ANY, ACTION_ALLOW)
    resolved = resolved or {}
    for rule in policy.rules:
        level = _USER_ALLOW if rule.allow else _USER_DENY
        action = ACTION_ALLOW if rule.allow else ACTION_DENY
        ports = (rule.port_min, rule.port_max, rule.protocol)
        if rule.network is not None:
            add(rule.network, level, ports, action)
        elif rule.domain is not None and rule.allow:
            # TCP to a name's addresses passes the socket hook and is redirected to the name
            # gate (edge.network.namegate), which decides on the name asked for. A deny by name
            # is the gate's alone: in the tries it would also refuse every other name on the
            # same (CDN) address.
            for text in resolved.get(rule.domain, ()):
                add(parse_network(text), level, ports, action)
    for version in (4, 6):
        entries.setdefault((version, 0, 0), [])
    # Only prefix lengths that occur can contain an entry: walk those, longest first.
    lengths = {
        v: sorted({plen for ver, _, plen in entries if ver == v}, reverse=True) for v in (4, 6)
    }
    encoded: dict[tuple[tuple[int, int, int, int], ...], bytes] = {}

    tables = Tables()
    for version, addr, plen in entries:
        bits = 32 if version == 4 else 128
        merged: list[tuple[int, int, tuple[int, int, int], int]] = []
        for q in lengths[version]:
            if q > plen:
                continue
            sup = (addr >> (bits - q) << (bits - q)) if q else 0
            merged += entries.get((version, sup, q), ())
        merged.sort(key=lambda r: (r[0], r[1]))
        rules: list[tuple[int, int, int, int]] = []
        seen: set[tuple[int, int, int, int]] = set()
        for _level, _seq, (lo, hi, proto), action in merged:
            item = (lo, hi, proto, action)
            if item not in seen:
                seen.add(item)
                rules.append(item)
            if lo == 0 and hi == 65535 and proto == PROTO_ANY:
                break  # matches everything: later rules can never be reached
        if len(rules) > RULES_PER_ENTRY:
            # Fail closed: keep the first rules (denies come before allows).
            ip = ipaddress.IPv4Address(addr) if version == 4 else ipaddress.IPv6Address(addr)
            tables.overflow.append(f"{ip}/{plen}")
            rules = rules[:RULES_PER_ENTRY]
        key = tuple(rules)
        value = encoded.get(key)
        if value is None:
            value = encoded[key] = encode_rules(rules)
        prefix = (plen, addr.to_bytes(bits // 8, "big"))
        (tables.v4 if version == 4 else tables.v6)[prefix] = value
    return tables


def gated(policy: Policy, resolved: Mapping[str, Iterable[str]]) -> set[tuple[str, int, int]]:
    """(address, first port, last port) of the TCP connections the name gate decides: the IPv4
    addresses resolved for each allow-by-name rule, with its ports, less the ports an IP or
    CIDR allow rule already opens on that address (those keep the address-only fast path).
    OPEN policies gate nothing here (an allow by name adds nothing to OPEN; a deny by name
    gates everything: `Policy.gates_everything`)."""
    out: set[tuple[str, int, int]] = set()
    if policy.mode != MODE_ALLOWLIST:
        return out
    by_ip = [
        r for r in policy.rules if r.allow and r.network is not None and r.protocol != PROTO_UDP
    ]
    for rule in policy.rules:
        if rule.domain is None or not rule.allow:
            continue
        for addr in resolved.get(rule.domain, ()):
            net = parse_network(addr)
            if net[0] != 4:
                continue  # the sandboxes' network is IPv4
            open_ = [(r.port_min, r.port_max) for r in by_ip if _contains(r.network, net)]
            for lo, hi in _subtract((rule.port_min, rule.port_max), open_):
                out.add((addr, lo, hi))
    return out


def _contains(outer: Network | None, inner: Network) -> bool:
    if outer is None or outer[0] != inner[0] or outer[2] > inner[2]:
        return False
    shift = (32 if inner[0] == 4 else 128) - outer[2]
    return outer[1] >> shift == inner[1] >> shift


def _subtract(span: tuple[int, int], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of the port range `span` outside every range in `holes`."""
    parts = [span]
    for h_lo, h_hi in holes:
        parts = [
            piece
            for lo, hi in parts
            for piece in ((lo, min(hi, h_lo - 1)), (max(lo, h_hi + 1), hi))
            if piece[0] <= piece[1]
        ]
    return parts


def check_compilable(policy: Policy, platform: Platform) -> None:
    """InvalidArgument if some prefix would carry more rules than one map entry holds."""
    tables = compile_tables(policy, platform)
    if tables.overflow:
        raise InvalidArgument(
            f"network policy: too many rules apply to {tables.overflow[0]} "
            f"(at most {RULES_PER_ENTRY} per address range, counting the platform's)",
            reason="INVALID_NETWORK_POLICY",
            metadata={"prefix": tables.overflow[0]},
        )
