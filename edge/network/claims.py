"""Which bridge, subnet and name-gate queue an edge's sandbox network uses: chosen so that the
edges of one node -- a local cluster's, a test cluster's, a second edge of either -- never share
a bridge, an address (the resolver listens on the bridge's, port 53) or an NFQUEUE number.

Each edge holds a *claim*: a file ``<bridge>.json`` in a node-wide directory
(``DSEC_EDGE_NET_CLAIM_DIR``, default ``/run/dsec/net``: it empties at boot, as the bridges do)
naming the bridge, its subnet, the gate queue, and the edge's state directory (its identity: an
edge restarted with the same state directory takes its claim back, whose sandboxes sit on that
bridge with addresses in that subnet). The edge holds an flock on its claim file while it
runs. A claim is *live* while that lock is held or while its bridge has ports (sandboxes that
outlive their edge: a restart, ``dsec down --keep-sandboxes``); otherwise it is stale, and the
next edge that chooses removes it.

Unless configured (``DSEC_EDGE_NET_BRIDGE``, ``DSEC_EDGE_NET_SUBNET``), an edge takes its own
claim back, else the first free of ``dsec0`` with 10.231.0.0/16, ``dsec1`` with 10.230.0.0/16,
... down to 10.200.0.0/16. Free means: no live claim of another edge has the bridge, overlaps
the subnet or uses the queue; no interface of the host other than the bridge has an address in
the subnet; no other interface has the bridge's name; a bridge of that name that no edge claims
has no ports (else it is an older edge's, still in use). Configured values are checked the same
way. Edges starting together choose one at a time (an flock on the directory). When none is
free the edge refuses to start, saying why each candidate is taken.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import json
import logging
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Bridge names and subnets an edge picks from when none is configured, first free first:
#: dsec0 10.231.0.0/16 (what every edge used before claims), then downwards (tests and benches
#: configure theirs above it: 10.233.x, 10.234.x).
AUTO_SUBNETS = [ipaddress.IPv4Network(f"10.{b}.0.0/16") for b in range(231, 199, -1)]
#: NFQUEUE numbers the gate queue is derived into (as edge.network.links.NodeNetwork did).
QUEUE_BASE, QUEUE_SPAN = 1024, 31744


class NetworkClaimError(RuntimeError):
    """No bridge, subnet or queue the edge may use: it cannot network sandboxes."""


def auto_bridge(i: int) -> str:
    return f"dsec{i}"


def derived_queue(bridge: str) -> int:
    return QUEUE_BASE + zlib.crc32(bridge.encode()) % QUEUE_SPAN


@dataclass
class NetworkClaim:
    """This edge's bridge, subnet and gate queue; held (locked) until :meth:`release`."""

    bridge: str
    subnet: ipaddress.IPv4Network
    gate_queue: int
    path: Path
    _fd: int | None = None

    def release(self, *, forget: bool) -> None:
        """Stop holding the claim. ``forget``: remove it (the bridge is gone or has no ports):
        another edge may take it at once. Otherwise it stays this edge's while its bridge has
        ports (sandboxes kept for the next start)."""
        if self._fd is None:
            return
        try:
            if forget:
                with _locked_dir(self.path.parent):
                    self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True)
class _Other:
    """A live claim of another edge."""

    bridge: str
    subnet: ipaddress.IPv4Network
    gate_queue: int
    state_dir: str
    pid: int

    def who(self) -> str:
        return f"the edge with state dir {self.state_dir} (pid {self.pid})"


@dataclass(frozen=True)
class _Host:
    #: interface name -> (kind, has ports)
    links: dict[str, tuple[str, bool]]
    #: (interface name, its network) of every IPv4 address
    addresses: list[tuple[str, ipaddress.IPv4Interface]]
    #: NFQUEUE numbers bound now
    queues: set[int]


@contextlib.contextmanager
def _locked_dir(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _try_lock(path: Path) -> int | None:
    """``path`` opened and flocked by us, or None when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return None
        raise
    return fd


def _host() -> _Host:
    from pyroute2 import IPRoute  # a sizeable import: only on nodes that network sandboxes

    with contextlib.closing(IPRoute()) as ip:
        raw = ip.get_links()
        names = {link["index"]: str(link.get_attr("IFLA_IFNAME")) for link in raw}
        masters = {link.get_attr("IFLA_MASTER") for link in raw} - {None}
        links = {}
        for link in raw:
            info = link.get_attr("IFLA_LINKINFO")
            kind = str(info.get_attr("IFLA_INFO_KIND") or "") if info is not None else ""
            links[names[link["index"]]] = (kind, link["index"] in masters)
        addresses = [
            (
                names.get(a["index"], str(a["index"])),
                ipaddress.IPv4Interface(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}"),
            )
            for a in ip.get_addr(family=2)
        ]
    queues = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/netfilter/nfnetlink_queue").read_text().splitlines():
            if line.split():
                queues.add(int(line.split()[0]))
    return _Host(links, addresses, queues)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
        ipaddress.IPv4Network(data["subnet"])
        return data if isinstance(data.get("bridge"), str) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _survey(directory: Path, state_dir: str, host: _Host) -> tuple[list[_Other], dict[str, Any]]:
    """Live claims of other edges, and this edge's own earlier claim ({} if none); stale
    claims are removed. Under the directory lock."""
    others: list[_Other] = []
    mine: dict[str, Any] = {}
    for path in sorted(directory.glob("*.json")):
        data = _read(path)
        fd = _try_lock(path)
        if fd is None:  # its edge runs
            if data is None:
                continue  # being written? (never: writers hold the directory lock)
            if data.get("state_dir") == state_dir:
                raise NetworkClaimError(
                    f"another edge runs with this state dir ({state_dir}, pid "
                    f"{data.get('pid')}): two edges must not share one"
                )
            others.append(_other(data))
            continue
        try:
            if data is None:
                path.unlink(missing_ok=True)
            elif data.get("state_dir") == state_dir:
                mine = data
            elif host.links.get(data["bridge"], ("", False))[1]:
                others.append(_other(data))  # its edge is down, its sandboxes are not
            else:
                log.info("removing the stale network claim %s (%s)", path, data)
                path.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return others, mine


def _other(data: dict[str, Any]) -> _Other:
    return _Other(
        data["bridge"],
        ipaddress.IPv4Network(data["subnet"]),
        int(data.get("gate_queue", 0)),
        str(data.get("state_dir", "?")),
        int(data.get("pid", 0)),
    )


def _taken(
    bridge: str,
    subnet: ipaddress.IPv4Network,
    others: list[_Other],
    host: _Host,
    mine: dict[str, Any],
) -> str:
    """Why (bridge, subnet) is not free, or ""."""
    for o in others:
        if o.bridge == bridge:
            return f"bridge {bridge} is claimed by {o.who()}"
        if o.subnet.overlaps(subnet):
            return f"{subnet} overlaps {o.subnet} of {o.who()}"
    kind, has_ports = host.links.get(bridge, ("", False))
    if bridge in host.links:
        if kind != "bridge":
            return f"an interface named {bridge} exists (kind {kind or 'unknown'})"
        if has_ports and mine.get("bridge") != bridge:
            return f"bridge {bridge} exists with ports and no edge claims it (an older edge's?)"
    for name, addr in host.addresses:
        if name != bridge and addr.network.overlaps(subnet):
            return f"{subnet} overlaps {addr} on {name}"
    return ""


def _queue(
    bridge: str, wanted: int, others: list[_Other], host: _Host, mine: dict[str, Any]
) -> int:
    used = {o.gate_queue for o in others} | host.queues
    if wanted:
        if wanted in {o.gate_queue for o in others}:
            holder = next(o for o in others if o.gate_queue == wanted)
            raise NetworkClaimError(f"DSEC_EDGE_NET_GATE_QUEUE={wanted} is used by {holder.who()}")
        return wanted
    earlier = int(mine.get("gate_queue", 0)) if mine.get("bridge") == bridge else 0
    if earlier and earlier not in used:  # this edge's own, from its previous start
        return earlier
    q = derived_queue(bridge)
    for _ in range(QUEUE_SPAN):
        if q not in used:
            return q
        q = QUEUE_BASE + (q - QUEUE_BASE + 1) % QUEUE_SPAN
    raise NetworkClaimError("no free NFQUEUE number for the name gate")


def claim(
    state_dir: Path,
    *,
    bridge: str = "",
    subnet: str = "",
    gate_queue: int = 0,
    directory: Path = Path("/run/dsec/net"),
) -> NetworkClaim:
    """This edge's claim (see the module doc); ``bridge``, ``subnet``, ``gate_queue``: as
    configured ("" / 0: chosen). Raises NetworkClaimError naming why each candidate is taken."""
    try:
        return _claim(state_dir, bridge, subnet, gate_queue, directory)
    except OSError as exc:
        raise NetworkClaimError(f"claiming a bridge in {directory}: {exc}") from None


def _claim(
    state_dir: Path, bridge: str, subnet: str, gate_queue: int, directory: Path
) -> NetworkClaim:
    me = str(state_dir.resolve())
    fixed_net = ipaddress.IPv4Network(subnet) if subnet else None
    with _locked_dir(directory):
        # In a thread of its own: pyroute2's IPRoute runs an asyncio loop, and the edge calls
        # this from within its own (running) one.
        with ThreadPoolExecutor(1, thread_name_prefix="claim") as pool:
            host = pool.submit(_host).result()
        others, mine = _survey(directory, me, host)
        candidates: list[tuple[str, ipaddress.IPv4Network]] = []
        if mine and bridge in ("", mine["bridge"]) and subnet in ("", mine["subnet"]):
            candidates.append((mine["bridge"], ipaddress.IPv4Network(mine["subnet"])))
        if bridge and fixed_net is not None:
            candidates.append((bridge, fixed_net))
        else:
            candidates += [
                (bridge or auto_bridge(i), fixed_net or net) for i, net in enumerate(AUTO_SUBNETS)
            ]
        why: list[str] = []
        for b, net in dict.fromkeys(candidates):
            reason = _taken(b, net, others, host, mine)
            if reason:
                why.append(f"{b} {net}: {reason}")
                continue
            queue = _queue(b, gate_queue, others, host, mine)
            if mine and mine["bridge"] != b:
                (directory / f"{mine['bridge']}.json").unlink(missing_ok=True)
            path = directory / f"{b}.json"
            fd = _try_lock(path)
            if fd is None:  # cannot be: the survey found no live claim of it
                why.append(f"{b} {net}: {path} is locked")
                continue
            data = {
                "bridge": b,
                "subnet": str(net),
                "gate_queue": queue,
                "state_dir": me,
                "pid": os.getpid(),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(data).encode(), 0)
            log.info(
                "sandbox network: bridge %s, subnet %s, gate queue %d (%s)", b, net, queue, path
            )
            return NetworkClaim(b, net, queue, path, fd)
    raise NetworkClaimError(
        "no bridge and subnet free for the sandbox network ("
        + "; ".join(why)
        + "): set DSEC_EDGE_NET_BRIDGE and DSEC_EDGE_NET_SUBNET to free ones, or turn sandbox "
        "networking off (DSEC_EDGE_DISABLED_CONTROLS=network)"
    )
