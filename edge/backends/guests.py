"""What the VM-based backends (microvm, vm) share about a guest beyond its channel and
console: its vCPUs and RAM checked against the edge's bounds, its network policy checked (and
resolved) or refused on an edge without networking, the policy replaced live or a network
given to a guest that had none, its network taken back after an edge restart, and the TSC
rate its kernel is told."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edge.backends import guest_channel
from edge.backends.channels import ChannelKeeper
from edge.model import SandboxRecord, SandboxSpec
from edge.network.manager import NetworkManager
from edge.network.policy import Policy
from edge.network.policy import parse as parse_policy
from libdsec.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)


def tsc_khz() -> int:
    """The host's TSC rate for the guest's `tsc_early_khz=` (without it some TCG boots hang)."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    return 0


def vcpus_and_memory(
    spec: SandboxSpec, *, min_mb: int, max_mb: int, max_vcpus: int, what: str
) -> tuple[int, int]:
    """(vCPUs = ceil(cpu), guest RAM) of `spec`, or INVALID_ARGUMENT naming the field; `what`
    names the guest in the message ("a microVM's guest RAM")."""
    mem = spec.memory_mb
    if not min_mb <= mem <= max_mb:
        raise InvalidArgument(
            f"resources.memory_mb={mem}: {what} must be {min_mb}..{max_mb} MB on this edge",
            reason="INVALID_RESOURCES",
            metadata={"field": "resources.memory_mb"},
        )
    vcpus = max(1, math.ceil(spec.cpu_millis / 1000))
    if vcpus > max_vcpus:
        raise InvalidArgument(
            f"resources.cpu_millis={spec.cpu_millis}: {vcpus} vCPUs, at most "
            f"{max_vcpus} on this edge",
            reason="INVALID_RESOURCES",
            metadata={"field": "resources.cpu_millis"},
        )
    return vcpus, mem


def check_policy(
    network: NetworkManager | None, raw: Mapping[str, Any] | None
) -> tuple[Policy, dict[str, list[str]]]:
    """Parse a network policy and resolve its names (blocking); INVALID_ARGUMENT naming the
    rule, NETWORK_UNAVAILABLE for a networked one on an edge without networking."""
    if network is None:
        policy = parse_policy(raw)
        if policy.networked:
            raise FailedPrecondition(
                "this edge has no sandbox networking", reason="NETWORK_UNAVAILABLE"
            )
        return policy, {}
    return network.check(raw)


async def update_policy(
    network: NetworkManager | None,
    channels: ChannelKeeper,
    rec: SandboxRecord,
    policy: dict[str, Any],
    *,
    netns_dir: Path | None,
    lock: asyncio.Lock,
) -> None:
    """Replace a running guest's policy (the next connection sees it); a guest without a
    network gets one: its link, filter and the guest's own configuration (a GuestSync now,
    or at its resume if it is paused). `netns_dir`: see NetworkManager.attach_guest."""
    sid = rec.sandbox_id
    if network is None:
        check_policy(None, policy)  # NETWORK_UNAVAILABLE for a networked one
    elif network.is_attached(sid):
        await network.replace(sid, policy)  # refuses a bad policy before touching the old one
    else:
        parsed, resolved = await asyncio.to_thread(network.check, policy)
        if parsed.networked:
            async with lock:
                rec.runtime["net"] = await network.attach_guest(sid, netns_dir, parsed, resolved)
                if rec.runtime.get("paused"):
                    rec.runtime["net_pending"] = True  # the guest learns it at resume
                else:
                    await channels.channel(sid).sync_guest(guest_channel.sync(rec, True))
    rec.spec.network = dict(policy)


async def adopt_network(network: NetworkManager | None, rec: SandboxRecord) -> bool:
    """After an edge restart: the guest's network taken back from its record (True also for
    a guest that had none); False if a piece of it is gone."""
    info = rec.runtime.get("net")
    if not info:
        return True
    if network is None:
        log.warning("guest %s had a network; this edge has none", rec.sandbox_id)
        return False
    policy, _ = await asyncio.to_thread(check_policy, network, rec.spec.network)
    return await network.adopt_guest(rec.sandbox_id, info, policy)
