"""Several "hosts" on one machine: each a network namespace with its own address.

A multi-node dsec cluster needs machines that reach each other over a network, each with its
own addresses and ports. :class:`HostLab` makes them on one machine, for the tests, the
benchmarks and a developer's trial run:

- a *fabric* namespace holding one bridge (the lab's switch; its own namespace, so the host's
  firewall, e.g. Docker's ``FORWARD`` policy with ``br_netfilter``, never sees the traffic);
- per host, a namespace ``dsec-<tag>-<name>`` whose ``eth0`` (address ``10.<a>.<b>.<10+i>/24``)
  is one end of a veth pair; the other end is a port of the bridge (``lab_<tag><i>``),
  and taking that port down cuts the host off, as a pulled cable does;
- a veth from the caller's namespace to the bridge (``10.<a>.<b>.1``), so the operator (a test,
  the CLI) reaches every host and every host reaches the operator.

A program runs on a host through :meth:`Host.command` (``nsenter --net``): only the network
namespace changes. Mounts, cgroups and files stay the machine's, so what a real host keeps
local (an edge's state directory, its layer cache, its claim on a sandbox bridge) must be given
a directory of that host's own (:meth:`Host.local`). ``ip netns exec`` is not used: it also
remounts ``/sys`` for the namespace, which hides the cgroup hierarchies an edge needs.

Everything the lab made is removed by :meth:`HostLab.close`, also after a failure: the
processes in its namespaces (those exist only because this lab made them), the namespaces and
the veth pairs.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

NETNS_DIR = Path("/run/netns")


class HostLabError(RuntimeError):
    """A lab could not be made (no free subnet, ``ip`` failed)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise HostLabError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network with an address in the caller's namespace."""
    out = _ip("-o", "-4", "addr", "show").stdout
    nets = []
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.IPv4Network(parts[parts.index("inet") + 1], strict=False))
    return nets


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.190.0.0/15 that no interface here uses (other labs' included)."""
    used = _used_networks()
    for third in range(256 * 2):
        net = ipaddress.IPv4Network(f"10.{190 + third // 256}.{third % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise HostLabError("no free /24 in 10.190.0.0/15 for a host lab")


def answers(address: str, timeout_s: float = 1.0) -> bool:
    """Whether ``address`` is reachable: a TCP connection to its (closed) port 9 is refused
    rather than timed out or unroutable."""
    with socket.socket() as s:
        s.settimeout(timeout_s)
        try:
            s.connect((address, 9))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return True


@dataclass
class Host:
    """One host of a lab: a network namespace with one address on the lab's bridge."""

    name: str
    netns: str
    address: str
    #: The bridge port (in the fabric namespace) of this host's link.
    port: str
    lab: HostLab = field(repr=False)

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.netns

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host (its network namespace; nothing else changes)."""
        return ["nsenter", f"--net={self.netns_path}", "--", *argv]

    def run(self, argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(argv), capture_output=True, text=True, **kw)  # type: ignore[call-overload, no-any-return]

    def local(self, *parts: str) -> Path:
        """A directory that is this host's own (what a real machine keeps on its own disk)."""
        d = self.lab.root / self.name
        for p in parts:
            d = d / p
        d.mkdir(parents=True, exist_ok=True)
        return d

    def pids(self) -> list[int]:
        """Every process in this host's network namespace (the lab made it: all are ours)."""
        r = _ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in r.stdout.split() if p.isdigit()]

    def kill_all(self, sig: int = signal.SIGKILL) -> list[int]:
        """Signals every process of this host; returns their PIDs."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def link_down(self) -> None:
        """Cuts this host off the lab's network (its bridge port down)."""
        _ip("-n", self.lab.fabric, "link", "set", self.port, "down")

    def link_up(self) -> None:
        _ip("-n", self.lab.fabric, "link", "set", self.port, "up")


class HostLab:
    """A set of hosts on one bridge, reachable from the caller's namespace (module doc)."""

    def __init__(self, root: Path, tag: str = "") -> None:
        self.root = root
        self.tag = tag or secrets.token_hex(2)
        if len(self.tag) > 6 or not self.tag.isalnum():
            raise HostLabError(f"lab tag {self.tag!r}: 1-6 letters or digits")
        self.fabric = f"dsec-{self.tag}-fabric"
        self.uplink = f"lab{self.tag}"  # the caller's end of its link to the bridge
        self.hosts: dict[str, Host] = {}
        self.subnet: ipaddress.IPv4Network | None = None
        self._made: list[str] = []  # namespaces made, for close()
        #: prefix -> the host routing it (a virtual IP's router), on every other host and here.
        self.routes: dict[str, Host] = {}

    @property
    def gateway(self) -> str:
        """The caller's address on the lab network."""
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def start(self) -> HostLab:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self.subnet = _free_subnet()
            _ip("netns", "add", self.fabric)
            self._made.append(self.fabric)
            _ip("-n", self.fabric, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.fabric, "link", "set", "br0", "up")
            _ip("link", "add", self.uplink, "type", "veth", "peer", "name", "up0")
            _ip("link", "set", "up0", "netns", self.fabric)
            _ip("-n", self.fabric, "link", "set", "up0", "master", "br0", "up")
            _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.uplink)
            _ip("link", "set", self.uplink, "up")
        except BaseException:
            self.close()
            raise
        return self

    def add_host(self, name: str) -> Host:
        """A new host ``name`` (``[a-z0-9]``, at most 12 characters) on the bridge."""
        if not re.fullmatch(r"[a-z0-9]+", name) or len(name) > 12:
            raise HostLabError(f"host name {name!r}: 1-12 lowercase letters or digits")
        if name in self.hosts:
            raise HostLabError(f"host {name!r} exists")
        assert self.subnet is not None, "start() the lab first"
        index = len(self.hosts)
        if index > 200:
            raise HostLabError("at most 200 hosts per lab")
        netns = f"dsec-{self.tag}-{name}"
        address = str(self.subnet.network_address + 10 + index)
        port = f"lab{self.tag}p{index}"
        _ip("netns", "add", netns)
        self._made.append(netns)
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("-n", self.fabric, "link", "add", port, "type", "veth", "peer", "name", "eth0")
        _ip("-n", self.fabric, "link", "set", "eth0", "netns", netns)
        _ip("-n", self.fabric, "link", "set", port, "master", "br0", "up")
        _ip("-n", netns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "route", "add", "default", "via", self.gateway)
        host = Host(name, netns, address, port, self)
        self.hosts[name] = host
        for prefix, via in self.routes.items():
            _ip("-n", netns, "route", "replace", prefix, "via", via.address)
        return host

    def route(self, prefix: str, via: Host) -> None:
        """``prefix`` (a virtual IP) reached through host ``via`` from here and from every
        other host, also those added later. Gone with the lab (the links carry the routes)."""
        self.routes[prefix] = via
        _ip("route", "replace", prefix, "via", via.address, "dev", self.uplink)
        for h in self.hosts.values():
            if h is not via:
                _ip("-n", h.netns, "route", "replace", prefix, "via", via.address)

    def wait_reachable(self, timeout_s: float = 10.0) -> None:
        """Until every host answers a ping from the caller (a new bridge port learns first)."""
        deadline = time.monotonic() + timeout_s
        for h in self.hosts.values():
            while not answers(h.address):
                if time.monotonic() > deadline:
                    raise HostLabError(f"host {h.name} ({h.address}) does not answer")

    def close(self) -> None:
        """Kills what runs on the hosts, removes the namespaces and the caller's veth."""
        for h in list(self.hosts.values()):
            h.kill_all()
        # Processes die asynchronously; a namespace is freed when its last one has.
        deadline = time.monotonic() + 10
        while any(h.pids() for h in self.hosts.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        _ip("link", "del", self.uplink, check=False)
        self.hosts.clear()

    def __enter__(self) -> HostLab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def host_lab(root: Path, names: list[str], tag: str = "") -> Iterator[HostLab]:
    """A started lab with ``names`` as hosts, closed on exit."""
    lab = HostLab(root, tag)
    with lab:
        for n in names:
            lab.add_host(n)
        lab.wait_reachable()
        yield lab
