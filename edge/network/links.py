"""Links of networked sandboxes: the node bridge, NAT, and one veth pair per sandbox (netlink).

    sandbox netns                  host (edge)
    eth0 10.231.0.7/16  ──veth──  dv<hash> ─┐
    eth0 10.231.0.8/16  ──veth──  dv<hash> ─┼─ bridge <name> 10.231.0.1/16 ── NAT ── uplink
                                            ┘   (ports isolated)

- The sandbox's network namespace is the one runc made for it; the edge adds a veth pair whose
  peer it moves into `/proc/<init pid>/ns/net`, so networked and unnetworked sandboxes start the
  same way and a running sandbox can gain a network (UpdateNetworkPolicy from NONE). The peer
  dies with the namespace, so a crashed sandbox leaves no link in its namespace behind.
- Sandbox-to-sandbox traffic is blocked three times: bridge ports are *isolated* (no frames
  between two sandboxes' ports), the forward chain drops bridge-to-bridge traffic, and every
  sandbox's eBPF policy refuses the subnet.
- Sandboxes reach the host only for DNS on the bridge address (input chain); nothing from
  outside can open a connection into a sandbox. IPv6 is off on the bridge and its ports.
- A VM guest's link (`edge.network.guest`) is one more such port: its veth's inner end is in
  a namespace the edge keeps for the guest's tap, its host end carries the guest's tc filter
  (`add_port(..., ingress=)`), attached before the port is up.
- NAT (masquerade) for traffic leaving the bridge. On a host where Docker made the forward
  policy DROP, the edge adds two rules to DOCKER-USER (Docker's place for them) so that the
  bridge's traffic is forwarded; they are removed with the bridge.
- The name gate (`edge.network.namegate`): the sets `gated` (sandbox . address . ports) and
  `gate_all` (sandbox) say which TCP a policy allows only by name; the `gate` chain marks
  those packets until conntrack holds the gate's verdict, an iptables `mangle FORWARD` rule
  queues marked packets to the gate's NFQUEUE, and `gate_verdict` copies the gate's mark to
  the connection (admitted: never queued again; refused: answered with a TCP reset).

Netlink goes through pyroute2; nftables rules through `nft -f -` (once per bridge).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import ipaddress
import logging
import os
import subprocess
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from edge.network.namegate import ADMIT, QUEUED, REFUSE

log = logging.getLogger(__name__)

#: Packets per second (and burst) one sandbox may have queued to the name gate: about that
#: many new name-checked connections a second (each queues one or two packets).
GATE_RATE, GATE_BURST = 2000, 1000
_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
VETH_PREFIX = "dv"
_TC_INGRESS = 0xFFFFFFF2  # clsact's ingress hook
_ETH_P_ALL = 0x0003


class NetworkSetupError(RuntimeError):
    pass


def veth_name(sandbox_id: str) -> str:
    """The host end's name: 15 characters at most (IFNAMSIZ), stable per sandbox id."""
    return VETH_PREFIX + hashlib.sha256(sandbox_id.encode()).hexdigest()[:12]


def _ipr() -> Any:
    from pyroute2 import IPRoute  # a sizeable import: only on nodes that network sandboxes

    return IPRoute()


@contextlib.contextmanager
def netns_of(pid: int) -> Iterator[Any]:
    """A netlink socket in the network namespace of `pid` (see `netns_at`)."""
    with netns_at(Path(f"/proc/{pid}/ns/net")) as ipr:
        yield ipr


@contextlib.contextmanager
def netns_at(path: Path) -> Iterator[Any]:
    """A netlink socket in the network namespace file `path`.

    The socket is made with this thread briefly inside that namespace (setns is per thread), then
    the thread returns to its own: the socket stays bound to the sandbox's namespace. Not
    through `mounts.in_namespace_of` (a short-lived thread): an IPRoute made in another thread
    and used in this one sent its requests to the edge's own namespace (tried: the sandbox's
    default route then failed with EEXIST).
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(target, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetworkSetupError(f"setns into the network namespace {path}: {os.strerror(err)}")
        try:
            ipr = _ipr()
        finally:
            if _libc.setns(own, _CLONE_NEWNET) != 0:  # never leave a pool thread elsewhere
                os.abort()
    finally:
        os.close(own)
        os.close(target)
    try:
        yield ipr
    finally:
        ipr.close()


def _attach_ingress(ip: Any, index: int, program: int) -> None:
    """A clsact qdisc on interface `index` and `program` as its one ingress filter (direct
    action, every ethertype; replaced in place if there). Classic tc rather than tcx: attaching
    with tcx waits for an RCU grace period (measured: 5.4 ms median, this takes 1.4)."""
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        ip.tc("add", "clsact", index=index)
    except NetlinkError as exc:
        if exc.code != errno.EEXIST:
            raise
    ip.tc(
        "replace-filter",
        "bpf",
        index=index,
        parent=_TC_INGRESS,
        prio=1,
        handle=1,
        protocol=_ETH_P_ALL,
        fd=program,
        name="dsec_guest",
        classid=1,
        direct_action=True,
    )


def _nft(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["nft", "-f", "-"], input=script, capture_output=True, text=True, env=_ENV
    )


def _sysctl(path: str, value: str) -> None:
    with contextlib.suppress(OSError):
        Path("/proc/sys", path).write_text(value)


class NodeNetwork:
    """The bridge, its address, its firewall and NAT, and the sandboxes' veth pairs."""

    def __init__(self, bridge: str, subnet: ipaddress.IPv4Network, gate_queue: int = 0) -> None:
        if not 1 <= len(bridge) <= 15:
            raise ValueError(f"bridge name {bridge!r} must have 1..15 characters")
        self.bridge = bridge
        #: The name gate's NFQUEUE number (edge.network.namegate); 0: one derived from the
        #: bridge's name, so that edges of one node (one bridge each) get different queues.
        self.gate_queue = gate_queue or 1024 + zlib.crc32(bridge.encode()) % 31744
        self.subnet = subnet
        self.gateway = next(subnet.hosts())
        self.table = f"dsec_{bridge}".replace("-", "_")
        self._iptables_rules: list[tuple[str, str, list[str]]] = [
            ("filter", "DOCKER-USER", ["-i", bridge, "-j", "ACCEPT"]),
            ("filter", "DOCKER-USER", ["-o", bridge, "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"]),
            # The name gate's queue: nftables marks what goes there (this kernel's nftables
            # has no native queue statement; the xtables target does it through nft_compat).
            ("mangle", "FORWARD", ["-i", bridge, "-m", "mark", "--mark", hex(QUEUED), "-j", "NFQUEUE", "--queue-num", str(self.gate_queue)]),
        ]  # fmt: skip

    # ------------------------------------------------------------------ the gate

    @staticmethod
    def gate_items(sandbox: str, entries: Iterable[tuple[str, int, int]]) -> list[str]:
        return [f"{sandbox} . {addr} . {lo}-{hi}" for addr, lo, hi in entries]

    def gate(self, sandbox: str, entries: Iterable[tuple[str, int, int]], *, add: bool) -> None:
        """Adds (or removes) `sandbox`'s TCP to (address, ports) to what the name gate decides."""
        items = self.gate_items(sandbox, entries)
        if items:
            self._nft_element("gated", items, add=add)

    def gate_all(self, sandbox: str, *, add: bool) -> None:
        """Sends all of `sandbox`'s TCP to the name gate, or stops it."""
        self._nft_element("gate_all", [sandbox], add=add)

    def _nft_element(self, set_name: str, items: list[str], *, add: bool) -> None:
        verb = "add" if add else "delete"
        r = _nft(f"{verb} element inet {self.table} {set_name} {{ {', '.join(items)} }}\n")
        if r.returncode != 0 and add:  # a removal of what is gone already is fine
            raise NetworkSetupError(f"nft {verb} element {set_name}: {r.stderr.strip()}")

    # ------------------------------------------------------------------ the node

    def ensure(self) -> None:
        """Create (or adopt) the bridge and its rules. Idempotent; blocking."""
        with contextlib.closing(_ipr()) as ip:
            found = ip.link_lookup(ifname=self.bridge)
            if not found:
                ip.link("add", ifname=self.bridge, kind="bridge")
                found = ip.link_lookup(ifname=self.bridge)
                log.info("created bridge %s (%s)", self.bridge, self.subnet)
            idx = found[0]
            _sysctl(f"net/ipv6/conf/{self.bridge}/disable_ipv6", "1")
            have = {a.get_attr("IFA_ADDRESS") for a in ip.get_addr(index=idx, family=2)}
            if str(self.gateway) not in have:
                ip.addr(
                    "add", index=idx, address=str(self.gateway), prefixlen=self.subnet.prefixlen
                )
            ip.link("set", index=idx, state="up")
        if Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() != "1":
            log.warning("net.ipv4.ip_forward was 0: enabling it for sandbox egress")
            _sysctl("net/ipv4/ip_forward", "1")
        self._nft_apply()
        self._iptables(add=True)

    def teardown(self) -> None:
        """Remove the bridge and its rules (veths on it go too). Idempotent; blocking."""
        self._iptables(add=False)
        subprocess.run(
            ["nft", "delete", "table", "inet", self.table], capture_output=True, env=_ENV
        )
        subprocess.run(
            ["nft", "delete", "table", "ip", self.table + "_nat"], capture_output=True, env=_ENV
        )
        with contextlib.closing(_ipr()) as ip:
            for idx in ip.link_lookup(ifname=self.bridge):
                for link in ip.get_links():
                    if link.get_attr("IFLA_MASTER") == idx:
                        with contextlib.suppress(Exception):
                            ip.link("del", index=link["index"])
                ip.link("del", index=idx)

    def _nft_apply(self) -> None:
        """The node's nftables rules, replaced in one transaction. The name gate's sets keep
        their elements (an edge restarting keeps deciding by name: `gate_replace` sets them
        right once the sandboxes are adopted); a table of another shape is replaced whole."""
        chains = self._nft_chains()
        sets = """  set gated { type ipv4_addr . ipv4_addr . inet_service; flags interval; }
  set gate_all { type ipv4_addr; }
  set gate_rate { type ipv4_addr; flags dynamic, timeout; timeout 60s; }"""
        heads = "\n".join(f"  chain {name} {{ {head} }}" for name, (head, _) in chains.items())
        flushes = "\n".join(f"flush chain inet {self.table} {name}" for name in chains)
        bodies = "\n".join(
            f"  chain {name} {{\n{rules}\n  }}" for name, (_, rules) in chains.items()
        )
        inet = f"""table inet {self.table} {{
{sets}
{heads}
}}
{flushes}
table inet {self.table} {{
{bodies}
}}
"""
        nat = f"""table ip {self.table}_nat
delete table ip {self.table}_nat
table ip {self.table}_nat {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {self.subnet} oifname != "{self.bridge}" masquerade
  }}
}}
"""
        r = _nft(inet + nat)
        if r.returncode != 0:  # a table of another shape (an older edge's): replace it
            log.info("nftables table %s replaced whole: %s", self.table, r.stderr.strip())
            r = _nft(f"table inet {self.table}\ndelete table inet {self.table}\n" + inet + nat)
        if r.returncode != 0:
            raise NetworkSetupError(f"nft failed: {r.stderr.strip()}")

    def _nft_chains(self) -> dict[str, tuple[str, str]]:
        """name -> (hook declaration, rules) of the node's chains in its inet table."""
        br, gw = self.bridge, self.gateway
        bare = "\n".join(
            f'    iifname "{br}" ip hdrlength 5 tcp doff {n} ip length {20 + 4 * n} '
            "tcp flags & syn == 0 return"
            for n in range(5, 16)
        )
        return {
            # The name gate (edge.network.namegate): TCP a policy allows only by name, the
            # pairs (sandbox . address . ports) in `gated` or all TCP of a sandbox in
            # `gate_all`, is marked for the gate's queue until conntrack holds its verdict.
            # Segments without payload but SYNs (bare ACKs, FINs: IP length = the headers'
            # lengths) are not queued: nothing to read in them. SYNs are, so that the gate
            # knows a new connection on old ports. A sandbox's queued packets are limited: past
            # the rate they are dropped (TCP sends them again), so a SYN flood costs the edge
            # at most that many packets a second per sandbox.
            "gate": (
                "type filter hook forward priority -200; policy accept;",
                f"""    iifname "{br}" ct mark {ADMIT:#x} accept
    iifname "{br}" meta l4proto tcp ct mark {REFUSE:#x} reject with tcp reset
{bare}
    iifname "{br}" ip saddr . ip daddr . tcp dport @gated meta mark set {QUEUED:#x}
    iifname "{br}" ip saddr @gate_all meta l4proto tcp meta mark set {QUEUED:#x}
    meta mark {QUEUED:#x} add @gate_rate {{ ip saddr limit rate over {GATE_RATE}/second burst {GATE_BURST} packets }} drop""",
            ),
            "gate_verdict": (
                "type filter hook forward priority -100; policy accept;",
                f"""    iifname "{br}" meta mark {ADMIT:#x} ct mark set {ADMIT:#x}
    iifname "{br}" meta mark {REFUSE:#x} ct mark set {REFUSE:#x}
    iifname "{br}" meta l4proto tcp meta mark {REFUSE:#x} reject with tcp reset""",
            ),
            "forward": (
                "type filter hook forward priority -1; policy accept;",
                f"""    iifname "{br}" oifname "{br}" drop
    oifname "{br}" ct state established,related accept
    oifname "{br}" drop""",
            ),
            "input": (
                "type filter hook input priority -1; policy accept;",
                f"""    iifname "{br}" ip daddr {gw} udp dport 53 accept
    iifname "{br}" ip daddr {gw} tcp dport 53 accept
    iifname "{br}" ct state established,related accept
    iifname "{br}" drop""",
            ),
        }

    def gate_replace(self, gated: Iterable[str], gate_all: Iterable[str]) -> None:
        """Sets the name gate's sets to exactly these elements, in one transaction."""
        script = f"flush set inet {self.table} gated\nflush set inet {self.table} gate_all\n"
        for set_name, items in (("gated", list(gated)), ("gate_all", list(gate_all))):
            if items:
                script += f"add element inet {self.table} {set_name} {{ {', '.join(items)} }}\n"
        r = _nft(script)
        if r.returncode != 0:
            raise NetworkSetupError(f"nft: replacing the name gate's sets: {r.stderr.strip()}")

    def _iptables(self, *, add: bool) -> None:
        """The node's iptables rules: past Docker's forward policy (if Docker's chain is there)
        and the name gate's queue."""
        for table, chain, rule in self._iptables_rules:
            if subprocess.run(
                ["iptables", "-w", "5", "-t", table, "-S", chain], capture_output=True, env=_ENV
            ).returncode:
                if add and chain != "DOCKER-USER":
                    raise NetworkSetupError(f"iptables: no chain {chain} in table {table}")
                continue  # no Docker forward policy to get past
            present = not subprocess.run(
                ["iptables", "-w", "5", "-t", table, "-C", chain, *rule],
                capture_output=True,
                env=_ENV,
            ).returncode
            if add != present:
                r = subprocess.run(
                    ["iptables", "-w", "5", "-t", table, "-I" if add else "-D", chain, *rule],
                    capture_output=True,
                    text=True,
                    env=_ENV,
                )
                if r.returncode and add:
                    raise NetworkSetupError(f"iptables -t {table} -I {chain}: {r.stderr.strip()}")

    # ------------------------------------------------------------- the sandboxes

    def attach(self, sandbox_id: str, pid: int, address: ipaddress.IPv4Address) -> str:
        """Give the namespace of `pid` an eth0 with `address` on the bridge; returns the host
        end's name. Blocking."""
        nsfd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            host = self.add_port(sandbox_id, nsfd, "eth0")
        finally:
            os.close(nsfd)
        with netns_of(pid) as ns:
            lo = ns.link_lookup(ifname="lo")[0]
            ns.link("set", index=lo, state="up")
            eth = ns.link_lookup(ifname="eth0")[0]
            ns.addr("add", index=eth, address=str(address), prefixlen=self.subnet.prefixlen)
            ns.link("set", index=eth, state="up")
            ns.route("add", dst="0.0.0.0/0", gateway=str(self.gateway))
        return host

    def add_port(
        self, sandbox_id: str, netns_fd: int, peer: str, ingress: int | None = None
    ) -> str:
        """A veth pair: `peer` in the network namespace `netns_fd`, the host end (returned) an
        isolated port of the bridge with IPv6 off. `ingress`: a tc program (a guest's filter)
        attached to the host end's ingress before that end is on the bridge and up. Blocking."""
        host = veth_name(sandbox_id)
        with contextlib.closing(_ipr()) as ip:
            br = ip.link_lookup(ifname=self.bridge)
            if not br:
                raise NetworkSetupError(f"bridge {self.bridge} is missing")
            for idx in ip.link_lookup(ifname=host):  # a leftover of an earlier attempt
                ip.link("del", index=idx)
            ip.link("add", ifname=host, kind="veth", peer={"ifname": peer, "net_ns_fd": netns_fd})
            idx = ip.link_lookup(ifname=host)[0]
            _sysctl(f"net/ipv6/conf/{host}/disable_ipv6", "1")
            if ingress is not None:
                _attach_ingress(ip, idx, ingress)
            ip.link("set", index=idx, master=br[0])
            ip.brport("set", index=idx, isolated=1)
            ip.link("set", index=idx, state="up")
        return host

    def add_tap_port(self, sandbox_id: str, ingress: int) -> str:
        """The sandbox's existing tap (named as its host end would be: `veth_name`, made by
        its backend) made an isolated port of the bridge, with the tc program `ingress` on
        it before it is on the bridge and up. Returns its name. Blocking."""
        host = veth_name(sandbox_id)
        with contextlib.closing(_ipr()) as ip:
            br = ip.link_lookup(ifname=self.bridge)
            if not br:
                raise NetworkSetupError(f"bridge {self.bridge} is missing")
            found = ip.link_lookup(ifname=host)
            if not found:
                raise NetworkSetupError(f"the guest's tap {host} is missing")
            _sysctl(f"net/ipv6/conf/{host}/disable_ipv6", "1")
            _attach_ingress(ip, found[0], ingress)
            ip.link("set", index=found[0], master=br[0])
            ip.brport("set", index=found[0], isolated=1)
            ip.link("set", index=found[0], state="up")
        return host

    def attach_ingress(self, sandbox_id: str, program: int) -> bool:
        """(Re)attach a tc program to the ingress of the sandbox's host end; False if that end
        is gone. Blocking."""
        with contextlib.closing(_ipr()) as ip:
            found = ip.link_lookup(ifname=veth_name(sandbox_id))
            if found:
                _attach_ingress(ip, found[0], program)
        return bool(found)

    def detach(self, sandbox_id: str) -> bool:
        """Remove the sandbox's veth pair (if any). Blocking."""
        with contextlib.closing(_ipr()) as ip:
            found = ip.link_lookup(ifname=veth_name(sandbox_id))
            for idx in found:
                with contextlib.suppress(Exception):
                    ip.link("del", index=idx)
            return bool(found)

    def ports(self) -> list[str]:
        """Names of the veths on the bridge."""
        with contextlib.closing(_ipr()) as ip:
            br = ip.link_lookup(ifname=self.bridge)
            if not br:
                return []
            return [
                str(link.get_attr("IFLA_IFNAME"))
                for link in ip.get_links()
                if link.get_attr("IFLA_MASTER") == br[0]
            ]

    def remove_port(self, name: str) -> None:
        with contextlib.closing(_ipr()) as ip:
            for idx in ip.link_lookup(ifname=name):
                with contextlib.suppress(Exception):
                    ip.link("del", index=idx)
