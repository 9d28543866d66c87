"""The node's services: what every sandbox backend of an edge shares, built once.

One edge runs several backends side by side (runc containers, QEMU microVMs, ...). What they
share belongs to the node, not to any one of them, so it is built here, once, from the edge's
configuration, and handed to every backend's factory (edge/backends/registry.py):

- the layer store (``edge.layers.Environments``) and the image resolver over it: both the
  container backend (an overlay of EROFS mounts) and the microVM backend (EROFS files as
  read-only disks) compose sandboxes from the same layers;
- the sandbox network (``edge.network.NetworkManager``: one bridge, one resolver, one name
  gate per edge; None when the operator turned networking off);
- the toolkit (aether, chronus and their Python): its EROFS image, and that image mounted once
  per node (containers bind-mount the mount, microVMs attach the image as a disk);
- the pause-reclaim area (``edge.backends.pausing.PauseReclaim``: the swap area a paused
  sandbox's memory is pushed into) and the disk guard (the free-space reserve).

The node's mounts, swap area and network stay while a sandbox may still use them: a backend
whose sandboxes outlive the edge (kept running for the next one) says so with ``hold_while``,
and `close` releases them only when none does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from edge.backends.contract import BackgroundLoop
from edge.backends.pausing import PauseReclaim
from edge.config import EdgeConfig
from edge.controls import Control
from edge.disk_guard import DiskGuard
from edge.images import ImageResolver
from edge.layers import Environments, LayerSettings
from edge.network import claims
from edge.network.manager import NetworkManager
from edge.runtime import mounts
from edge.toolkit import build_toolkit, toolkit_image

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Toolkit:
    """aether, chronus and a relocatable Python: one EROFS image per node, mounted once (one
    copy of the interpreter's pages in memory, whichever sandbox runs it)."""

    #: The EROFS image (a microVM attaches it as a disk).
    image: Path
    #: Where it is mounted read-only (a container bind-mounts it at /.dsec).
    mount: Path


@dataclass(frozen=True)
class NodeServices:
    environments: Environments
    images: ImageResolver
    network: NetworkManager | None
    toolkit: Toolkit
    pause_reclaim: PauseReclaim
    disk_guard: DiskGuard
    layer_gc_interval_s: float = 300.0
    #: Whether sandboxes still hold the node's mounts, swap area and network (hold_while).
    _holders: list[Callable[[], bool]] = field(default_factory=list, repr=False)

    @classmethod
    def build(cls, cfg: EdgeConfig) -> NodeServices:
        """Raises NetworkClaimError when no bridge, subnet or gate queue of the node is free."""
        container_state = cfg.state_dir / "container"
        # In the order the edge always made them: the network claim (which may refuse) first.
        network = None if "network" in cfg.disabled_controls else _network(cfg)
        reclaim = PauseReclaim.make(
            cfg.state_dir / "swap" / "pause.swap", cfg.pause_swap_mb, cfg.disk_reserve_mb
        )
        environments = Environments(
            LayerSettings(
                store_root=cfg.layer_store,
                cache_dir=container_state / "layer-cache",
                node_id=cfg.edge_id,
                verify=cfg.layer_verify,
                erofs_chunk_size=cfg.layer_chunk_kb * 1024,
                gc_grace_s=cfg.layer_gc_grace_s,
                store_timeout_s=cfg.layer_store_timeout_s,
                image_dir=cfg.image_dir,
                exclude=tuple(cfg.layer_exclude),
                collapse_below_bytes=cfg.layer_collapse_below_mb << 20,
            )
        )
        # (mounted where the container backend always mounted it: a restarted edge finds the
        # mount its running sandboxes bind)
        toolkit = _mount_toolkit(cfg.state_dir / "toolkit", container_state / "toolkit-mnt")
        return cls(
            environments=environments,
            images=ImageResolver(environments),
            network=network,
            toolkit=toolkit,
            pause_reclaim=reclaim,
            # Backends add the directories they write (DiskUsage.disk_paths) at edge start.
            disk_guard=DiskGuard(
                [cfg.state_dir, cfg.layer_store, container_state / "layer-cache"],
                cfg.disk_reserve_mb << 20,
            ),
            layer_gc_interval_s=cfg.layer_gc_interval_s,
        )

    def hold_while(self, busy: Callable[[], bool]) -> None:
        """`busy()` tells, at the edge's close, whether sandboxes of a backend still run (and
        keep using the toolkit mount, the swap area and the network)."""
        self._holders.append(busy)

    def controls(self) -> list[Control]:
        """What `dsec status` reports of the node's services."""
        return [self.pause_reclaim.control()]

    def background_loops(self) -> list[BackgroundLoop]:
        return [self.maintain_layers]  # leases, gc, verification

    async def maintain_layers(self) -> None:
        """Background loop: layer leases, garbage collection, background verification."""
        while True:
            try:
                report = await asyncio.to_thread(self.environments.maintain)
                if report is not None and (report.removed_layers or report.removed_tmp):
                    log.info(
                        "layer gc: removed %d layers (%d bytes), %d staging dirs",
                        len(report.removed_layers),
                        report.freed_bytes,
                        len(report.removed_tmp),
                    )
            except Exception:
                log.exception("layer store maintenance failed")
            await asyncio.sleep(self.layer_gc_interval_s)

    async def close(self) -> None:
        """After every backend closed. Sandboxes left running keep the network, the swap area
        (paused ones may have pages in it) and the toolkit mount for the next edge; with none
        left, nothing of the node's stays behind."""
        busy = any(holds() for holds in self._holders)
        if self.network is not None:
            await self.network.close(teardown=not busy)
        if not busy:
            await asyncio.to_thread(self.pause_reclaim.release)
            mounts.umount_quiet(self.toolkit.mount)
            with contextlib.suppress(OSError):
                self.toolkit.mount.rmdir()
        self.environments.close()


def _mount_toolkit(build_dir: Path, mount_root: Path) -> Toolkit:
    """Builds the toolkit if its inputs changed, and mounts its EROFS image once per node."""
    built = build_toolkit(build_dir)
    target = mount_root / built.name
    target.mkdir(parents=True, exist_ok=True)
    if not mounts.is_mountpoint(target):
        mounts.mount_erofs(toolkit_image(built), target, 0)
    return Toolkit(image=toolkit_image(built), mount=target)


def _network(cfg: EdgeConfig) -> NetworkManager:
    """The edge's sandbox network on the bridge, subnet and gate queue it claims for itself
    (edge.network.claims: no other edge of the node uses them; NetworkClaimError when none is
    free). Its eBPF pins go under the bridge's name, unique on the node as well."""
    claim = claims.claim(
        cfg.state_dir,
        bridge=cfg.net_bridge,
        subnet=cfg.net_subnet,
        gate_queue=cfg.net_gate_queue,
        directory=cfg.net_claim_dir,
    )
    return NetworkManager(
        bridge=claim.bridge,
        subnet=str(claim.subnet),
        upstream=cfg.dns_upstream,
        pin_root=cfg.bpf_pin_dir / claim.bridge,
        refresh_s=cfg.dns_refresh_s,
        gate_queue=claim.gate_queue,
        claim=claim,
    )
