"""The router in front of a virtual IP: FRR (zebra + bgpd) spreading connections with ECMP.

In a data centre this is the top-of-rack switch: each API server (or compatibility front
end) peers with it over BGP and announces the service's virtual IP as a /32 while it is
healthy (common/vip.py); the switch installs one multipath route with a next hop per
announcing instance and hashes each new connection (source and destination address and
port) to one of them. :class:`VipRouter` is that switch for a cluster on lab hosts
(dsecctl/hosts.py): a host of its own running Debian's FRR, with

- ``bgp listen range <lab subnet>``: any host of the lab may peer (dynamic neighbours), so an
  instance added later takes traffic with no change here or on the others;
- ``maximum-paths``: up to 16 next hops per route (ECMP);
- ``fib_multipath_hash_policy=1``: the kernel hashes on layer 4 (per flow, not per host);
- forwarding on, ICMP redirects off (clients and instances share its one segment: a redirect
  would teach clients to skip the router, and so skip failover).

Clients reach a virtual IP through the router (:meth:`HostLab.route`); the instances answer
them directly (the return path does not cross the router).
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import pwd
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from common.vip import FRR_DIR
from dsecctl.hosts import Host, HostLab

RUN_DIR = Path("/run/dsec-vip")
ROUTER_ASN = 65000
INSTANCE_ASN = 65100


class VipRouterError(RuntimeError):
    """The router's FRR daemons could not start."""


def lab_vips(lab: HostLab, count: int = 2) -> list[str]:
    """``count`` virtual IPs for a lab, from 10.252.0.0/15 by its subnet (labs do not collide)."""
    assert lab.subnet is not None
    second, third = lab.subnet.network_address.packed[1:3]
    return [f"10.{252 + second - 190}.{third}.{i + 1}" for i in range(count)]


class VipRouter:
    """zebra and bgpd on ``host`` (module doc); :meth:`close` stops them."""

    def __init__(self, host: Host, *, frr_dir: str = FRR_DIR) -> None:
        self.host = host
        #: zebra and bgpd run as the package's user ``frr``, which must reach their files:
        #: a directory of their own under /run (a test's temporary directory is 0700).
        self.dir = RUN_DIR / host.netns
        self.frr_dir = frr_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def config(self) -> str:
        subnet = self.host.lab.subnet
        return f"""hostname dsec-router
router bgp {ROUTER_ASN}
 bgp router-id {self.host.address}
 no bgp ebgp-requires-policy
 bgp bestpath as-path multipath-relax
 neighbor INSTANCES peer-group
 neighbor INSTANCES remote-as external
 neighbor INSTANCES timers 1 3
 bgp listen range {subnet} peer-group INSTANCES
 bgp listen limit 200
 address-family ipv4 unicast
  maximum-paths 16
 exit-address-family
"""

    def start(self) -> VipRouter:
        for key, value in (
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv4.fib_multipath_hash_policy", "1"),
            ("net.ipv4.conf.all.send_redirects", "0"),
            ("net.ipv4.conf.default.send_redirects", "0"),
            ("net.ipv4.conf.eth0.send_redirects", "0"),
        ):
            r = self.host.run(["sysctl", "-qw", f"{key}={value}"])
            if r.returncode != 0:
                raise VipRouterError(f"sysctl {key}={value}: {r.stderr.strip()}")
        RUN_DIR.mkdir(mode=0o755, exist_ok=True)
        self.dir.mkdir(exist_ok=True)
        frr = pwd.getpwnam("frr")  # the package's user: zebra and bgpd drop to it
        os.chown(self.dir, frr.pw_uid, frr.pw_gid)
        (self.dir / "zebra.conf").write_text("hostname dsec-router\n")
        (self.dir / "bgpd.conf").write_text(self.config())
        try:
            for daemon in ("zebra", "bgpd"):
                self._start(daemon)
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, daemon: str) -> None:
        d = self.dir
        argv = [
            f"{self.frr_dir}/{daemon}",
            "-z",
            str(d / "zserv.api"),
            "-i",
            str(d / f"{daemon}.pid"),
            "--vty_socket",
            str(d),
            "-f",
            str(d / f"{daemon}.conf"),
            "-P",
            "0",
            "--log",
            f"file:{d / (daemon + '.log')}",
        ]
        with open(d / f"{daemon}.out", "wb") as out:
            proc = subprocess.Popen(
                self.host.command(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[daemon] = proc
        deadline = time.monotonic() + 10
        while not (d / f"{daemon}.vty").exists():
            if proc.poll() is not None:
                out_text = (d / f"{daemon}.out").read_text(errors="replace").strip()
                raise VipRouterError(f"{daemon} exited with {proc.returncode}: {out_text[-500:]}")
            if time.monotonic() > deadline:
                raise VipRouterError(f"{daemon} did not open its vty socket in 10 s")
            time.sleep(0.05)

    def vtysh(self, command: str) -> str:
        r = subprocess.run(
            ["vtysh", "--vty_socket", str(self.dir), "-c", command],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return r.stdout

    def next_hops(self, vip: str) -> list[str]:
        """The instances the kernel's route to ``vip`` spreads over now (sorted)."""
        return next_hops_in(self.host.netns, vip)

    def wait_next_hops(self, vip: str, want: set[str], timeout_s: float = 30.0) -> float:
        """Until the route to ``vip`` spreads over exactly ``want``; returns the seconds it took."""
        t0 = time.monotonic()
        while set(self.next_hops(vip)) != want:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(
                    f"route to {vip}: next hops {self.next_hops(vip)}, want {sorted(want)};"
                    f" bgp: {self.vtysh('show bgp summary')}"
                )
            time.sleep(0.02)
        return time.monotonic() - t0

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def next_hops_in(netns: str, vip: str) -> list[str]:
    """The next hops of the route to ``vip`` in namespace ``netns`` (a router's), sorted."""
    r = subprocess.run(
        ["ip", "-n", netns, "-j", "route", "show", f"{vip}/32"], capture_output=True, text=True
    )
    try:
        routes = json.loads(r.stdout or "[]")
    except ValueError:
        return []
    hops: list[str] = []
    for route in routes:
        if "gateway" in route:
            hops.append(route["gateway"])
        hops += [n["gateway"] for n in route.get("nexthops", []) if "gateway" in n]
    return sorted(hops, key=ipaddress.IPv4Address)


class LocalVip:
    """``dsec up --vip``: this machine's API servers behind a virtual IP.

    Lab hosts (``dsecctl/hosts.py``) give each instance an address and a network namespace of
    its own: ``router`` (FRR, :class:`VipRouter`) and ``api1`` .. ``apiN``. The rest of the
    cluster runs here as usual but listens on this machine's address on the lab network
    (:attr:`bind`), so the instances reach it; this machine reaches the virtual IP through
    the router. What was made is written to ``<home>/vip.json``; :func:`remove_local_vip`
    undoes it (``dsec down``), also after a crash.
    """

    def __init__(self, lab: HostLab, router: VipRouter, vip: str) -> None:
        self.lab = lab
        self.router = router
        self.vip = vip

    @classmethod
    def start(cls, home: Path, instances: int) -> LocalVip:
        remove_local_vip(home)  # what a crashed cluster may have left
        missing = frr_installed()
        if missing:
            raise VipRouterError(missing)
        tag = "u" + hashlib.sha1(str(home.resolve()).encode()).hexdigest()[:4]
        lab = HostLab(home / "hosts", tag)
        lab.start()
        router: VipRouter | None = None
        try:
            for name in ["router"] + [f"api{i + 1}" for i in range(instances)]:
                lab.add_host(name)
            lab.wait_reachable()
            router = VipRouter(lab.hosts["router"]).start()
            vip = lab_vips(lab)[0]
            lab.route(f"{vip}/32", lab.hosts["router"])
        except BaseException:
            if router is not None:
                router.close()
            lab.close()
            raise
        local = cls(lab, router, vip)
        (home / "vip.json").write_text(json.dumps(local.state(), indent=2))
        return local

    @property
    def bind(self) -> str:
        """This machine's address on the lab network: where the other services listen."""
        return self.lab.gateway

    def hosts(self) -> dict[str, Host]:
        """Service name -> host: ``apiserver`` on api1, ``apiserver1`` on api2, ..."""
        apis = sorted(
            (h for h in self.lab.hosts.values() if h.name.startswith("api")),
            key=lambda h: int(h.name[3:]),
        )
        return {("apiserver" if i == 0 else f"apiserver{i}"): h for i, h in enumerate(apis)}

    def state(self) -> dict[str, object]:
        return {
            "vip": self.vip,
            "router": self.lab.hosts["router"].netns,
            "namespaces": [self.lab.fabric, *(h.netns for h in self.lab.hosts.values())],
            "uplink": self.lab.uplink,
        }


def local_vip_state(home: Path) -> dict[str, Any] | None:
    path = home / "vip.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def remove_local_vip(home: Path) -> bool:
    """Stops the router and removes the hosts ``<home>/vip.json`` names; False: none."""
    state = local_vip_state(home)
    if state is None:
        return False
    for daemon in ("bgpd", "zebra"):
        pid_file = RUN_DIR / state["router"] / f"{daemon}.pid"
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
    namespaces = list(state["namespaces"])
    # Everything in the lab's namespaces is the cluster's (the lab made them).
    for ns in namespaces:
        r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in r.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    for ns in namespaces:
        while time.monotonic() < deadline:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            if not r.stdout.strip():
                break
            time.sleep(0.05)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", state["uplink"]], capture_output=True)
    shutil.rmtree(RUN_DIR / state["router"], ignore_errors=True)
    (home / "vip.json").unlink(missing_ok=True)
    return True


def frr_installed(frr_dir: str = FRR_DIR) -> str:
    """ "" when FRR's daemons and vtysh are here, else what is missing."""
    missing = [d for d in ("zebra", "bgpd") if not os.access(f"{frr_dir}/{d}", os.X_OK)]
    if shutil.which("vtysh") is None:
        missing.append("vtysh")
    return f"FRR missing ({', '.join(missing)}): apt install frr" if missing else ""
