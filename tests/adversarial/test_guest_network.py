"""VM guests' network, host side: the edge's namespace, tap, link and tc filter, with the same
policies, tries, counter and resolver as containers -- exercised with a stand-in for the guest.

The stand-in plays QEMU and the guest kernel: a network namespace of the test (the "guest")
with its own tap `eth0` (the guest's virtio NIC, configured as dsec's agent will configure the
guest from the record: MAC, address, default route), and a relay thread copying frames, virtio
net headers included, between that tap and the descriptor `open_tap` gives for the sandbox's
tap -- what QEMU does with `-netdev tap,fd=N` (virtio net header on, as the descriptor says). So every frame crosses the real tap,
the edge's namespace bridge, the veth and the tc program on its host end, sent by a real TCP/IP
stack. The first group of tests runs the program on crafted frames (BPF_PROG_TEST_RUN) for
what a real stack does not send (ARP for other addresses, VLAN tags, IP options, fragments).

Traffic goes only to the test's own namespaces: the private "internet" of `netlab` (10.199.N/24,
its DNS server and listeners) and the guests. Everything is removed afterwards, also on failure:
guests, relays, the edge's namespaces, links, bridge, nftables tables and pins.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import hashlib
import ipaddress
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from edge.network import bpf, guest
from edge.network.enforcer import GuestIdentity, SandboxFilter
from edge.network.links import veth_name
from edge.network.manager import NetworkManager
from edge.network.policy import Platform, compile_tables, parse
from edge.network.programs import TC_DROP, TC_PASS
from tests.adversarial.netlab import NetLab, remove_bridge

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, tap, bpf)")

INDEX = 200 + os.getpid() % 50  # apart from the container suite's lab (100..199)
PYPI = f"10.199.{INDEX}.3"
NPM = f"10.199.{INDEX}.4"
FILES = f"10.199.{INDEX}.5"
NAMES = {"pypi.org": PYPI, "files.pythonhosted.org": FILES, "registry.npmjs.org": NPM}
BRIDGE = f"dsg{os.getpid() % 100000}"
SUBNET = f"10.234.{INDEX}.0/24"
PIN_DIR = Path(f"/sys/fs/bpf/dsec-guest-test-{os.getpid()}")


def _allow(*targets: str, deny: tuple[str, ...] = (), open_mode: bool = False) -> dict[str, Any]:
    """A policy dict: "host" or "host:port" rules."""

    def rule(text: str) -> dict[str, Any]:
        host, _, port = text.partition(":")
        return {"target": host, "port_min": int(port or 0)}

    return {
        "mode": "NETWORK_MODE_OPEN" if open_mode else "NETWORK_MODE_ALLOWLIST",
        "allow": [rule(t) for t in targets],
        "deny": [rule(t) for t in deny],
    }


# ------------------------------------------------------------------ the program alone

MAC = bytes.fromhex("020000000007")
ADDRESS = ipaddress.IPv4Address("10.234.0.7")
PLATFORM = Platform(ipaddress.IPv4Network("10.234.0.0/24"), ipaddress.IPv4Address("10.234.0.1"))
OUTSIDE_MAC = bytes.fromhex("02aabbccddee")
ETH_IP, ETH_ARP, ETH_IP6, ETH_VLAN = 0x0800, 0x0806, 0x86DD, 0x8100


def _eth(payload: bytes, ethertype: int = ETH_IP, src: bytes = MAC) -> bytes:
    return OUTSIDE_MAC + src + struct.pack("!H", ethertype) + payload


def _ip(
    dst: str,
    proto: int,
    l4: bytes,
    src: str = str(ADDRESS),
    frag: int = 0,
    options: bytes = b"",
) -> bytes:
    ihl = 5 + len(options) // 4
    head = struct.pack(
        "!BBHHHBBH4s4s",
        0x40 | ihl,
        0,
        ihl * 4 + len(l4),
        1,
        frag,
        64,
        proto,
        0,
        socket.inet_aton(src),
        socket.inet_aton(dst),
    )
    return head + options + l4


def _tcp(dport: int, flags: int = 0x02, sport: int = 40000) -> bytes:
    return struct.pack("!HHIIBBHHH", sport, dport, 1, 0, 0x50, flags, 65535, 0, 0)


def _udp(dport: int, sport: int = 40000) -> bytes:
    return struct.pack("!HHHH", sport, dport, 12, 0) + b"ping"


def _icmp(kind: int = 8, ident: int = 7) -> bytes:
    return struct.pack("!BBHHH", kind, 0, 0, ident, 1) + b"x" * 8


def _arp(sha: bytes = MAC, spa: str = str(ADDRESS), tpa: str = "10.234.0.1") -> bytes:
    return struct.pack(
        "!HHBBH6s4s6s4s",
        1,
        ETH_IP,
        6,
        4,
        1,
        sha,
        socket.inet_aton(spa),
        b"\0" * 6,
        socket.inet_aton(tpa),
    )


def _run(prog_fd: int, frame: bytes) -> int:
    """The program's verdict on one frame (BPF_PROG_TEST_RUN)."""
    data = ctypes.create_string_buffer(frame, len(frame))
    attr = ctypes.create_string_buffer(
        struct.pack("=IIIIQQ", prog_fd, 0, len(frame), 0, ctypes.addressof(data), 0), 80
    )
    if bpf._libc.syscall(bpf.SYS_BPF, 10, attr, 80) < 0:
        raise OSError(ctypes.get_errno(), "BPF_PROG_TEST_RUN")
    return int(struct.unpack_from("=I", attr.raw, 4)[0])


@pytest.fixture
def program() -> Iterator[tuple[Callable[[bytes], int], SandboxFilter]]:
    """A guest filter for MAC/ADDRESS with: allow 10.199.0.3:443/tcp, 10.199.0.4 (any port),
    10.199.0.0/24 except 10.199.0.9 (deny wins)."""
    pins = PIN_DIR / "program"
    flt = SandboxFilter.create(pins, GuestIdentity(MAC, ADDRESS.packed))
    try:
        policy = parse(
            {
                "mode": "NETWORK_MODE_ALLOWLIST",
                "allow": [
                    {"target": "10.199.0.3", "port_min": 443, "protocol": "PROTOCOL_TCP"},
                    {"target": "10.199.0.4"},
                    {"target": "10.199.1.0/24"},
                ],
                "deny": [{"target": "10.199.1.9"}],
            }
        )
        flt.load(compile_tables(policy, PLATFORM))
        yield (lambda frame: _run(flt.fds["tc"], frame)), flt
    finally:
        flt.remove()
        with contextlib.suppress(OSError):
            PIN_DIR.rmdir()


def test_program_allows_only_what_the_policy_allows_and_counts_each_denied_flow_once(
    program: tuple[Callable[[bytes], int], SandboxFilter],
) -> None:
    run, flt = program
    assert run(_eth(_ip("10.199.0.3", 6, _tcp(443)))) == TC_PASS
    assert run(_eth(_ip("10.199.0.3", 6, _tcp(443, flags=0x10)))) == TC_PASS  # and its ACKs
    assert run(_eth(_ip("10.199.0.4", 17, _udp(9999)))) == TC_PASS
    assert run(_eth(_ip("10.199.0.4", 1, _icmp()))) == TC_PASS  # any port: any protocol
    assert run(_eth(_ip("10.199.1.8", 6, _tcp(80)))) == TC_PASS
    assert flt.blocked() == 0
    syn = _eth(_ip("10.199.0.3", 6, _tcp(80)))  # allowed host, other port
    assert run(syn) == TC_DROP
    assert run(syn) == TC_DROP  # a retransmitted SYN: the same connect
    assert flt.blocked() == 1
    assert run(_eth(_ip("10.199.0.3", 6, _tcp(80, sport=40001)))) == TC_DROP
    assert flt.blocked() == 2
    assert run(_eth(_ip("10.199.0.3", 6, _tcp(80, flags=0x10, sport=40002)))) == TC_DROP
    assert run(_eth(_ip("10.199.0.3", 6, _tcp(80, flags=0x12, sport=40003)))) == TC_DROP
    assert flt.blocked() == 2  # no SYN, no new connection: dropped, not counted
    assert run(_eth(_ip("10.199.1.9", 6, _tcp(80)))) == TC_DROP  # deny wins
    assert run(_eth(_ip("10.199.0.3", 17, _udp(443)))) == TC_DROP  # TCP only
    assert run(_eth(_ip("10.199.0.3", 1, _icmp(ident=1)))) == TC_DROP
    assert run(_eth(_ip("10.199.0.3", 1, _icmp(ident=1)))) == TC_DROP
    assert run(_eth(_ip("10.199.0.3", 1, _icmp(kind=3)))) == TC_DROP  # an error: no flow
    assert run(_eth(_ip("10.199.0.3", 47, b"\0" * 8))) == TC_DROP  # GRE: port 0
    assert flt.blocked() == 6


def test_program_platform_rules_dns_subnet_host_and_loopback(
    program: tuple[Callable[[bytes], int], SandboxFilter],
) -> None:
    run, flt = program
    assert run(_eth(_ip("10.234.0.1", 17, _udp(53)))) == TC_PASS  # the edge's resolver
    assert run(_eth(_ip("10.234.0.1", 6, _tcp(53)))) == TC_PASS
    for dst, l4, proto in [
        ("10.199.0.4", _udp(53), 17),  # DNS elsewhere, even to an allowed host
        ("10.234.0.1", _tcp(22), 6),  # the host
        ("10.234.0.8", _tcp(8080), 6),  # a neighbour
        ("127.0.0.1", _tcp(8080), 6),  # the host's loopback services
        ("0.0.0.0", _tcp(8080), 6),
        ("169.254.169.254", _tcp(80), 6),
        ("224.0.0.251", _udp(5353), 17),
    ]:
        assert run(_eth(_ip(dst, proto, l4))) == TC_DROP, dst
    assert flt.blocked() == 7


def test_program_drops_spoofed_and_foreign_frames_uncounted(
    program: tuple[Callable[[bytes], int], SandboxFilter],
) -> None:
    run, flt = program
    allowed = _ip("10.199.0.4", 6, _tcp(80))
    assert run(_eth(allowed)) == TC_PASS
    assert run(_eth(allowed, src=bytes.fromhex("020000000008"))) == TC_DROP  # another MAC
    assert run(_eth(_ip("10.199.0.4", 6, _tcp(80), src="10.234.0.8"))) == TC_DROP
    assert run(_eth(_ip("255.255.255.255", 17, _udp(67, 68), src="0.0.0.0"))) == TC_DROP
    assert run(_eth(_ip("10.199.0.4", 6, _tcp(80), options=b"\x01" * 4))) == TC_DROP
    assert run(_eth(b"\x60" + b"\0" * 60, ETH_IP6)) == TC_DROP  # IPv6 is off
    assert run(_eth(struct.pack("!HH", 5, ETH_IP) + allowed, ETH_VLAN)) == TC_DROP
    assert run(_eth(allowed)[:40]) == TC_DROP  # a TCP header cut short
    assert run(_eth(_arp(), ETH_ARP)) == TC_PASS
    assert run(_eth(_arp(spa="10.234.0.8"), ETH_ARP)) == TC_DROP  # ARP for another address
    assert run(_eth(_arp(sha=bytes.fromhex("020000000008")), ETH_ARP)) == TC_DROP
    assert run(_eth(_arp(), ETH_ARP, src=bytes.fromhex("020000000008"))) == TC_DROP
    assert flt.blocked() == 0


def test_program_fragments(program: tuple[Callable[[bytes], int], SandboxFilter]) -> None:
    run, _ = program
    more = 0x2000
    assert run(_eth(_ip("10.199.0.3", 6, _tcp(443), frag=more))) == TC_PASS
    assert run(_eth(_ip("10.199.0.3", 6, _tcp(80), frag=more))) == TC_DROP  # checked: ports
    # Later fragments carry no ports; without a first one they are never reassembled.
    assert run(_eth(_ip("10.199.0.3", 6, b"\0" * 16, frag=185))) == TC_PASS
    assert run(_eth(_ip("10.199.0.3", 6, b"\0" * 16, frag=185, src="10.234.0.8"))) == TC_DROP


# --------------------------------------------------------------- the stand-in guest

_CLIENT = textwrap.dedent(
    r"""
    import errno, socket, struct, sys
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "tcp":  # host port [source]
        s = socket.socket()
        s.settimeout(float(args[3]) if len(args) > 3 else 3)
        if len(args) > 2 and args[2]:
            s.bind((args[2], 0))
        try:
            s.connect((args[0], int(args[1])))
            print("ok", s.recv(100).decode().strip())
        except OSError as exc:
            print("error", errno.errorcode.get(exc.errno, "timeout"))
    elif cmd == "dns":  # server name
        q = struct.pack("!6H", 0x1234, 0x0100, 1, 0, 0, 0)
        q += b"".join(bytes([len(p)]) + p.encode() for p in args[1].split(".")) + b"\0\0\1\0\1"
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(3)
        try:
            s.sendto(q, (args[0], 53))
            r = s.recv(4096)
        except OSError:
            print("timeout")
            sys.exit()
        rcode, an = struct.unpack("!H", r[2:4])[0] & 0xF, struct.unpack("!H", r[6:8])[0]
        print("rcode", rcode, *(socket.inet_ntoa(r[-4:]),) if an else ())
    elif cmd == "send":  # host port bytes: send that many, print the digest the sink saw
        import hashlib
        data = bytes(range(256)) * (int(args[2]) // 256)
        s = socket.create_connection((args[0], int(args[1])), timeout=20)
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        print(s.makefile().read().strip() == hashlib.sha256(data).hexdigest(), len(data))
    elif cmd == "listen":  # port: print each connection until stdin closes
        import threading
        s = socket.socket()
        s.bind(("0.0.0.0", int(args[0])))
        s.listen()
        print("listening", flush=True)
        def serve():
            while True:
                c, a = s.accept()
                print("accepted", a[0], flush=True)
                c.close()
        threading.Thread(target=serve, daemon=True).start()
        sys.stdin.read()
    """
)


def _sh(*argv: str, check: bool = True) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30).stdout


_TUNSETOFFLOAD = 0x400454D0
_TUN_F_CSUM, _TUN_F_TSO4 = 0x01, 0x02


@dataclass
class StandIn:
    """The guest: a namespace with tap eth0, relayed to the sandbox's tap like QEMU does."""

    name: str
    info: dict[str, Any]
    fds: list[int] = field(default_factory=list)
    largest_sent: int = 0  # bytes of the largest frame the guest sent (with its virtio header)
    _stop: tuple[int, int] | None = None
    _relay: threading.Thread | None = None

    def start(self) -> StandIn:
        _sh("ip", "netns", "add", self.name)
        self.fds.append(guest.open_tap(Path("/run/netns") / self.name, "eth0"))  # made here
        self.fds.append(guest.open_tap(Path(self.info["netns"])))
        for fd in self.fds:  # a virtio-net guest's offloads, as QEMU sets them on its tap
            fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_CSUM | _TUN_F_TSO4)
        self._stop = os.pipe()
        self._relay = threading.Thread(target=self._copy, name=f"relay-{self.name}", daemon=True)
        self._relay.start()
        self.configure(self.info["mac"])
        return self

    def configure(self, mac: str) -> None:
        """What dsec's agent does in a restored guest, from the record."""
        ns = ("ip", "-n", self.name)
        _sh(*ns, "link", "set", "lo", "up")
        _sh(*ns, "link", "set", "eth0", "address", mac)
        _sh(
            *ns,
            "addr",
            "replace",
            f"{self.info['address']}/{self.info['prefix_len']}",
            "dev",
            "eth0",
        )
        _sh(*ns, "link", "set", "eth0", "up")
        _sh(*ns, "route", "replace", "default", "via", self.info["gateway"])

    def _copy(self) -> None:
        assert self._stop is not None
        nic, tap = self.fds
        peer = {nic: tap, tap: nic}
        while True:
            ready, _, _ = select.select([nic, tap, self._stop[0]], [], [])
            if self._stop[0] in ready:
                return
            for fd in ready:
                frame = os.read(fd, 65536 + 12)
                if fd == nic:
                    self.largest_sent = max(self.largest_sent, len(frame))
                with contextlib.suppress(OSError):  # a link that is down drops it, as QEMU does
                    os.write(peer[fd], frame)

    def send_frame(self, frame: bytes) -> None:
        """A frame as the guest's NIC would send it (an empty virtio net header first)."""
        os.write(self.fds[1], b"\0" * 10 + frame)

    async def run(self, *args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            "ip",
            "netns",
            "exec",
            self.name,
            sys.executable,
            "-c",
            _CLIENT,
            *args,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        return out.decode().strip()

    async def tcp(self, host: str, port: int, source: str = "", timeout_s: float = 10) -> str:
        """ "ok <reply>" or "error <errno name>"; give denied ones a short timeout: no RST
        comes back, they time out."""
        return await self.run("tcp", host, str(port), source, str(timeout_s))

    def close(self) -> None:
        if self._stop is not None:
            os.write(self._stop[1], b"x")
            if self._relay is not None:
                self._relay.join(5)
            os.close(self._stop[0])
            os.close(self._stop[1])
            self._stop = None
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        _sh("ip", "netns", "del", self.name, check=False)


@pytest.fixture(scope="module")
def world() -> Iterator[NetLab]:
    lab = NetLab(INDEX, dict(NAMES), tag="g")
    try:
        yield lab.start()
    finally:
        lab.close()
        remove_bridge(BRIDGE)
        shutil.rmtree(PIN_DIR, ignore_errors=True)


def _manager(world: NetLab) -> NetworkManager:
    return NetworkManager(bridge=BRIDGE, subnet=SUBNET, upstream=world.dns, pin_root=PIN_DIR)


@pytest.fixture
async def net(world: NetLab) -> AsyncIterator[NetworkManager]:
    mgr = _manager(world)
    try:
        yield mgr
    finally:
        await mgr.close(teardown=True)
        remove_bridge(BRIDGE)  # had a test left something behind


Attach = Callable[..., Awaitable[StandIn]]


@pytest.fixture
async def make_guest(net: NetworkManager, tmp_path: Path) -> AsyncIterator[Attach]:
    """Factory: a networked guest with `policy` (a dict), removed afterwards."""
    made: list[tuple[str, StandIn | None]] = []

    async def make(raw: dict[str, Any], *, mgr: NetworkManager | None = None) -> StandIn:
        mgr = mgr or net
        sid = f"g{len(made)}-{os.getpid()}"
        policy, resolved = await asyncio.to_thread(mgr.check, raw)
        made.append((sid, None))
        info = await mgr.attach_guest(sid, tmp_path / "netns", policy, resolved)
        stand_in = StandIn(f"dsgg{os.getpid()}{len(made)}", info)
        made[-1] = (sid, stand_in)
        return stand_in.start()

    try:
        yield make
    finally:
        for sid, stand_in in made:
            if stand_in is not None:
                stand_in.close()
            await net.detach_guest(sid, tmp_path / "netns")


# ------------------------------------------------------------------ through the tap


async def test_allowed_reachable_denied_dropped_and_counted_once(
    make_guest: Attach, net: NetworkManager
) -> None:
    g = await make_guest(_allow("pypi.org:443"))
    sid = g.info["owner"]
    assert await g.tcp(PYPI, 443) == "ok pypi.org"
    assert net.blocked(sid) == 0
    # No RST comes back: the guest's connect times out, its SYN retransmits count once.
    assert await g.tcp(NPM, 443, timeout_s=3.5) == "error timeout"
    assert net.blocked(sid) == 1
    assert await g.tcp(PYPI, 80, timeout_s=2) == "error timeout"  # the allowed host, another port
    assert net.blocked(sid) == 2
    assert await g.tcp(PYPI, 443) == "ok pypi.org"


async def test_deny_wins(make_guest: Attach) -> None:
    g = await make_guest(_allow(f"10.199.{INDEX}.0/24", deny=(NPM,)))
    assert await g.tcp(PYPI, 443) == "ok pypi.org"
    assert await g.tcp(FILES, 80) == "ok files.pythonhosted.org"
    assert await g.tcp(NPM, 443, timeout_s=2) == "error timeout"


async def test_a_policy_replaced_while_running_takes_effect_on_the_next_connection(
    make_guest: Attach, net: NetworkManager
) -> None:
    g = await make_guest(_allow("pypi.org:443"))
    assert await g.tcp(PYPI, 443) == "ok pypi.org"
    await net.replace(g.info["owner"], _allow("registry.npmjs.org:443"))
    assert await g.tcp(NPM, 443) == "ok registry.npmjs.org"
    assert await g.tcp(PYPI, 443, timeout_s=2) == "error timeout"
    await net.replace(g.info["owner"], {})  # NONE: nothing at all
    assert await g.tcp(NPM, 443, timeout_s=2) == "error timeout"


async def test_dns_only_through_the_edge_and_domain_rules_learned_from_it(
    make_guest: Attach, net: NetworkManager, world: NetLab
) -> None:
    g = await make_guest(
        _allow("*.pythonhosted.org:443", "pypi.org:443", deny=("registry.npmjs.org",))
    )
    sid = g.info["owner"]
    # The lab's DNS server answers anyone: straight to it is dropped (and counted).
    assert await g.run("dns", world.dns, "pypi.org") == "timeout"
    assert net.blocked(sid) == 1
    assert await g.run("dns", g.info["dns"], "pypi.org") == f"rcode 0 {PYPI}"
    assert await g.run("dns", g.info["dns"], "registry.npmjs.org") == "rcode 3"  # NXDOMAIN
    assert await g.run("dns", g.info["dns"], "example.org") == "rcode 5"  # not named: REFUSED
    assert net.dns_refusals_of(sid) == 2
    # A wildcard rule: its names' addresses are allowed once the edge has answered for them.
    assert await g.tcp(FILES, 443, timeout_s=2) == "error timeout"
    assert await g.run("dns", g.info["dns"], "files.pythonhosted.org") == f"rcode 0 {FILES}"
    assert await g.tcp(FILES, 443) == "ok files.pythonhosted.org"


async def test_spoofed_source_address_or_mac_is_dropped(
    make_guest: Attach, net: NetworkManager
) -> None:
    g = await make_guest(_allow("pypi.org:443"))
    sid = g.info["owner"]
    assert await g.tcp(PYPI, 443) == "ok pypi.org"
    spoofed = str(ipaddress.IPv4Address(g.info["address"]) + 100)
    _sh("ip", "-n", g.name, "addr", "add", f"{spoofed}/32", "dev", "eth0")
    assert await g.tcp(PYPI, 443, source=spoofed, timeout_s=2) == "error timeout"
    # A freshly restored clone still has its template's MAC: nothing gets out until it is told.
    g.configure("02:00:00:00:00:42")
    assert await g.tcp(PYPI, 443, timeout_s=2) == "error timeout"
    g.configure(g.info["mac"])
    assert await g.tcp(PYPI, 443) == "ok pypi.org"
    assert net.blocked(sid) == 0  # spoofed frames are not connects to anywhere


async def test_arp_only_for_the_guests_own_address(make_guest: Attach, net: NetworkManager) -> None:
    g = await make_guest(_allow("pypi.org:443"))
    mac = bytes.fromhex(g.info["mac"].replace(":", ""))
    own, other = g.info["address"], str(ipaddress.IPv4Address(g.info["address"]) + 50)

    def request(spa: str) -> bytes:  # "who has the gateway?", asked from `spa`
        arp = _arp(mac, spa, g.info["gateway"])
        return b"\xff" * 6 + mac + struct.pack("!H", ETH_ARP) + arp

    def neighbours() -> str:
        return _sh("ip", "neigh", "show", "dev", BRIDGE)

    _sh("ip", "neigh", "flush", "dev", BRIDGE)
    g.send_frame(request(other))
    g.send_frame(request(own))
    await _until(lambda: own in neighbours())  # the host answered the guest for itself
    assert other not in neighbours()


async def test_neighbour_guests_and_the_host_are_unreachable(
    make_guest: Attach, net: NetworkManager
) -> None:
    a = await make_guest(_allow(open_mode=True))
    b = await make_guest(_allow(open_mode=True))
    listener = await asyncio.create_subprocess_exec(
        "ip",
        "netns",
        "exec",
        b.name,
        sys.executable,
        "-c",
        _CLIENT,
        "listen",
        "8080",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert listener.stdout is not None and listener.stdin is not None
    # Past ARP (isolated bridge ports never carry B's answer): A knows B's MAC, so its frames
    # go out addressed to B and meet A's filter.
    _sh(
        "ip",
        "-n",
        a.name,
        "neigh",
        "replace",
        b.info["address"],
        "lladdr",
        b.info["mac"],
        "dev",
        "eth0",
    )
    try:
        assert (await asyncio.wait_for(listener.stdout.readline(), 10)).strip() == b"listening"
        assert await a.tcp(b.info["address"], 8080, timeout_s=2) == "error timeout"
        # ... even with a rule naming the neighbour: the platform's deny comes first.
        await net.replace(a.info["owner"], _allow(f"{b.info['address']}:8080"))
        assert await a.tcp(b.info["address"], 8080, timeout_s=2) == "error timeout"
        # The host's own services, at the address the guest routes through.
        with socket.create_server((a.info["gateway"], 0)) as service:
            port = service.getsockname()[1]
            assert await a.tcp(a.info["gateway"], port, timeout_s=2) == "error timeout"
            service.settimeout(0.2)
            with pytest.raises(TimeoutError):
                service.accept()
    finally:
        listener.stdin.close()
        listener.kill()
        out, _ = await listener.communicate()
    assert b"accepted" not in out  # nothing from the neighbour ever reached it
    assert net.blocked(a.info["owner"]) == 3


async def _until(check: Callable[[], bool], timeout_s: float = 10) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


# ------------------------------------------------------------- lifecycle and cleanup

_TUNGETIFF = 0x800454D2


def _ns(netns: Path, *argv: str) -> str:
    return _sh("nsenter", f"--net={netns}", *argv)


def test_the_namespace_holds_the_tap_and_open_tap_attaches_one_vnet_hdr_descriptor(
    tmp_path: Path,
) -> None:
    netns = guest.create_netns(tmp_path, "t0")
    try:
        assert guest.create_netns(tmp_path, "t0") == netns  # there already: kept
        links = _ns(netns, "ip", "-o", "link")
        assert "tap0:" in links and "master br0" in links and "br0:" in links
        assert _ns(netns, "cat", "/proc/sys/net/ipv6/conf/all/disable_ipv6").strip() == "1"
        assert _ns(netns, "ip", "-o", "addr").count("inet") == 0  # it never sends of its own
        fd = guest.open_tap(netns)
        try:
            name, flags = struct.unpack("16sH22x", fcntl.ioctl(fd, _TUNGETIFF, bytes(40)))
            assert name.rstrip(b"\0") == b"tap0"
            assert flags & guest.TAP_FLAGS == guest.TAP_FLAGS  # QEMU probes IFF_VNET_HDR
            with pytest.raises(OSError) as busy:
                guest.open_tap(netns)
            assert busy.value.errno == 16  # EBUSY: single queue, one QEMU at a time
        finally:
            os.close(fd)
        os.close(guest.open_tap(netns))  # free again once closed
    finally:
        assert guest.remove_netns(netns)
    _assert_namespace_gone(netns)


@pytest.mark.skipif(not shutil.which("qemu-system-x86_64"), reason="no QEMU")
def test_qemu_takes_the_tap_descriptor(tmp_path: Path) -> None:
    """`-netdev tap,fd=N` with nothing else: QEMU 7.2 refuses vnet_hdr= beside fd=."""
    netns = guest.create_netns(tmp_path, "q0")
    qemu = None
    try:
        fd = guest.open_tap(netns)
        try:
            qemu = subprocess.Popen(
                ["qemu-system-x86_64", "-M", "microvm", "-accel", "tcg", "-S", "-nodefaults",
                 "-display", "none", "-netdev", f"tap,id=net0,fd={fd}",
                 "-device", "virtio-net-device,netdev=net0", "-qmp", "stdio"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                pass_fds=[fd],
            )  # fmt: skip
        finally:
            os.close(fd)
        assert qemu.stdout is not None and qemu.stdin is not None
        assert '"QMP"' in qemu.stdout.readline(), qemu.stderr.read() if qemu.stderr else ""
        with pytest.raises(OSError):  # QEMU holds the tap now
            os.close(guest.open_tap(netns))
        qemu.stdin.write('{"execute": "qmp_capabilities"}\n{"execute": "quit"}\n')
        qemu.stdin.flush()
        assert qemu.wait(timeout=10) == 0
        os.close(guest.open_tap(netns))  # and free again once it is gone
    finally:
        if qemu is not None and qemu.poll() is None:
            qemu.kill()
            qemu.wait()
        guest.remove_netns(netns)


def _assert_namespace_gone(netns: Path) -> None:
    assert not netns.exists()
    assert str(netns) not in Path("/proc/self/mountinfo").read_text()


def _assert_gone(sandbox_id: str, info: dict[str, Any]) -> None:
    assert not _sh("ip", "-o", "link", "show", veth_name(sandbox_id), check=False)
    _assert_namespace_gone(Path(info["netns"]))
    assert not (PIN_DIR / sandbox_id).exists()


async def test_detach_leaves_no_link_namespace_or_pin_while_qemu_still_holds_the_tap(
    net: NetworkManager, tmp_path: Path
) -> None:
    sid = f"detach-{os.getpid()}"
    policy, resolved = await asyncio.to_thread(net.check, _allow("pypi.org:443"))
    info = await net.attach_guest(sid, tmp_path, policy, resolved)
    tap = None
    try:
        assert _sh("ip", "-o", "link", "show", info["veth"])
        assert (PIN_DIR / sid / "tc").exists() and guest.is_netns(Path(info["netns"]))
        tap = guest.open_tap(Path(info["netns"]))
        await net.detach_guest(sid, tmp_path)
        _assert_gone(sid, info)
        assert net.blocked(sid) is None and not net.is_attached(sid)
    finally:
        if tap is not None:
            os.close(tap)
        await net.detach_guest(sid, tmp_path)  # (again: nothing left to do)


async def test_an_edge_restart_adopts_a_running_guest(world: NetLab, tmp_path: Path) -> None:
    sid = f"adopt-{os.getpid()}"
    first, second = _manager(world), _manager(world)
    stand_in = None
    try:
        policy, resolved = await asyncio.to_thread(first.check, _allow("pypi.org:443"))
        info = await first.attach_guest(sid, tmp_path, policy, resolved)
        stand_in = StandIn(f"dsgg{os.getpid()}a", info).start()
        assert await stand_in.tcp(PYPI, 443) == "ok pypi.org"
        await first.close(teardown=False)  # the edge goes; the kernel keeps enforcing
        assert await stand_in.tcp(NPM, 443, timeout_s=2) == "error timeout"
        # allowed by name: the name gate is gone with the edge, so its queue drops the
        # connection's packets (closed, not open) until the next edge reads it
        assert await stand_in.tcp(PYPI, 443, timeout_s=2) == "error timeout"
        assert await second.adopt_guest(sid, info, policy)
        assert await stand_in.tcp(PYPI, 443) == "ok pypi.org"
        filters = _sh("tc", "filter", "show", "dev", info["veth"], "ingress")
        assert filters.count(" handle ") == 1  # put back in place, not added twice
        assert second.blocked(sid) == 1  # the counter lives in the pinned map
        assert await second.cleanup_orphans({sid}, netns_dir=tmp_path) == []
        assert await stand_in.run("dns", info["dns"], "pypi.org") == f"rcode 0 {PYPI}"
        await second.replace(sid, _allow("registry.npmjs.org:443"))  # pins reopened
        assert await stand_in.tcp(NPM, 443) == "ok registry.npmjs.org"
        assert await stand_in.tcp(PYPI, 443, timeout_s=2) == "error timeout"
    finally:
        if stand_in is not None:
            stand_in.close()
        await second.detach_guest(sid, tmp_path)
        await second.close(teardown=True)
        remove_bridge(BRIDGE)
    _assert_gone(sid, info)


async def test_adopting_a_guest_whose_namespace_is_gone_fails(
    net: NetworkManager, tmp_path: Path
) -> None:
    info = {"address": "10.234.0.9", "netns": str(tmp_path / "missing")}
    policy = parse(_allow("pypi.org:443"))
    assert not await net.adopt_guest("missing", info, policy)
    assert not net.is_attached("missing")


async def test_cleanup_orphans_removes_what_a_crashed_edge_left(
    world: NetLab, tmp_path: Path
) -> None:
    sid = f"orphan-{os.getpid()}"
    crashed, fresh = _manager(world), _manager(world)
    try:
        policy, resolved = await asyncio.to_thread(crashed.check, _allow("pypi.org:443"))
        info = await crashed.attach_guest(sid, tmp_path, policy, resolved)
        await crashed.close(teardown=False)
        removed = await fresh.cleanup_orphans(set(), netns_dir=tmp_path)
        assert sorted(removed) == sorted([f"netns:{sid}", f"bpf:{sid}", f"veth:{info['veth']}"])
        _assert_gone(sid, info)
    finally:
        await fresh.detach_guest(sid, tmp_path)
        remove_bridge(BRIDGE)


_SINK = textwrap.dedent(
    r"""
    import hashlib, socket, sys
    s = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("ready", flush=True)
    c, _ = s.accept()
    h = hashlib.sha256()
    while chunk := c.recv(1 << 16):
        h.update(chunk)
    print(h.hexdigest(), flush=True)
    c.sendall(h.hexdigest().encode() + b"\n")
    """
)


async def test_bulk_data_with_the_guests_offloads_passes_whole(
    make_guest: Attach, world: NetLab
) -> None:
    """Segmentation-offloaded frames (up to 64 KiB, checksum left to the host) cross the tap and
    the filter as QEMU hands them over with the virtio net header."""
    g = await make_guest(_allow(f"{PYPI}:8443"))
    sink = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", world.netns, sys.executable, "-c", _SINK, PYPI, "8443",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert sink.stdout is not None
    try:
        assert (await asyncio.wait_for(sink.stdout.readline(), 10)).strip() == b"ready"
        assert await g.run("send", PYPI, "8443", str(8 << 20)) == f"True {8 << 20}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            sink.kill()
        await sink.wait()
    assert g.largest_sent > 16 << 10  # segmentation was left to the host


# ------------------------------------------------------------------ a real guest

_GUEST_INIT = r"""#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /bin
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do insmod /mod/$m.ko; done
for kv in $(cat /proc/cmdline); do
  case "$kv" in t.*=*) k=${kv%%=*}; eval "${k#t.}=${kv#*=}";; esac
done
i=0; until [ -e /sys/class/net/eth0 ] || [ $i -gt 500 ]; do i=$((i+1)); sleep 0.01; done
say() { echo "T $*" > /dev/ttyS0; }
ip addr add $ip/$prefix dev eth0; ip link set eth0 up; ip route add default via $gw
say "template-mac $(nc -w 2 $allowed 443 </dev/null 2>&1)"
ip link set eth0 down; ip link set eth0 address $mac; ip link set eth0 up
ip route replace default via $gw
say "allowed $(nc -w 10 $allowed 443 </dev/null 2>&1)"
say "denied $(nc -w 2 $denied 443 </dev/null 2>&1)"
# the A record only (one query, not A and AAAA at once), asked again as a stub resolver
# would if the guest (under TCG, on a loaded host) gave up before the answer came
for n in 1 2 3; do
  a=$(timeout 10 nslookup -type=a pypi.org $gw 2>&1 | tr '\n' ' ')
  case "$a" in *"Address: "*) break;; esac  # an answer's (the server's has a tab)
done
say "dns-edge $a"
say "dns-outside $(timeout 3 nslookup pypi.org $outside 2>&1 | tr '\n' ' ')"
say "bulk $(dd if=/dev/zero bs=65536 count=128 2>/dev/null | nc -w 5 $allowed 8443 2>&1)"
poweroff -f
"""
_NIC_MODULES = ("virtio_mmio", "virtio_net")


def _guest_kit(root: Path) -> tuple[Path, Path] | None:
    """A Debian cloud kernel and an initramfs of busybox, its virtio-net modules and
    `_GUEST_INIT`; None where this host has not the pieces."""
    kernels = sorted(Path("/boot").glob("vmlinuz-*-cloud-amd64"))
    busybox = Path("/bin/busybox")
    if not kernels or not busybox.exists() or not shutil.which("cpio"):
        return None
    release = kernels[-1].name.removeprefix("vmlinuz-")
    modules = Path("/lib/modules") / release
    deps = {
        Path(path).name.removesuffix(".ko"): (path, rest.split())
        for path, _, rest in (
            line.partition(":") for line in (modules / "modules.dep").read_text().splitlines()
        )
    }
    order: list[str] = []

    def visit(name: str) -> None:
        for dep in deps[name][1]:
            visit(Path(dep).name.removesuffix(".ko"))
        if name not in order:
            order.append(name)

    for name in _NIC_MODULES:
        visit(name)
    tree = root / "tree"
    (tree / "bin").mkdir(parents=True)
    (tree / "mod").mkdir()
    shutil.copy(busybox, tree / "bin" / "busybox")
    for name in order:
        shutil.copy(modules / deps[name][0], tree / "mod" / f"{name}.ko")
    (tree / "modules.order").write_text("\n".join(order) + "\n")
    (tree / "init").write_text(_GUEST_INIT)
    (tree / "init").chmod(0o755)
    files = subprocess.run(["find", "."], cwd=tree, capture_output=True, check=True).stdout
    archive = subprocess.run(
        ["cpio", "-o", "-H", "newc"], cwd=tree, input=files, capture_output=True, check=True
    ).stdout
    initrd = root / "initrd"
    initrd.write_bytes(archive)
    return kernels[-1], initrd


def _tsc_khz() -> int:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("cpu MHz"):
            return int(float(line.split(":")[1]) * 1000)
    return 0


@pytest.mark.skipif(not shutil.which("qemu-system-x86_64"), reason="no QEMU")
async def test_a_real_microvm_guest_through_the_tap(
    net: NetworkManager, world: NetLab, tmp_path: Path
) -> None:
    """QEMU's virtio-net with the virtio header on, a guest kernel's own stack and offloads:
    configured after boot as a restored clone is (it starts with its template's MAC)."""
    kit = await asyncio.to_thread(_guest_kit, tmp_path)
    if kit is None:
        pytest.skip("no Debian cloud kernel, static busybox or cpio on this host")
    sid = f"vm-{os.getpid()}"
    policy, resolved = await asyncio.to_thread(net.check, _allow("pypi.org:443", f"{PYPI}:8443"))
    info = await net.attach_guest(sid, tmp_path / "netns", policy, resolved)
    sink = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", world.netns, sys.executable, "-c", _SINK, PYPI, "8443",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    qemu = None
    try:
        assert sink.stdout is not None
        assert (await asyncio.wait_for(sink.stdout.readline(), 10)).strip() == b"ready"
        tap = await asyncio.to_thread(guest.open_tap, Path(info["netns"]))
        args = {
            "mac": info["mac"], "ip": info["address"], "prefix": info["prefix_len"],
            "gw": info["gateway"], "allowed": PYPI, "denied": NPM, "outside": world.dns,
        }  # fmt: skip
        append = f"console=ttyS0 tsc_early_khz={_tsc_khz()} quiet panic=-1 " + " ".join(
            f"t.{k}={v}" for k, v in args.items()
        )
        try:
            qemu = await asyncio.create_subprocess_exec(
                "qemu-system-x86_64", "-M", "microvm,acpi=on", "-accel", "tcg", "-cpu", "max",
                "-m", "256M", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
                "-kernel", str(kit[0]), "-initrd", str(kit[1]), "-append", append,
                "-serial", "stdio", "-netdev", f"tap,id=net0,fd={tap}",
                "-device", "virtio-net-device,netdev=net0,mac=02:00:00:00:00:01",
                stdout=asyncio.subprocess.PIPE, pass_fds=[tap],
            )  # fmt: skip
        finally:
            os.close(tap)
        assert qemu.stdout is not None
        said = {}
        async for line in qemu.stdout:
            if line.startswith(b"T "):
                key, _, value = line.decode().strip()[2:].partition(" ")
                said[key] = value
        assert await asyncio.wait_for(qemu.wait(), 60) == 0
        assert "timed out" in said["template-mac"]
        assert said["allowed"] == "pypi.org"
        assert "timed out" in said["denied"]
        assert f"Address: {PYPI}" in said["dns-edge"] and PYPI not in said["dns-outside"], said
        digest = await asyncio.wait_for(sink.stdout.readline(), 10)
        assert digest.strip() == hashlib.sha256(bytes(8 << 20)).hexdigest().encode()
        assert net.blocked(sid) == 2  # the denied connect, the outside DNS server
    finally:
        for proc in (qemu, sink):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()
        await net.detach_guest(sid, tmp_path / "netns")
    _assert_gone(sid, info)
