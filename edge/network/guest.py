"""The link of a VM guest: an edge-owned network namespace holding the tap QEMU uses, bridged
onto the node bridge through a veth pair whose host end carries the guest's filter.

    <netns dir>/<sandbox id>: a network namespace (bind-mounted nsfs file)      host (edge)
    QEMU ══fd══ tap0 ─┐
                      br0 ── veth0  ══════ veth ══════  dv<hash> ── node bridge ── NAT ── uplink
                                                        ▲ tc ingress: the guest's filter

Why bridged rather than routed: with the tap and the veth's inner end on a bridge of their own,
the guest is a host on the node bridge with the sandbox's allocated address, exactly where a
container's eth0 is -- the same isolated bridge port, the same nftables forward and input
chains, NAT and resolver address, and the same cleanup of ports by name (`veth_name`). A routed
guest would need a route and proxy ARP per guest and a second set of firewall rules, for
nothing gained: the filter is per guest either way.

Why the filter is on the host end's ingress: every frame the guest sends crosses it before it
reaches the node bridge, and it lives in the edge's own namespace, which neither the guest nor
QEMU (were the guest to escape into it) can reach. It checks the policy for the guest->outside
direction only, as the cgroup hooks do for containers; the other direction is the node's: the
forward chain lets in only replies to connections the guest opened, the input chain only DNS to
the resolver, isolated ports no neighbour (`edge.network.links`).

The namespace holds nothing but tap0, br0 and veth0: no address and IPv6 off, so it sends
nothing of its own. It is made in a short-lived thread (unshare and setns are per thread),
configured there, and bind-mounted onto its file last: it exists whole or not at all, and it
outlives an edge restart (the edge finds it again by its path). Removing the file's mount frees
the namespace once QEMU, the last holder (its tap descriptor), is gone; the edge deletes the
veth pair itself, so the guest's link goes at once.

The tap is persistent and made with IFF_TAP | IFF_NO_PI | IFF_VNET_HDR: frames carry a virtio
net header, so checksum and segmentation offloads stay off the emulated CPU. `open_tap` attaches
a descriptor with those flags; give it to QEMU as `-netdev tap,id=net0,fd=N` and nothing more:
QEMU 7.2 refuses `vnet_hdr=` next to `fd=` (tried: "vnet_hdr= ... invalid with fd="), it probes
the descriptor instead, finds IFF_VNET_HDR and uses the header. The tap is single-queue: one
descriptor at a time (another TUNSETIFF while one is attached fails with EBUSY).

Each sandbox gets a unique locally administered MAC derived from its id (`guest_mac`, the one
the microvm backend already derives): template clones all restore with one virtio-net MAC, and
the filter drops frames from any other source MAC, so a guest has no network until it has been
told its own.

Everything here is blocking; callers on the event loop use `asyncio.to_thread`.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from edge.network.links import NetworkSetupError, NodeNetwork, netns_at

T = TypeVar("T")

TAP = "tap0"
_BRIDGE = "br0"
_UPLINK = "veth0"  # the inner end of the veth pair

_CLONE_NEWNET = 0x40000000
_MS_BIND = 0x1000
_MNT_DETACH = 2
_NSFS_MAGIC = 0x6E736673
_TUNSETIFF = 0x400454CA
_TUNSETPERSIST = 0x400454CB
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TAP_FLAGS = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR

_libc = ctypes.CDLL(None, use_errno=True)


def netns_path(netns_dir: Path, sandbox_id: str) -> Path:
    return netns_dir / sandbox_id


def guest_mac(sandbox_id: str) -> str:
    """A unicast, locally administered MAC (02:...) that is the sandbox's alone."""
    tail = hashlib.sha256(sandbox_id.encode()).digest()[:5]
    return ":".join(f"{b:02x}" for b in (0x02, *tail))


def is_netns(path: Path) -> bool:
    """Whether `path` is a mounted network namespace file (an nsfs mount)."""
    buf = (ctypes.c_long * 16)()
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return False
    return (buf[0] & 0xFFFFFFFF) == _NSFS_MAGIC


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise NetworkSetupError(f"{what}: {os.strerror(err)}")


def _in_thread(fn: Callable[[], T]) -> T:
    """Run `fn` in a short-lived thread that may change its network namespace and ends with
    it (the edge's other threads stay where they are)."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised in the caller's thread
            failure.append(exc)

    t = threading.Thread(target=run, name="guest-netns")
    t.start()
    t.join()
    if failure:
        raise failure[0]
    return result[0]


def _enter(netns: Path) -> None:
    fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(fd, _CLONE_NEWNET), f"setns into {netns}")
    finally:
        os.close(fd)


def _attach_tap(name: str) -> int:
    """A /dev/net/tun descriptor attached to tap `name` of this thread's namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), TAP_FLAGS))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _build_netns(path: Path) -> None:
    """In a fresh thread: a new namespace with the tap and the inner bridge, then its mount."""
    from pyroute2 import IPRoute

    _check(_libc.unshare(_CLONE_NEWNET), "unshare(CLONE_NEWNET)")
    for conf in ("all", "default"):  # before any device: they inherit "default"
        Path(f"/proc/sys/net/ipv6/conf/{conf}/disable_ipv6").write_text("1")
    fd = _attach_tap(TAP)
    try:
        fcntl.ioctl(fd, _TUNSETPERSIST, 1)
    finally:
        os.close(fd)
    with IPRoute() as ip:
        ip.link("add", ifname=_BRIDGE, kind="bridge")
        bridge = ip.link_lookup(ifname=_BRIDGE)[0]
        ip.link("set", index=ip.link_lookup(ifname=TAP)[0], master=bridge, state="up")
        ip.link("set", index=bridge, state="up")
    _check(
        _libc.mount(b"/proc/thread-self/ns/net", os.fsencode(path), None, _MS_BIND, None),
        f"bind-mount the guest's network namespace on {path}",
    )


def create_netns(netns_dir: Path, sandbox_id: str) -> Path:
    """The guest's namespace with its tap (made if missing); returns its path."""
    path = netns_path(netns_dir, sandbox_id)
    if is_netns(path):
        return path
    netns_dir.mkdir(parents=True, exist_ok=True)
    path.touch()
    try:
        _in_thread(lambda: _build_netns(path))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def remove_netns(path: Path) -> bool:
    """Unmount and remove a namespace file; False if there was none."""
    mounted = is_netns(path)
    if mounted:
        _check(_libc.umount2(os.fsencode(path), _MNT_DETACH), f"unmount {path}")
    try:
        path.unlink()
    except FileNotFoundError:
        return mounted
    return True


def move_netns(netns_dir: Path, old: str, new: str) -> Path:
    """The namespace of `old` under the name of `new` (a claimed warm guest: a bind mount
    cannot be renamed, so it is mounted again at the new name and the old one removed)."""
    src, dst = netns_path(netns_dir, old), netns_path(netns_dir, new)
    dst.touch()
    try:
        _check(
            _libc.mount(os.fsencode(src), os.fsencode(dst), None, _MS_BIND, None),
            f"bind-mount {src} on {dst}",
        )
    except BaseException:
        dst.unlink(missing_ok=True)
        raise
    remove_netns(src)
    return dst


def remove_orphans(netns_dir: Path, keep: set[str]) -> list[str]:
    """Remove the namespaces under `netns_dir` of sandboxes not in `keep`; returns their ids."""
    if not netns_dir.is_dir():
        return []
    gone = [p for p in netns_dir.iterdir() if p.name not in keep]
    for path in gone:
        remove_netns(path)
    return [p.name for p in gone]


def open_tap(netns: Path, name: str = TAP) -> int:
    """A descriptor of the guest's tap for QEMU (`-netdev tap,id=net0,fd=N`: it finds the
    virtio net header itself): close-on-exec (pass it with `pass_fds` or SCM_RIGHTS); the
    caller owns it."""

    def inside() -> int:
        _enter(netns)
        return _attach_tap(name)

    return _in_thread(inside)


def create_root_tap(name: str) -> None:
    """A persistent tap `name` in the edge's own namespace (made if missing), IPv6 off: a full
    VM's link. libvirt opens a tap by name in its own (the root) namespace, so a libvirt
    guest cannot use a namespace of its own as a microVM's does; the tap itself becomes the
    guest's port on the node bridge (`NodeNetwork.add_tap_port`), its filter on the tap's
    ingress -- where every frame the guest sends arrives, as at a veth's host end."""
    if Path(f"/sys/class/net/{name}").exists():
        return
    fd = _attach_tap(name)
    try:
        fcntl.ioctl(fd, _TUNSETPERSIST, 1)
    finally:
        os.close(fd)
    Path(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6").write_text("1")


def remove_root_tap(name: str) -> None:
    """Remove a persistent tap of the edge's namespace (gone already is fine)."""
    from pyroute2 import IPRoute

    with IPRoute() as ip:
        for idx in ip.link_lookup(ifname=name):
            ip.link("del", index=idx)


def connect(node: NodeNetwork, sandbox_id: str, netns: Path, program: int) -> str:
    """Put the guest's namespace on the node bridge: a veth pair whose inner end joins br0, with
    the guest's tc `program` on the host end before it carries anything. Returns that end's name."""
    fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        host = node.add_port(sandbox_id, fd, _UPLINK, program)
    finally:
        os.close(fd)
    with netns_at(netns) as ns:
        bridge = ns.link_lookup(ifname=_BRIDGE)[0]
        ns.link("set", index=ns.link_lookup(ifname=_UPLINK)[0], master=bridge, state="up")
    return host
