"""aether inside a VM guest: the parts of a sandbox's identity a container gets from its runtime.

A microVM is restored from its image's template snapshot, so until the claim every clone is the
template's twin: same hostname, same clock (the snapshot's), same entropy pool, no network.
The claim's `GuestIdentity` (dsec.aether.v1) makes it this sandbox, before chronus starts:
hostname and /etc files, the network interface (MAC first: every clone starts with the
template's), a pids limit (a cgroup of the guest's own), the clock and fresh entropy. After
each later restore (resume from pause) a `GuestSync` corrects the clock and entropy again; a
fork's child (a copy of a claimed guest) gets its own hostname, /etc files and address the same
way.

Only kernel interfaces, no tools (the image may have none): ioctls on a socket for links,
addresses and the route, the cgroup2 files, clock_settime, RNDADDENTROPY.
"""

from __future__ import annotations

import _socket
import fcntl
import os
import struct
import time

from insandbox.log import get_logger

log = get_logger("aether.guest")

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

SIOCSIFFLAGS, SIOCGIFFLAGS = 0x8914, 0x8913
SIOCSIFADDR, SIOCSIFNETMASK, SIOCSIFHWADDR = 0x8916, 0x891C, 0x8924
SIOCADDRT = 0x890B
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207  # what a VM-fork notification (vmgenid) makes the kernel do
IFF_UP = 0x1
RTF_UP, RTF_GATEWAY = 0x1, 0x2
ARPHRD_ETHER = 1
CGROUP = "/sys/fs/cgroup"
SANDBOX_CGROUP = CGROUP + "/sandbox"


def _ifreq(name: str, payload: bytes) -> bytes:
    return struct.pack("16s", name.encode()) + payload.ljust(24, b"\0")


def _sockaddr_in(address: str) -> bytes:
    return struct.pack("=H2s4s8x", _socket.AF_INET, b"\0\0", _socket.inet_aton(address))


def set_link_up(name: str) -> None:
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, _ifreq(name, b""))[:18])[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, _ifreq(name, struct.pack("H", flags | IFF_UP)))
    finally:
        s.close()


def configure_network(net: dict[str, Any]) -> None:
    """MAC, address, netmask, link up and the default route of the guest's first NIC."""
    name = _first_nic()
    if name is None:
        raise OSError("the guest has no network interface")
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        mac = bytes(int(b, 16) for b in net["mac"].split(":"))
        fcntl.ioctl(s, SIOCSIFHWADDR, _ifreq(name, struct.pack("=H6s", ARPHRD_ETHER, mac)))
        fcntl.ioctl(s, SIOCSIFADDR, _ifreq(name, _sockaddr_in(net["address"])))
        bits = int(net.get("prefix_len") or 32)
        mask = _socket.inet_ntoa(struct.pack("!I", (0xFFFFFFFF << (32 - bits)) & 0xFFFFFFFF))
        fcntl.ioctl(s, SIOCSIFNETMASK, _ifreq(name, _sockaddr_in(mask)))
    finally:
        s.close()
    set_link_up(name)
    if net.get("gateway"):
        _default_route(net["gateway"])


def _default_route(gateway: str) -> None:
    # struct rtentry: rt_pad1, rt_dst, rt_gateway, rt_genmask, rt_flags, pads, rt_dev ...
    any_addr = _sockaddr_in("0.0.0.0")
    rt = struct.pack("L", 0) + any_addr + _sockaddr_in(gateway) + any_addr
    rt += struct.pack("H", RTF_UP | RTF_GATEWAY) + b"\0" * (120 - len(rt) - 2)
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        fcntl.ioctl(s, SIOCADDRT, rt)
    except FileExistsError:
        pass  # configured again (a restored guest told its network twice)
    finally:
        s.close()


def _first_nic() -> str | None:
    names = sorted(n for n in os.listdir("/sys/class/net") if n != "lo")
    return names[0] if names else None


def limit_pids(pids_max: int) -> None:
    """aether (and so chronus and every command) into a guest cgroup with pids.max."""
    with open(CGROUP + "/cgroup.subtree_control", "w") as f:
        f.write("+pids")
    os.makedirs(SANDBOX_CGROUP, exist_ok=True)
    with open(SANDBOX_CGROUP + "/pids.max", "w") as f:
        f.write(str(pids_max))
    with open(SANDBOX_CGROUP + "/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))


def pids_limit_hits() -> int:
    try:
        with open(SANDBOX_CGROUP + "/pids.events") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value)
    except OSError:
        pass
    return 0


#: As for containers (edge/runtime/disk.py): a writable layer with less free is full.
FULL_SLACK_BYTES = 1 << 20


def disk_full() -> str:
    """Why the writable disk (the overlay's upper, what statvfs of / reports) is full, or ""."""
    try:
        st = os.statvfs("/")
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    if free < FULL_SLACK_BYTES:
        return f"free_bytes={free}"
    if st.f_files and st.f_favail == 0:
        return "free_inodes=0"
    return ""


def sync(values: dict[str, Any]) -> None:
    """The host's clock and fresh entropy (after a restore); a network it was given; a fork's
    child its own hostname and /etc files (and its own address: configure_network replaces
    the source's, with the routes through it)."""
    if values.get("hostname"):
        _socket.sethostname(values["hostname"])
    for path, content in (values.get("files") or {}).items():
        _write(path, content)
    if values.get("network"):
        configure_network(values["network"])
        if values.get("resolv_conf"):
            _write("/etc/resolv.conf", values["resolv_conf"])
    ns = int(values.get("clock_unix_ns") or 0)
    if ns:
        time.clock_settime_ns(time.CLOCK_REALTIME, ns)
    entropy = values.get("entropy") or b""
    if entropy:
        fd = os.open("/dev/urandom", os.O_WRONLY)
        try:
            fcntl.ioctl(
                fd, RNDADDENTROPY, struct.pack("ii", len(entropy) * 8, len(entropy)) + entropy
            )
            fcntl.ioctl(fd, RNDRESEEDCRNG)  # else the CRNG keeps its twin's key for up to 60 s
        finally:
            os.close(fd)


def apply_identity(identity: dict[str, Any]) -> str:
    """Everything of a GuestIdentity. Returns what failed ("" when nothing did): the edge
    then fails the create (aether/server.py answers the claim with it)."""
    steps: list[tuple[str, Any]] = [("sync", lambda: sync(identity.get("sync") or {}))]
    if identity.get("hostname"):
        steps.append(("hostname", lambda: _socket.sethostname(identity["hostname"])))
    for path, content in (identity.get("files") or {}).items():
        steps.append((path, lambda p=path, c=content: _write(p, c)))
    if identity.get("network"):
        steps.append(("network", lambda: configure_network(identity["network"])))
    if identity.get("pids_max"):
        steps.append(("pids", lambda: limit_pids(int(identity["pids_max"]))))
    errors = []
    for what, step in steps:
        try:
            step()
        except (OSError, ValueError, KeyError) as exc:
            log.error("guest identity: %s failed: %s", what, exc)
            errors.append(f"{what}: {exc}")
    return "; ".join(errors)


def _write(path: str, content: str) -> None:
    os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
    with open(path, "w") as f:
        f.write(content)


def power_off() -> None:
    """Flush the guest's disks and power it off: QEMU exits (sysrq "o", no tools needed)."""
    os.sync()
    try:
        with open("/proc/sysrq-trigger", "w") as f:
            f.write("o")
    except OSError as exc:
        log.error("cannot power off: %s", exc)
    time.sleep(10)  # the power-off is asynchronous; pid 1 must not return meanwhile


def boot() -> None:
    """At aether's start in a guest: loopback up (HTTP to in-sandbox ports goes through it)."""
    try:
        set_link_up("lo")
    except OSError as exc:
        log.error("cannot bring lo up: %s", exc)
