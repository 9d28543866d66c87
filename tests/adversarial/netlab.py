"""A private "internet" for network-policy tests: a network namespace the test creates, with a
DNS server and TCP listeners that answer for pypi.org and registry.npmjs.org.

Traffic goes only to addresses inside that namespace (10.199.N.0/24, reached from the host
through a veth pair) and to the edge on loopback/bridge: never to an outside address. The
namespace, the veth and the processes in it are removed by `close()`, also after failures.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

# DNS server + listeners, run inside the namespace (stdlib only, bounded by the test's lifetime).
_SERVER = textwrap.dedent(
    r"""
    import selectors, socket, struct, sys, threading, time
    names = dict(a.split("=") for a in sys.argv[2:])
    listen = sys.argv[1]
    def dns():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((listen, 53))
        while True:
            q, addr = s.recvfrom(2048)
            qid, flags = struct.unpack("!HH", q[:4])
            off, labels = 12, []
            while q[off]:
                labels.append(q[off + 1 : off + 1 + q[off]].decode()); off += 1 + q[off]
            qtype = struct.unpack("!H", q[off + 1 : off + 3])[0]
            question = q[12 : off + 5]
            name = ".".join(labels).lower()
            ip = names.get(name)
            if ip is None:
                s.sendto(struct.pack("!6H", qid, 0x8183, 1, 0, 0, 0) + question, addr)
                continue
            ans = b""
            if qtype == 1:
                ans = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 30, 4) + socket.inet_aton(ip)
            s.sendto(struct.pack("!6H", qid, 0x8180, 1, 1 if ans else 0, 0, 0) + question + ans, addr)
    def tcp(listeners):
        # Every listener and connection on one selector: a connection gets the reply after
        # what the client sends first (a ClientHello, a request) or after 0.5 s of silence;
        # closing with unread bytes would reset it instead. One that says nothing holds up
        # no other.
        sel, waiting = selectors.DefaultSelector(), {}
        for s, reply in listeners:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, (True, reply))
        def finish(c):
            sel.unregister(c)
            try: c.send(waiting.pop(c)[1])
            except OSError: pass
            c.close()
        while True:
            now = time.monotonic()
            wait = min((d for d, _ in waiting.values()), default=now + 1) - now
            for key, _ in sel.select(max(wait, 0)):
                listening, reply = key.data
                if listening:
                    try: c, _ = key.fileobj.accept()
                    except OSError: continue
                    c.setblocking(False)
                    sel.register(c, selectors.EVENT_READ, (False, reply))
                    waiting[c] = (time.monotonic() + 0.5, reply)
                elif key.fileobj in waiting:
                    try: key.fileobj.recv(65536)
                    except OSError: pass
                    finish(key.fileobj)
            now = time.monotonic()
            for c in [c for c, (d, _) in waiting.items() if d <= now]:
                finish(c)
    listeners = []
    for ip, name in {ip: name for name, ip in reversed(names.items())}.items():
        # (one listener per address: on an address of several names, the first name answers)
        for port in (80, 443):
            s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((ip, port)); s.listen(512)
            listeners.append((s, (name + "\n").encode()))
    threading.Thread(target=tcp, args=(listeners,), daemon=True).start()
    threading.Thread(target=dns, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()  # until the test closes our stdin (or dies)
    """
)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


@dataclass
class NetLab:
    index: int
    names: dict[str, str] = field(default_factory=dict)  # name -> address in the namespace
    tag: str = ""  # tells apart two labs of one test process
    netns: str = ""
    host_if: str = ""
    proc: subprocess.Popen[str] | None = None

    @property
    def prefix(self) -> str:
        return f"10.199.{self.index}"

    @property
    def host_address(self) -> str:
        return f"{self.prefix}.1"

    @property
    def dns(self) -> str:
        return f"{self.prefix}.2"

    def start(self) -> NetLab:
        self.netns = f"dsect{os.getpid()}{self.tag}"
        self.host_if = f"dsl{os.getpid()}{self.tag}"[:14]
        peer = f"{self.host_if}p"[:15]
        try:
            _run("ip", "netns", "add", self.netns)
            _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", peer)
            _run("ip", "link", "set", peer, "netns", self.netns)
            _run("ip", "addr", "add", f"{self.host_address}/24", "dev", self.host_if)
            _run("ip", "link", "set", self.host_if, "up")
            ns = ("ip", "netns", "exec", self.netns)
            _run(*ns, "ip", "link", "set", "lo", "up")
            _run(*ns, "ip", "link", "set", peer, "up")
            for addr in {self.dns, *self.names.values()}:
                _run(*ns, "ip", "addr", "add", f"{addr}/24", "dev", peer)
            _run(*ns, "ip", "route", "add", "default", "via", self.host_address)
            self.proc = subprocess.Popen(
                [*ns, sys.executable, "-c", _SERVER, self.dns]
                + [f"{n}={a}" for n, a in self.names.items()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"netlab server did not start: {line!r}")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(Exception):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.proc.wait(timeout=5)
            self.proc = None
        if self.host_if:
            _run("ip", "link", "del", self.host_if, check=False)
        if self.netns:
            _run("ip", "netns", "del", self.netns, check=False)


def remove_bridge(bridge: str) -> None:
    """Leftovers of a test edge that died: its bridge, nftables tables, DOCKER-USER rules and
    the name gate's queue rule."""
    table = f"dsec_{bridge}".replace("-", "_")
    _run("nft", "delete", "table", "inet", table, check=False)
    _run("nft", "delete", "table", "ip", table + "_nat", check=False)
    for rule in (
        ["-i", bridge, "-j", "ACCEPT"],
        ["-o", bridge, "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"],
    ):
        while _run("iptables", "-w", "5", "-D", "DOCKER-USER", *rule, check=False).returncode == 0:
            pass
    for line in _run(
        "iptables", "-w", "5", "-t", "mangle", "-S", "FORWARD", check=False
    ).stdout.splitlines():
        if line.startswith(f"-A FORWARD -i {bridge} ") and "NFQUEUE" in line:  # the name gate's
            _run("iptables", "-w", "5", "-t", "mangle", "-D", *line.split()[1:], check=False)
    out = _run("ip", "-o", "link", "show", "master", bridge, check=False).stdout
    for line in out.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        _run("ip", "link", "del", name, check=False)
    _run("ip", "link", "del", bridge, check=False)
