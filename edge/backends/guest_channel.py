"""What the edge tells a guest over its agent channel (aether's Claim and GuestSync): the
sandbox's environment and identity when a restored guest becomes a sandbox, and the clock,
fresh entropy and (when it changed) the network after every restore, and a fork's child its own
identity. Plain functions of the sandbox's record: the backend sends them. And `flush`: the
guest's page cache written to its disks before the host reads them."""

from __future__ import annotations

import secrets
import time

from dsec.aether.v1 import aether_pb2
from dsec.types.v1 import types_pb2
from edge.aether_client import AetherConnection
from edge.images import ResolvedImage
from edge.model import SandboxRecord
from edge.toolkit import toolkit_python
from libdsec.errors import Unavailable

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def sandbox_env(rec: SandboxRecord, image: ResolvedImage) -> dict[str, str]:
    env = {
        "PATH": DEFAULT_PATH,
        "HOME": "/root",
        "LANG": "C.UTF-8",
        **image.env,
        **rec.spec.env,
    }
    env["DSEC_CHRONUS_WORKDIR"] = rec.spec.workdir or image.workdir or "/"
    # The VM is the boundary: chronus needs no Landlock domain inside it.
    env["DSEC_CHRONUS_LANDLOCK"] = "off"
    return env


def identity(rec: SandboxRecord) -> aether_pb2.GuestIdentity:
    host = rec.sandbox_id[:63]
    files = {
        "/etc/hostname": host + "\n",
        "/etc/hosts": f"127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\t{host}\n",
    }
    network = guest_network(rec)
    if network is not None:
        files["/etc/resolv.conf"] = f"nameserver {rec.runtime['net']['dns']}\n"
    return aether_pb2.GuestIdentity(
        hostname=host, files=files, pids_max=rec.spec.pids_max, sync=fresh_sync(), network=network
    )


def guest_network(rec: SandboxRecord) -> aether_pb2.GuestNetwork | None:
    net = rec.runtime.get("net")
    if not net:
        return None
    return aether_pb2.GuestNetwork(
        mac=net["mac"],
        address=net["address"],
        prefix_len=int(net["prefix_len"]),
        gateway=net["gateway"],
    )


def sync(rec: SandboxRecord, network_changed: bool) -> aether_pb2.GuestSync:
    """Clock, entropy, and the network config when the guest does not have it yet."""
    out = fresh_sync()
    network = guest_network(rec) if network_changed else None
    if network is not None:
        out.network.CopyFrom(network)
        out.resolv_conf = f"nameserver {rec.runtime['net']['dns']}\n"
    return out


def fork_sync(rec: SandboxRecord) -> aether_pb2.GuestSync:
    """What a fork's child is told once it runs: it is a copy of another sandbox's guest, so
    besides the clock and fresh entropy it gets its own identity (hostname, /etc files) and,
    networked, its own address (replacing the source's: aether/guest.py)."""
    ident = identity(rec)
    out = fresh_sync()
    out.hostname = ident.hostname
    out.files.update(ident.files)
    if ident.HasField("network"):
        out.network.CopyFrom(ident.network)
    return out


def fresh_sync() -> aether_pb2.GuestSync:
    return aether_pb2.GuestSync(clock_unix_ns=time.time_ns(), entropy=secrets.token_bytes(64))


#: How long a guest may take to write its page cache out (`flush`).
FLUSH_TIMEOUT_S = 60.0


async def flush(conn: AetherConnection, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """sync(2) in the guest: what it wrote and still holds in its page cache reaches its disks,
    so that the host can read them (a pack_diff's copy, a pause's disk). The image's `sync`
    when it has one (a small program starts in milliseconds where the toolkit's Python took
    0.7 s in a half-core TCG guest), else the toolkit's Python, which every guest has at
    /.dsec. Raises Unavailable (GUEST_FLUSH) when neither succeeds, DeadlineExceeded when the
    guest does not answer in `timeout_s`."""
    result = None
    for argv in (["sync"], [*toolkit_python(), "-c", "import os; os.sync()"]):
        request = types_pb2.ExecRequest(sandbox_id=conn.sandbox_id, argv=argv, timeout_s=timeout_s)
        result = await conn.unary("exec", request, timeout_s=timeout_s + 5.0)
        if result.exit.exit_code == 0:
            return
        if result.exit.exit_code not in (126, 127):  # not "no such program": a failure
            break
    assert result is not None
    raise Unavailable(
        f"sync in the guest of {conn.sandbox_id} failed (exit {result.exit.exit_code}): "
        + result.stderr.decode(errors="replace")[-500:],
        reason="GUEST_FLUSH",
    )
