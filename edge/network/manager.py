"""Per-node network of sandboxes: addresses, links, eBPF policies, the resolver, counters.

`NetworkManager` is what the container backend talks to:

- `check(raw)` validates a policy (syntax, ranges, and that every domain rule resolves) before
  admission: bad input is INVALID_ARGUMENT naming the rule; an unreachable resolver UNAVAILABLE;
- `attach(...)` gives a started sandbox (its init pid and cgroup) an address, a veth into its
  namespace, and its eBPF filter with the compiled policy -- before any agent code runs;
- `update(...)` replaces a running sandbox's policy (atomic swap; the next connect sees it);
- `detach(...)` and `cleanup_orphans(...)` remove links, pins and addresses;
- the resolver (`edge.network.dns`) serves every networked sandbox on the bridge address and
  feeds addresses of domain rules into the filters; `refresh_loop` re-resolves domain rules.

The node bridge, its firewall and the resolver are set up when the first networked sandbox
starts (sandboxes without network cost nothing), and removed by `close(teardown=True)`.

A trusted-execution sibling (see edge.backends.container.backend) is attached with `owner=` its sandbox: it gets
its own address and link, and the same filter object (same maps: one policy, one counter).

A VM guest (`attach_guest`, `adopt_guest`, `detach_guest`; the link in `edge.network.guest`) is a
sandbox like the others here -- an owner with its policy, tries, counter and resolver client
address -- whose filter is one tc program on its link instead of cgroup hooks, so `replace`,
`blocked`, `dns_refusals_of`, the resolver's learning and `refresh_loop` serve both kinds. One
NetworkManager per edge serves every backend (one bridge, one resolver on its address).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edge.network import bpf, dns, guest
from edge.network.claims import NetworkClaim
from edge.network.enforcer import GuestIdentity, SandboxFilter
from edge.network.links import NetworkSetupError, NodeNetwork, veth_name
from edge.network.namegate import Attempt, NameGate
from edge.network.policy import (
    MODE_OPEN,
    Platform,
    Policy,
    check_compilable,
    compile_tables,
    gated,
    parse,
)
from edge.network.programs import RULES_PER_ENTRY
from libdsec.errors import FailedPrecondition, InvalidArgument, Unavailable

log = logging.getLogger(__name__)

#: Addresses learned for a domain are kept at least this long (clients cache beyond TTLs).
MIN_RETENTION_S = 3600.0
MAX_ADDRESSES_PER_DOMAIN = 256
#: The name gate's refusals by name (ViolationCounters.blocked_names): the keys for a
#: connection that asked for no name and, past MAX_BLOCKED_NAMES names, for the rest.
NO_NAME, OTHER_NAMES, MAX_BLOCKED_NAMES = "(no name)", "(other names)", 64


@dataclass
class _Owner:
    """A sandbox's policy and what it resolved: shared by the sandbox and its sibling."""

    policy: Policy
    filter: SandboxFilter | None = None
    resolved: dict[str, dict[str, float]] = field(default_factory=dict)  # domain -> addr -> expiry
    members: set[str] = field(default_factory=set)
    #: What the name gate redirects, as applied to nftables: member address -> entries, and
    #: the member addresses all of whose TCP goes to the gate.
    gate_applied: dict[str, set[tuple[str, int, int]]] = field(default_factory=dict)
    gate_all_applied: set[str] = field(default_factory=set)
    #: Connections the name gate refused, by the name asked for (at most MAX_BLOCKED_NAMES
    #: names, then OTHER_NAMES; NO_NAME: none asked for).
    gate_refused_names: dict[str, int] = field(default_factory=dict)


@dataclass
class _Attachment:
    sandbox_id: str
    owner: str
    address: ipaddress.IPv4Address
    cgroup_dir: Path | None  # None for a guest


class NetworkManager:
    def __init__(
        self,
        *,
        bridge: str,
        subnet: str,
        upstream: str,
        pin_root: Path,
        cgroup_root: Path = Path("/sys/fs/cgroup/unified"),
        dns_timeout_s: float = 2.0,
        refresh_s: float = 60.0,
        gate_queue: int = 0,
        claim: NetworkClaim | None = None,
    ) -> None:
        self.node = NodeNetwork(bridge, ipaddress.IPv4Network(subnet), gate_queue)
        #: The edge's hold on its bridge, subnet and queue (edge.network.claims), released at
        #: close: forgotten when the bridge goes, kept while sandboxes stay on it.
        self.claim = claim
        self._gate: NameGate | None = None
        up = dns.Upstream.parse(upstream) if upstream else dns.Upstream.from_resolv_conf()
        self.upstream = up
        self.pin_root = pin_root
        self.cgroup_root = cgroup_root
        self.dns_timeout_s = dns_timeout_s
        self.refresh_s = refresh_s
        self.owners: dict[str, _Owner] = {}
        self.attachments: dict[str, _Attachment] = {}
        self._by_address: dict[str, str] = {}
        self._node_ready = False
        self._node_lock = asyncio.Lock()
        self._resolver: dns.Resolver | None = None
        #: Connections the name gate refused since the start, every sandbox's (metrics).
        self.gate_refusals = 0

    @property
    def dns_refusals(self) -> int:
        """Names the resolver refused since it started, to every sandbox (metrics)."""
        return self._resolver.refused_total if self._resolver is not None else 0

    @property
    def gateway(self) -> str:
        return str(self.node.gateway)

    def _platform(self) -> Platform:
        return Platform(self.node.subnet, self.node.gateway)

    # ---------------------------------------------------------------- validation

    def parse(self, raw: Mapping[str, Any] | None) -> Policy:
        """Syntax and ranges only (no I/O): INVALID_ARGUMENT naming the offending rule."""
        policy = parse(raw)
        check_compilable(policy, self._platform())
        return policy

    def resolve_domains(self, policy: Policy) -> dict[str, list[str]]:
        """Resolve every non-wildcard domain rule (blocking): an unknown name is INVALID_ARGUMENT
        naming its rule; a resolver that does not answer is UNAVAILABLE (retry)."""
        out: dict[str, list[str]] = {}
        for rule in policy.domains:
            assert rule.domain is not None
            if rule.domain.startswith("*.") or rule.domain in out:
                continue
            if self.upstream is None:
                raise Unavailable(
                    "no upstream DNS resolver is configured", reason="DNS_UNAVAILABLE"
                )
            try:
                out[rule.domain] = dns.resolve(self.upstream, rule.domain, self.dns_timeout_s)
            except dns.Unresolvable:
                raise InvalidArgument(
                    f"network policy rule {rule.where} {rule.text!r}: the name does not resolve",
                    reason="INVALID_NETWORK_POLICY",
                    metadata={"rule": rule.where, "target": rule.text},
                ) from None
            except (OSError, dns.DnsError) as exc:
                raise Unavailable(
                    f"resolving {rule.domain} for the network policy failed: {exc}",
                    reason="DNS_UNAVAILABLE",
                ) from None
        return out

    def check(self, raw: Mapping[str, Any] | None) -> tuple[Policy, dict[str, list[str]]]:
        """parse() + resolve_domains() (blocking)."""
        policy = self.parse(raw)
        return policy, self.resolve_domains(policy) if policy.networked else {}

    # ------------------------------------------------------------------ the node

    async def _ensure_node(self) -> None:
        if self._node_ready:
            return
        async with self._node_lock:
            if self._node_ready:
                return
            if not bpf.available():
                raise FailedPrecondition(
                    "eBPF is unavailable to the edge: networked sandboxes need it",
                    reason="NETWORK_UNAVAILABLE",
                )
            await asyncio.to_thread(self.node.ensure)
            if self.upstream is not None:
                resolver = dns.Resolver(
                    self.upstream, self._decide, self._learn, timeout_s=self.dns_timeout_s
                )
                await resolver.start(self.gateway)
                self._resolver = resolver
            else:
                log.warning("no upstream DNS resolver: sandboxes can use addresses only")
            gate = NameGate(self._gate_decide, self._gate_refused)
            try:
                await gate.start(self.node.gate_queue)
            except OSError as exc:
                if self._resolver is not None:
                    await self._resolver.close()
                    self._resolver = None
                raise FailedPrecondition(
                    f"the name gate cannot bind its queue: {exc} (DSEC_EDGE_NET_GATE_QUEUE "
                    "picks another): networked sandboxes need it",
                    reason="NETWORK_UNAVAILABLE",
                ) from None
            self._gate = gate
            self._node_ready = True

    def _allocate(self) -> ipaddress.IPv4Address:
        for host in self.node.subnet.hosts():
            if host != self.node.gateway and str(host) not in self._by_address:
                return host
        raise Unavailable(f"no free address in {self.node.subnet}", reason="NETWORK_EXHAUSTED")

    # -------------------------------------------------------------- the sandboxes

    def _cgroup_dir(self, cgroup_path: str) -> Path:
        return self.cgroup_root / cgroup_path.lstrip("/")

    def _tables(self, owner: _Owner) -> Any:
        resolved = {d: list(addrs) for d, addrs in owner.resolved.items()}
        return compile_tables(owner.policy, self._platform(), resolved)

    @staticmethod
    def _remember(owner: _Owner, resolved: Mapping[str, list[str]], ttl: float = 0.0) -> bool:
        """Record addresses of domains; True if any is new."""
        new = False
        expiry = time.time() + max(ttl, MIN_RETENTION_S)
        for domain, addrs in resolved.items():
            known = owner.resolved.setdefault(domain, {})
            for addr in addrs:
                if addr not in known:
                    new = True
                known[addr] = max(known.get(addr, 0.0), expiry)
            if len(known) > MAX_ADDRESSES_PER_DOMAIN:
                for addr, _ in sorted(known.items(), key=lambda kv: kv[1])[
                    : len(known) - MAX_ADDRESSES_PER_DOMAIN
                ]:
                    del known[addr]
        return new

    async def attach(
        self,
        sandbox_id: str,
        pid: int,
        cgroup_path: str,
        policy: Policy,
        resolved: Mapping[str, list[str]] | None = None,
        *,
        owner: str | None = None,
        address: str | None = None,
    ) -> dict[str, Any]:
        """Network a started sandbox. Returns what to keep in its record (`adopt` takes it)."""
        await self._ensure_node()
        owner_id = owner or sandbox_id
        if owner is None:
            state = _Owner(policy)
            self._remember(state, resolved or {})
            state.filter = await asyncio.to_thread(SandboxFilter.create, self.pin_root / sandbox_id)
            await asyncio.to_thread(state.filter.load, self._tables(state))
            self.owners[sandbox_id] = state
        state = self.owners[owner_id]
        assert state.filter is not None
        addr = ipaddress.IPv4Address(address) if address else self._allocate()
        self._by_address[str(addr)] = sandbox_id
        cg = self._cgroup_dir(cgroup_path)
        self.attachments[sandbox_id] = _Attachment(sandbox_id, owner_id, addr, cg)
        state.members.add(sandbox_id)
        try:
            await asyncio.to_thread(state.filter.attach, cg)
            await asyncio.to_thread(self.node.attach, sandbox_id, pid, addr)
            await asyncio.to_thread(self._sync_gate, state)
        except BaseException:
            await self.detach(sandbox_id)
            raise
        return {"address": str(addr), "veth": veth_name(sandbox_id), "owner": owner_id}

    async def adopt(
        self, sandbox_id: str, info: Mapping[str, Any], policy: Policy, cgroup_path: str
    ) -> bool:
        """After an edge restart: take back a networked sandbox from its record and pins."""
        owner_id = str(info.get("owner") or sandbox_id)
        address = str(info.get("address", ""))
        if not address:
            return False
        await self._ensure_node()
        if owner_id == sandbox_id:
            flt = await asyncio.to_thread(SandboxFilter.open, self.pin_root / sandbox_id)
            if flt is None:
                log.warning(
                    "the eBPF pins of %s are gone; its policy cannot be managed", sandbox_id
                )
                return False
            state = _Owner(policy, flt)
            self.owners[sandbox_id] = state
            with contextlib.suppress(Exception):
                resolved = await asyncio.to_thread(self.resolve_domains, policy)
                self._remember(state, resolved)
            await asyncio.to_thread(flt.load, self._tables(state))
        elif owner_id not in self.owners:
            return False
        self._by_address[address] = sandbox_id
        self.attachments[sandbox_id] = _Attachment(
            sandbox_id, owner_id, ipaddress.IPv4Address(address), self._cgroup_dir(cgroup_path)
        )
        self.owners[owner_id].members.add(sandbox_id)
        await asyncio.to_thread(self._sync_gate, self.owners[owner_id])
        return True

    # ---------------------------------------------------------------- VM guests

    async def attach_guest(
        self,
        sandbox_id: str,
        netns_dir: Path | None,
        policy: Policy,
        resolved: Mapping[str, list[str]] | None = None,
    ) -> dict[str, Any]:
        """Network a VM guest: its namespace and tap under `netns_dir` (made if missing), an
        address, its filter, and the link onto the node bridge, in that order. Returns what to
        keep in its record (`adopt_guest` takes it) and to configure the guest with: address,
        prefix_len, gateway, dns, mac (the only source MAC its frames may have), netns, tap.
        `netns_dir` None: a libvirt guest's, whose link is its own tap in the edge's namespace
        (edge.network.guest.create_root_tap, made by its backend): no namespace, no veth."""
        await self._ensure_node()
        state = _Owner(policy)
        self._remember(state, resolved or {})
        self.owners[sandbox_id] = state
        addr = self._allocate()
        self._register(sandbox_id, addr)
        mac = guest.guest_mac(sandbox_id)
        try:
            netns = None
            if netns_dir is not None:
                netns = await asyncio.to_thread(guest.create_netns, netns_dir, sandbox_id)
            identity = GuestIdentity(bytes.fromhex(mac.replace(":", "")), addr.packed)
            state.filter = await asyncio.to_thread(
                SandboxFilter.create, self.pin_root / sandbox_id, identity
            )
            await asyncio.to_thread(state.filter.load, self._tables(state))
            await asyncio.to_thread(self._link, sandbox_id, netns, state.filter.guest_program)
            await asyncio.to_thread(self._sync_gate, state)
        except BaseException:
            await self.detach_guest(sandbox_id, netns_dir)
            raise
        return {
            "address": str(addr),
            "prefix_len": self.node.subnet.prefixlen,
            "gateway": self.gateway,
            "dns": self.gateway,
            "mac": mac,
            "netns": str(netns or ""),
            "tap": guest.TAP if netns is not None else veth_name(sandbox_id),
            "veth": veth_name(sandbox_id),
            "owner": sandbox_id,
        }

    def _register(self, sandbox_id: str, address: ipaddress.IPv4Address) -> None:
        """A guest is its own owner (no siblings)."""
        self._by_address[str(address)] = sandbox_id
        self.attachments[sandbox_id] = _Attachment(sandbox_id, sandbox_id, address, None)
        self.owners[sandbox_id].members.add(sandbox_id)

    async def adopt_guest(self, sandbox_id: str, info: Mapping[str, Any], policy: Policy) -> bool:
        """After an edge restart: take back a running guest's network from its record, its
        namespace and its pins (the filter kept enforcing meanwhile). False if a piece is gone."""
        address = str(info.get("address", ""))
        netns = Path(str(info["netns"])) if info.get("netns") else None
        if not address:
            return False
        if netns is not None and not await asyncio.to_thread(guest.is_netns, netns):
            return False
        await self._ensure_node()
        flt = await asyncio.to_thread(SandboxFilter.open, self.pin_root / sandbox_id)
        if flt is None:
            log.warning(
                "the eBPF pins of guest %s are gone; its policy cannot be managed", sandbox_id
            )
            return False
        state = _Owner(policy, flt)
        self.owners[sandbox_id] = state
        self._register(sandbox_id, ipaddress.IPv4Address(address))
        with contextlib.suppress(Exception):
            self._remember(state, await asyncio.to_thread(self.resolve_domains, policy))
        await asyncio.to_thread(flt.load, self._tables(state))
        await asyncio.to_thread(self._relink, sandbox_id, netns, flt)
        await asyncio.to_thread(self._sync_gate, state)
        return True

    def _relink(self, sandbox_id: str, netns: Path | None, flt: SandboxFilter) -> None:
        """The filter on the guest's link, the link made again if it went (blocking)."""
        if not self.node.attach_ingress(sandbox_id, flt.guest_program):
            self._link(sandbox_id, netns, flt.guest_program)

    def _link(self, sandbox_id: str, netns: Path | None, program: int) -> None:
        """The guest's port on the node bridge: a veth into its namespace, or (no namespace:
        a libvirt guest) its own tap (blocking)."""
        if netns is not None:
            guest.connect(self.node, sandbox_id, netns, program)
        else:
            self.node.add_tap_port(sandbox_id, program)

    async def detach_guest(self, sandbox_id: str, netns_dir: Path | None) -> None:
        """Remove everything of a guest's network: address, link, filter and pins, namespace
        (also for a guest that never had a policy, or was not adopted). A libvirt guest's
        tap (`netns_dir` None) is its backend's to remove."""
        await self.detach(sandbox_id)
        if netns_dir is not None:
            await asyncio.to_thread(guest.remove_netns, guest.netns_path(netns_dir, sandbox_id))

    async def replace(self, sandbox_id: str, raw: Mapping[str, Any]) -> Policy:
        """Replace the policy of a networked sandbox (and its sibling): parse, resolve names,
        compile and load in one trip to a worker thread. A bad policy raises InvalidArgument
        and leaves the one in force untouched."""
        state = self.owners.get(sandbox_id)
        if state is None or state.filter is None:
            raise FailedPrecondition(f"sandbox {sandbox_id} has no network attached")

        def work() -> _Owner:
            t0 = time.perf_counter()
            policy = parse(raw)
            resolved = self.resolve_domains(policy) if policy.networked else {}
            # The same owner (filter, members, the gate's state and counters), the new policy.
            fresh = replace(state, policy=policy, resolved={})
            self._remember(fresh, resolved)
            # Addresses learned for names the new policy still names stay valid.
            for domain, addrs in state.resolved.items():
                if any(r.domain == domain for r in policy.domains):
                    for addr, expiry in addrs.items():
                        fresh.resolved.setdefault(domain, {}).setdefault(addr, expiry)
            self._compile_and_load(fresh)
            self._sync_gate(fresh)
            log.info(
                "network policy of %s replaced in %.2f ms (%s, %d rules)",
                sandbox_id,
                (time.perf_counter() - t0) * 1000,
                policy.mode,
                len(policy.rules),
                extra={"sandbox_id": sandbox_id},
            )
            return fresh

        fresh = await asyncio.to_thread(work)
        self.owners[sandbox_id] = fresh
        return fresh.policy

    def _compile_and_load(self, state: _Owner) -> None:
        tables = self._tables(state)
        if tables.overflow:  # nothing loaded: the old policy stays in force
            raise InvalidArgument(
                f"network policy: too many rules apply to {tables.overflow[0]} "
                f"(at most {RULES_PER_ENTRY} per address range, counting the platform's)",
                reason="INVALID_NETWORK_POLICY",
                metadata={"prefix": tables.overflow[0]},
            )
        assert state.filter is not None
        state.filter.load(tables)

    def is_attached(self, sandbox_id: str) -> bool:
        return sandbox_id in self.attachments

    async def detach(self, sandbox_id: str) -> None:
        att = self.attachments.pop(sandbox_id, None)
        if att is not None:
            self._by_address.pop(str(att.address), None)
            if self._resolver is not None:
                self._resolver.refused.pop(str(att.address), None)
            state = self.owners.get(att.owner)
            if state is not None:
                state.members.discard(sandbox_id)
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self._ungate, state, str(att.address))
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.node.detach, sandbox_id)
        state = self.owners.pop(sandbox_id, None)
        if state is not None:
            for member in list(state.members):  # a sibling cannot outlive its policy
                await self.detach(member)
            if state.filter is not None:
                await asyncio.to_thread(state.filter.remove)

    def blocked(self, sandbox_id: str) -> int | None:
        state = self.owners.get(sandbox_id)
        if state is None or state.filter is None:
            return None
        try:
            return state.filter.blocked() + sum(state.gate_refused_names.values())
        except OSError:
            return None

    def blocked_names(self, sandbox_id: str) -> dict[str, int]:
        """Connections the name gate refused, by the name they asked for (NO_NAME: none)."""
        state = self.owners.get(sandbox_id)
        return dict(state.gate_refused_names) if state is not None else {}

    def dns_refusals_of(self, sandbox_id: str) -> int:
        """Names refused to the sandbox (and its sibling) by the resolver."""
        state = self.owners.get(sandbox_id)
        if state is None or self._resolver is None:
            return 0
        counts = self._resolver.refused
        return sum(
            counts.get(str(self.attachments[m].address), 0)
            for m in state.members
            if m in self.attachments
        )

    # ------------------------------------------------------------------ name gate

    def _sync_gate(self, state: _Owner) -> None:
        """Brings nftables' redirections to the gate to what the owner's policy and resolved
        names ask for, for each of its members (blocking: nft)."""
        want = gated(state.policy, state.resolved)
        everything = state.policy.gates_everything
        for member in list(state.members):
            att = self.attachments.get(member)
            if att is None:
                continue
            addr = str(att.address)
            have = state.gate_applied.setdefault(addr, set())
            if want - have:
                self.node.gate(addr, want - have, add=True)
            if have - want:
                self.node.gate(addr, have - want, add=False)
            state.gate_applied[addr] = set(want)
            if everything and addr not in state.gate_all_applied:
                self.node.gate_all(addr, add=True)
                state.gate_all_applied.add(addr)
            elif not everything and addr in state.gate_all_applied:
                self.node.gate_all(addr, add=False)
                state.gate_all_applied.discard(addr)

    def _ungate(self, state: _Owner, addr: str) -> None:
        entries = state.gate_applied.pop(addr, set())
        if entries:
            self.node.gate(addr, entries, add=False)
        if addr in state.gate_all_applied:
            state.gate_all_applied.discard(addr)
            self.node.gate_all(addr, add=False)

    def _gate_decide(self, a: Attempt) -> str | None:
        """The name gate's verdict on a connection: None to let it go on, else why not.

        ALLOWLIST: the name asked for must be allowed on the port (a deny by name wins) and
        the address one the edge resolved for the allowing rule; no name, no connection.
        OPEN (with a deny by name, else nothing is gated): a connection asking for a denied
        name is refused, and so is one without a name to an address resolved for a denied
        name; anything else goes on, as OPEN means."""
        state = self._owner_of(a.client[0])
        if state is None:
            return "not from a networked sandbox"
        address, port = a.destination
        policy = state.policy
        p = a.peeked
        nameless = None
        if p is None:
            nameless = "no name: the client sent nothing a name could be read from in time"
        elif p.error:
            nameless = f"malformed {p.protocol}: {p.error}"
        elif p.ech:
            nameless = "an encrypted ClientHello (ECH): the name asked for is hidden"
        elif not p.name:
            nameless = f"no name ({p.protocol} without a server name or Host)"
        if policy.mode == MODE_OPEN:
            if p is not None and p.name and (r := policy.name_denied(p.name, port)):
                return f"name {p.name} is denied by {r.where} {r.text!r}"
            denied_here = (
                r
                for r in policy.domains
                if not r.allow
                and r.port_min <= port <= r.port_max
                and address in state.resolved.get(r.domain or "", {})
            )
            if nameless and (r := next(denied_here, None)):
                return f"{nameless}, to {address}, an address of denied {r.text!r}"
            return None
        if nameless or p is None:
            return nameless
        rules = policy.name_allows(p.name, port)
        if not rules:
            return f"name {p.name} is not allowed on port {port}"
        if not any(address in state.resolved.get(r.domain or "", {}) for r in rules):
            return f"{address} is not an address the edge resolved for {p.name}"
        return None

    def _gate_refused(self, a: Attempt, why: str) -> None:
        self.gate_refusals += 1
        state = self._owner_of(a.client[0])
        if state is None:
            return
        name = (a.peeked.name if a.peeked is not None else "") or NO_NAME
        names = state.gate_refused_names
        if name not in names and len(names) >= MAX_BLOCKED_NAMES:
            name = OTHER_NAMES  # an agent trying names by the million gets one entry
        names[name] = names.get(name, 0) + 1
        log.debug(  # (counted above: at the gate's rate limit, info would flood the log)
            "name gate refused %s -> %s:%d: %s",
            a.client[0],
            *a.destination,
            why,
        )

    # ------------------------------------------------------------------ resolver

    def _owner_of(self, client: str) -> _Owner | None:
        sid = self._by_address.get(client)
        att = self.attachments.get(sid) if sid else None
        return self.owners.get(att.owner) if att else None

    def _decide(self, client: str, name: str) -> bool | None:
        state = self._owner_of(client)
        if state is None:
            return None
        return state.policy.name_verdict(name)

    async def _learn(self, client: str, name: str, addresses: list[tuple[str, int]]) -> None:
        state = self._owner_of(client)
        if state is None or state.filter is None:
            return
        name = name.lower().rstrip(".")
        matching = [r for r in state.policy.domains if r.matches_name(name)]
        if not matching:
            return
        ttl = max((t for _, t in addresses), default=0)
        learned = {r.domain or "": [a for a, _ in addresses] for r in matching}
        if self._remember(state, learned, ttl):
            flt = state.filter

            def add() -> None:
                # Only the new addresses' entries, into the side in force (each atomic).
                tables = self._tables(state)
                prefixes = [
                    (ip.max_prefixlen, ip.packed)
                    for ip in map(ipaddress.ip_address, (a for a, _ in addresses))
                ]
                flt.add(
                    {p: tables.v4[p] for p in prefixes if p[0] == 32 and p in tables.v4},
                    {p: tables.v6[p] for p in prefixes if p[0] == 128 and p in tables.v6},
                )
                self._sync_gate(state)

            await asyncio.to_thread(add)

    async def refresh_once(self) -> None:
        now = time.time()
        for sid, state in list(self.owners.items()):
            if state.filter is None or not state.policy.domains:
                continue
            changed = False
            for domain in list(state.resolved):
                for addr, expiry in list(state.resolved[domain].items()):
                    if expiry < now:
                        del state.resolved[domain][addr]
                        changed = True
            try:
                resolved = await asyncio.to_thread(self.resolve_domains, state.policy)
            except Exception as exc:
                log.info("refreshing the names of %s failed: %s", sid, exc)
                resolved = {}
            changed = self._remember(state, resolved) or changed
            if changed and self.owners.get(sid) is state:
                await asyncio.to_thread(state.filter.load, self._tables(state))
                await asyncio.to_thread(self._sync_gate, state)

    async def refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh_once()

    # ------------------------------------------------------------------ cleanup

    async def cleanup_orphans(self, keep: set[str], *, netns_dir: Path | None = None) -> list[str]:
        """Pins and bridge ports of sandboxes not in `keep`, and with `netns_dir` the guests'
        namespaces there too."""
        removed = []
        if netns_dir is not None:
            gone = await asyncio.to_thread(
                guest.remove_orphans, netns_dir, keep | set(self.attachments)
            )
            removed += [f"netns:{sid}" for sid in gone]
        if self.pin_root.is_dir():
            for d in self.pin_root.iterdir():
                if d.name not in keep and d.name not in self.owners:
                    await asyncio.to_thread(_rmtree, d)
                    removed.append(f"bpf:{d.name}")
        ours = {veth_name(s) for s in set(keep) | set(self.attachments)}
        with contextlib.suppress(Exception):
            for port in await asyncio.to_thread(self.node.ports):
                if port not in ours:
                    await asyncio.to_thread(self.node.remove_port, port)
                    removed.append(f"veth:{port}")
        await self._reconcile_gate()
        return removed

    async def _reconcile_gate(self) -> None:
        """The name gate's sets, exactly as the adopted sandboxes' policies ask: an edge that
        restarts keeps the sets it found (deciding by name meanwhile), then drops what belonged
        to sandboxes that ended while it was down."""
        gated: list[str] = []
        everything: list[str] = []
        for state in self.owners.values():
            for addr, entries in state.gate_applied.items():
                gated += self.node.gate_items(addr, entries)
            everything += state.gate_all_applied
        try:
            await asyncio.to_thread(self.node.gate_replace, gated, everything)
        except NetworkSetupError:
            if self._node_ready:  # else: no table yet, nothing to drop
                raise

    async def close(self, *, teardown: bool) -> None:
        if self._gate is not None:
            await self._gate.close()
            self._gate = None
        if self._resolver is not None:
            await self._resolver.close()
            self._resolver = None
        for state in self.owners.values():
            if state.filter is not None:
                state.filter.close()
        if teardown and self._node_ready and not self.attachments:
            await asyncio.to_thread(self.node.teardown)
            with contextlib.suppress(OSError):
                self.pin_root.rmdir()
        self._node_ready = False
        if self.claim is not None:
            bare = (
                teardown and not self.attachments and not await asyncio.to_thread(self.node.ports)
            )
            await asyncio.to_thread(self.claim.release, forget=bare)


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
