"""The microvm backend: one QEMU `microvm` guest per sandbox, its own kernel, aether as init.

A sandbox's guest (see docs/ARCHITECTURE.md, "MicroVM sandboxes"):

- boots Debian's cloud kernel with the edge's initramfs (guest.py); the image's EROFS layers
  (the same files the container backend mounts, from the same layer store) are read-only
  virtio-blk disks, composed in the guest with overlayfs over the sandbox's own writable ext4
  disk (a sparse file of `disk_mb`); the toolkit disk gives aether and chronus their Python;
- aether is the guest's pid 1 and talks to the edge over a virtio-serial port, the same framed
  wire as a container's socket: every exec/file/HTTP call of the SDK works unchanged;
- is created by restoring its shape's template (templates.py: one boot per image, vCPUs,
  memory and disk size; RAM mapped copy-on-write from the template's file), then claimed: it
  learns its hostname, environment, network, limits, the clock and fresh entropy;
- pauses to disk: QEMU saves the guest (RAM and devices) to local disk and exits, so the host
  gets its memory back; resume restores it in a new QEMU. Any call resumes it first (the
  manager's touch);
- forks (ForkSandbox): its memory, devices and disk of one instant become a template of their
  own, from which every child is restored as a clone and then told its own identity (fork);
- runs as its own QEMU process in its own cgroups (cpu quota of the sandbox's cpu, memory of
  guest RAM + QEMU's overhead, pids), outliving an edge restart: the edge takes it back from its
  record (pid, sockets) and cleans up QEMU processes, disks and cgroups no record owns.

How a guest ends is told by its console (edge/backends/guest_console.py): a kernel panic is KERNEL_FAULT, running
out of memory OOM, aether exiting CHANNEL_CLOSED, QEMU dying RUNTIME_ERROR.

This module is the sandbox's life (start, claim, stop, pause to disk, restart); the pieces it
drives are beside it: host.py (QEMU processes, their sockets and cgroups), vm.py (a running
guest's host side), edge/backends/guest_channel.py (what the guest is told at claim and restore, shared with the vm backend),
templates.py (template snapshots), warm_pool.py (warm guests), qemu.py (QMP, command lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from edge.aether_client import AetherConnection
from edge.backends import guest_channel, guests, packing, pausing, qos
from edge.backends.channels import ChannelKeeper
from edge.backends.contract import (
    BackgroundLoop,
    Capability,
    ExitCallback,
    ForkKind,
    ForkOutcome,
    MemoryUsage,
    PauseOutcome,
    ResumeFailed,
)
from edge.backends.guest_console import account
from edge.backends.microvm import qemu
from edge.backends.microvm.accel import Verdict, probe
from edge.backends.microvm.guest import GuestKit, build_guest
from edge.backends.microvm.host import QemuHost
from edge.backends.microvm.qemu import QmpError
from edge.backends.microvm.templates import Templates, build_template, template_key
from edge.backends.microvm.vm import (
    Shape,
    Vm,
    disks_with_writable,
    is_our_qemu,
    mac_of,
    our_qemus,
    writable_disk,
    write_back,
)
from edge.backends.microvm.vm import disk_id as disk_id_of
from edge.backends.microvm.warm_pool import MicrovmWarmPool
from edge.backends.registry import Built
from edge.backends.warm import WarmPool, WarmSandbox, new_warm_id, on_warm_close
from edge.backends.warm import template as warm_template
from edge.config import MIN_DISK_MB, EdgeConfig
from edge.controls import ABSENT, DISABLED, ENFORCED, Control, ControlMissing
from edge.disk_guard import Allocations
from edge.images import ResolvedImage
from edge.layers import LayerRef, PackResult
from edge.model import SandboxRecord, SandboxSpec
from edge.network import guest as guest_net
from edge.network.policy import Policy
from edge.node import NodeServices
from edge.runtime import cgroups
from edge.runtime import disk as disk_image
from edge.runtime.disk import blank_image, sparse_copy
from edge.runtime.mounts import (
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RDONLY,
    LayerImage,
    umount_quiet,
)
from libdsec.errors import (
    BackendCapabilityMissing,
    DSecError,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)

log = logging.getLogger(__name__)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: virtio-mmio transports of QEMU's microvm machine, and what the edge always attaches:
#: the agent's serial port, the NIC, the writable disk and the toolkit.
MMIO_SLOTS = 24
FIXED_DEVICES = 4
#: The QEMU cgroups' cpu period (us).
CPU_PERIOD_US = 100_000
#: A fork's source, continued, answers a Ping within this (it only stood still); after it the
#: keepalive judges its channel as always (edge/aether_client.py: a starved guest has its 20 s
#: of silence). Not used for a paused source (nothing was held).
RELEASE_S = 5.0
#: Where init.sh mounts the guest's filesystems that are not its root (and /tmp, which it
#: creates): directories it makes in the overlay's upper when the image lacks them. pack_diff
#: leaves them out when that is all they are (empty), as it does a container's mount points.
GUEST_MOUNT_POINTS = ("/.dsec", "/proc", "/sys", "/dev", "/tmp", "/run")
#: What aether writes at the claim (edge/backends/guest_channel.py `identity`): the sandbox's
#: identity, not its work; never packed.
GUEST_IDENTITY_FILES = ("/etc/hostname", "/etc/hosts", "/etc/resolv.conf")
#: The runtime record's image entries (packing.image_record): a fork's child has its source's.
IMAGE_RECORD_KEYS = ("image", "layers", "image_env", "image_workdir")
#: A pause waits this long for the guest to write its page cache out (`_flush_before_pause`).
PAUSE_FLUSH_TIMEOUT_S = 10.0


class MicrovmBackend:
    name = "microvm"
    serves: tuple[str, ...] = ("MICROVM",)
    persistent = True
    starts_inline = False
    capabilities: frozenset[Capability] = frozenset(
        {
            Capability.EXEC,
            Capability.PAUSE,
            Capability.DISK_USAGE,
            Capability.NETWORK_POLICY,
            Capability.FORK,
            Capability.PACK_DIFF,
        }
    )
    #: A child is the whole guest: memory, devices and disk (every process continues).
    fork_kind = ForkKind.MEMORY

    def __init__(
        self,
        node: NodeServices,
        state_dir: Path,
        *,
        kit: GuestKit,
        accel: str,
        cache_dir: Path,
        templates: bool = True,
        max_templates: int = 8,
        default_disk_mb: int = 10240,
        max_disk_mb: int = 204800,
        min_memory_mb: int = 256,
        max_memory_mb: int = 16384,
        max_vcpus: int = 0,
        overhead_mb: int = 192,
        cgroup_parent: str = "dsec",
        ready_timeout_s: float = 120.0,
        qemu_binary: str = "qemu-system-x86_64",
        warm_pool: dict[str, int] | None = None,
        warm_memory_mb: int = 512,
        free_page_reporting: bool = False,
    ) -> None:
        self.state_dir = state_dir
        self.disks = state_dir / "rw"
        self.paused = state_dir / "paused"
        #: One directory per fork in progress: the source's state made shareable (see fork).
        self.forks = state_dir / "forks"
        for d in (self.disks, self.paused, self.forks):
            d.mkdir(parents=True, exist_ok=True)
        #: pack_diff's private disk copies and their mount points (the disks' filesystem).
        self.packs = state_dir / "pack"
        #: The node's layer store (pack_diff registers environments in it).
        self.environments = node.environments
        #: The node's one NetworkManager, shared with containers (one resolver, one bridge).
        self.network = node.network
        #: QEMU processes, their sockets and cgroups (host.py).
        self.host = QemuHost(
            state_dir,
            kit=kit,
            accel=accel,
            append=f"console=ttyS0 tsc_early_khz={guests.tsc_khz()} quiet panic=-1",
            qemu_binary=qemu_binary,
            cgroup_parent=cgroup_parent,
            overhead_mb=overhead_mb,
            network=node.network,
        )
        self.sockets, self.logs, self.netns_dir = (
            self.host.sockets,
            self.host.logs,
            self.host.netns_dir,
        )
        #: The node's image resolver (the layer store's EROFS files are the guest's disks).
        self.images = node.images
        #: The toolkit's EROFS image, attached as a disk (edge/node.py).
        self.toolkit_image = node.toolkit.image
        self.kit = kit
        self.accel = accel
        self.use_templates = templates
        #: New guests get the free-page-reporting balloon (recorded per sandbox: a restore
        #: has the devices its guest booted with). Never with templates (edge/config.py).
        self.free_page_reporting = free_page_reporting
        self.templates = Templates(cache_dir / "templates", max_templates)
        self.default_disk_mb = default_disk_mb
        self.max_disk_mb = max_disk_mb
        self.min_memory_mb = min_memory_mb
        self.max_memory_mb = max_memory_mb
        self.max_vcpus = max_vcpus or os.cpu_count() or 1
        self.ready_timeout_s = ready_timeout_s
        self.channels = ChannelKeeper(
            self.host.address_of_agent, self, ready_timeout_s, ask_hello=True
        )
        self.vms: dict[str, Vm] = {}
        self._locks: dict[str, asyncio.Lock] = {}  # per sandbox: pause/resume/stop in turn
        self._adopted: set[str] = set()  # QEMU names and disk ids taken back after a restart
        # Guests starting at once, at most: a guest's start is CPU-bound (TCG translates its
        # kernel and aether afresh in every QEMU), so 32 at once on 2 cores all crawled (a
        # Hello after 26 s) where taking turns finishes each in well under a second.
        self._starting = asyncio.Semaphore(max(2, os.cpu_count() or 1))
        #: Restored guests waiting for their owner (DSEC_EDGE_MICROVM_WARM_POOL).
        self.warm: WarmPool | None = None
        if warm_pool and any(n > 0 for n in warm_pool.values()):
            self.warm = MicrovmWarmPool(
                warm_pool, self._start_warm, self._discard_warm, self.shape_of, warm_memory_mb
            )
            self.capabilities = self.capabilities | {Capability.WARM_CLAIM}

    @classmethod
    def from_config(cls, cfg: EdgeConfig, node: NodeServices) -> Built:
        """The backend's registry factory (edge/backends/registry.py): the backend when guests
        boot here (the accelerator probe), and the `microvm` entry of the edge's controls
        saying which accelerator, or why microVMs are not offered (a status line of its own
        in `dsec status`). Raises ControlMissing when DSEC_EDGE_MICROVM=on and no guest
        boots."""
        if cfg.microvm == "off":
            return Built(None, (_control(DISABLED, "DSEC_EDGE_MICROVM=off"),))
        try:
            kit = build_guest(cfg.microvm_cache_dir / "guest")
            verdict = probe(kit, cfg.microvm_cache_dir, cfg.microvm_accel, cfg.microvm_qemu)
        except (FailedPrecondition, OSError) as exc:
            kit, verdict = None, Verdict("", str(exc))
        network = node.network
        if network is not None and not os.path.exists("/dev/net/tun"):
            # every guest's NIC is a tap (the network path needs one even without a policy)
            verdict = Verdict("", "/dev/net/tun is missing (the guests' taps)")
        if kit is None or not verdict.accel:
            why = f"microVMs not offered: no guest boots here ({verdict.why})"
            if cfg.microvm == "on":
                raise ControlMissing(why + "; DSEC_EDGE_MICROVM=on requires them")
            log.warning("%s", why)
            return Built(None, (_control(ABSENT, why),))
        backend = cls(
            node,
            cfg.state_dir / "microvm",
            kit=kit,
            accel=verdict.accel,
            cache_dir=cfg.microvm_cache_dir,
            templates=cfg.microvm_templates,
            max_templates=cfg.microvm_max_templates,
            default_disk_mb=cfg.default_disk_mb,
            max_disk_mb=cfg.max_disk_mb,
            min_memory_mb=cfg.microvm_min_memory_mb,
            max_memory_mb=cfg.microvm_max_memory_mb,
            max_vcpus=cfg.microvm_max_vcpus,
            overhead_mb=cfg.microvm_overhead_mb,
            cgroup_parent=cfg.cgroup_parent,
            warm_pool={k: int(v) for k, v in cfg.microvm_warm_pool.items()},
            warm_memory_mb=cfg.microvm_warm_memory_mb,
            qemu_binary=cfg.microvm_qemu,
            free_page_reporting=cfg.microvm_free_page_reporting,
        )
        memory = "free-page reporting " + ("on" if cfg.microvm_free_page_reporting else "off")
        log.info("microVMs offered: %s (%s; %s)", verdict.accel, verdict.why, memory)
        detail = f"{verdict.accel}: {verdict.why}; {memory}, virtio-pmem unavailable on microvm"
        return Built(backend, (_control(ENFORCED, detail),))

    # ------------------------------------------------------------- contract

    def set_exit_callback(self, callback: ExitCallback) -> None:
        self.channels.on_exit = callback

    def channel(self, rec: SandboxRecord) -> Any:
        return self.channels.channel(rec.sandbox_id)

    def validate(self, spec: SandboxSpec) -> None:
        """Shape bounds, the network policy (names resolve), an image made of EROFS files."""
        self.shape_of(spec)
        self._policy(spec.network)
        self._layer_disks(self.images.resolve(spec.image, spec.toolkits))

    def _policy(self, raw: Mapping[str, Any] | None) -> tuple[Policy, dict[str, list[str]]]:
        return guests.check_policy(self.network, raw)

    def shape_of(self, spec: SandboxSpec) -> Shape:
        vcpus, mem = guests.vcpus_and_memory(
            spec,
            min_mb=self.min_memory_mb,
            max_mb=self.max_memory_mb,
            max_vcpus=self.max_vcpus,
            what="a microVM's guest RAM",
        )
        disk = spec.disk_mb or self.default_disk_mb
        if not MIN_DISK_MB <= disk <= self.max_disk_mb:
            raise InvalidArgument(
                f"resources.disk_mb={spec.disk_mb}: expected {MIN_DISK_MB}..{self.max_disk_mb}",
                reason="INVALID_RESOURCES",
                metadata={"field": "resources.disk_mb"},
            )
        return Shape(vcpus, mem, disk)

    def _layer_disks(self, image: ResolvedImage) -> list[qemu.Disk]:
        """The image's layers as read-only disks (l<i>, top-most first; b<i>: a chunked
        layer's data blob). A layer that is a directory cannot be a disk."""
        disks = []
        for i, layer in enumerate(image.lowers):
            if not isinstance(layer, LayerImage):
                raise InvalidArgument(
                    f"image {image.name!r}: layer {i} is a directory ({layer}), not an EROFS "
                    "image: a microVM attaches layers as disks",
                    reason="IMAGE_NOT_BOOTABLE",
                    metadata={"field": "image"},
                )
            disks.append(qemu.Disk(f"l{i}", layer.image, True))
            if layer.blob is not None:
                disks.append(qemu.Disk(f"b{i}", layer.blob, True))
        fixed = FIXED_DEVICES + self.free_page_reporting  # the balloon takes a transport too
        if len(disks) + fixed > MMIO_SLOTS:
            raise InvalidArgument(
                f"image {image.name!r} needs {len(disks)} disks; a microVM has room for "
                f"{MMIO_SLOTS - fixed} (collapse its layers)",
                reason="IMAGE_NOT_BOOTABLE",
                metadata={"field": "image"},
            )
        return disks

    # ------------------------------------------------------------- create

    async def start(self, rec: SandboxRecord) -> None:
        t0 = time.perf_counter()
        shape = self.shape_of(rec.spec)
        image = await asyncio.to_thread(self.images.resolve, rec.spec.image, rec.spec.toolkits)
        w = self.warm.take(rec) if self.warm is not None else None
        if w is not None:
            if w.image.lowers == image.lowers and await self._claim_warm(rec, w, image, t0):
                return
            await self._discard_warm(w)
        with self.warm.cold_start() if self.warm is not None else contextlib.nullcontext():
            async with self._starting:  # a burst takes turns: see __init__
                times = await self._start_guest(rec, shape, image)
        self._log_start(rec, t0, times)

    async def _start_guest(
        self, rec: SandboxRecord, shape: Shape, image: ResolvedImage
    ) -> dict[str, float]:
        """Boot or restore the guest, wait for its Hello, claim it; removed on failure."""
        t0 = time.perf_counter()
        times = await self._boot(rec, shape, image)
        try:
            conn = await self.channels.connect(rec.sandbox_id)
            t3 = time.perf_counter()
            await self._claim(conn, rec, image)
        except BaseException:
            await self.destroy(rec)
            raise
        times["hello_ms"] = (t3 - t0) * 1000 - sum(times.values())
        times["claim_ms"] = (time.perf_counter() - t3) * 1000
        return times

    def _log_start(self, rec: SandboxRecord, t0: float, times: dict[str, float]) -> None:
        log.info(
            "microVM %s started in %.1f ms",
            rec.sandbox_id,
            (time.perf_counter() - t0) * 1000,
            extra={
                "sandbox_id": rec.sandbox_id,
                "from": rec.runtime.get("from", ""),
                **{k: round(v, 2) for k, v in times.items()},
            },
        )

    async def _boot(
        self, rec: SandboxRecord, shape: Shape, image: ResolvedImage
    ) -> dict[str, float]:
        """The guest of `rec` running (restored from its shape's template, or booting), up to
        QEMU running; the caller connects. Everything is removed on failure. Returns timings."""
        t0 = time.perf_counter()
        layers = self._layer_disks(image)
        sid = rec.sandbox_id
        rw = self.disks / f"{sid}.img"
        disks = [qemu.Disk("rw", rw, False), qemu.Disk("tk", self.toolkit_image, True), *layers]
        rec.runtime = {
            "shape": shape.__dict__,
            "disks": [[d.serial, str(d.path), d.readonly] for d in disks],
            "mac": mac_of(sid),
            "accel": self.accel,
            # The guest's devices for its whole life (its restores must have the same).
            "balloon": self.free_page_reporting,
            # The disk keeps the name it was made under (a claimed warm guest's): QEMU reopens
            # a drive by its file name when a save inactivates it.
            "disk_id": sid,
            **packing.image_record(image),  # what pack_diff stacks the sandbox's diff on
        }
        try:
            rw.unlink(missing_ok=True)  # a new inode: never one a QEMU still holds
            if self.use_templates:
                readonly = disks[1:]  # the toolkit and the layers
                tmpl = await self.templates.get(
                    template_key(
                        self.kit.digest,
                        self.accel,
                        shape,
                        readonly,
                        balloon=self.free_page_reporting,
                    ),
                    lambda d: build_template(
                        d,
                        shape,
                        readonly,
                        host=self.host,
                        channels=self.channels,
                        blank_dir=self.disks / ".templates",
                        ready_timeout_s=self.ready_timeout_s,
                        balloon=self.free_page_reporting,
                    ),
                )
                rec.runtime["from"] = "template " + tmpl.key
                await asyncio.to_thread(sparse_copy, tmpl.rw, rw)
                t1 = time.perf_counter()
                memory = qemu.Memory("file", tmpl.ram, share=False)
                await self._launch(rec, memory, restore_from=tmpl.vmstate, ignore_shared=True)
            else:
                rec.runtime["from"] = "boot"
                await asyncio.to_thread(blank_image, rw, shape.disk_mb, self.disks / ".templates")
                t1 = time.perf_counter()
                await self._launch(rec, qemu.Memory("ram"))
            if self.network is not None and rec.sandbox_id.startswith("sb-"):
                await self._attach_network(rec)
        except BaseException:
            await self.destroy(rec)
            raise
        return {"disk_ms": (t1 - t0) * 1000, "qemu_ms": (time.perf_counter() - t1) * 1000}

    async def _attach_network(self, rec: SandboxRecord) -> None:
        """A networked policy: the guest's address, filter and link (its namespace and tap
        exist since its QEMU started). The guest configures itself from the claim."""
        assert self.network is not None
        policy, resolved = await asyncio.to_thread(self._policy, rec.spec.network)
        if policy.networked:
            rec.runtime["net"] = await self.network.attach_guest(
                rec.sandbox_id, self.netns_dir, policy, resolved
            )

    async def update_network_policy(self, rec: SandboxRecord, policy: dict[str, Any]) -> None:
        await guests.update_policy(
            self.network,
            self.channels,
            rec,
            policy,
            netns_dir=self.netns_dir,
            lock=self._lock(rec.sandbox_id),
        )

    # ------------------------------------------------------------- warm microVMs

    async def _start_warm(self, image_name: str) -> WarmSandbox:
        """A restored guest nobody owns yet, up to aether's Hello (claimed at a create)."""
        wid = new_warm_id()
        tmpl = warm_template(wid, image_name)
        assert isinstance(self.warm, MicrovmWarmPool)
        tmpl.spec = self.warm.spec(image_name)
        shape = self.shape_of(tmpl.spec)
        image = await asyncio.to_thread(self.images.resolve, image_name, [])
        await self._boot(tmpl, shape, image)
        holder: list[WarmSandbox] = []
        closed = on_warm_close(
            self.channels, lambda: self.warm, self._discard_warm, holder, "microVM"
        )
        conn = self.channels.new_connection(wid, on_close=closed)
        try:
            await conn.connect(timeout_s=self.ready_timeout_s)
        except BaseException:
            await self.destroy(tmpl)
            raise
        w = WarmSandbox(wid, image_name, image, self.vms[wid], conn, tmpl, time.monotonic())
        holder.append(w)
        return w

    async def _discard_warm(self, w: WarmSandbox) -> None:
        if self.channels.get(w.conn.sandbox_id) is w.conn:
            return  # claimed since: its sandbox's teardown owns it
        with contextlib.suppress(Exception):
            await w.conn.close()
        await self.destroy(w.prep)

    async def _claim_warm(
        self, rec: SandboxRecord, w: WarmSandbox, image: ResolvedImage, t0: float
    ) -> bool:
        """Make warm guest `w` the sandbox of `rec`: its host-side names become the sandbox's
        (sockets, disk, cgroups, log; QEMU keeps its -name, recorded), then the claim."""
        sid, wid = rec.sandbox_id, w.cid
        vm: Vm = w.proc
        try:
            await asyncio.to_thread(self.host.rename, wid, sid)
        except OSError as exc:
            log.warning("claiming warm microVM %s failed: %s", wid, exc)
            return False
        runtime = dict(w.prep.runtime)
        runtime["qemu_name"] = wid
        runtime["from"] = "warm " + runtime.get("from", "")
        runtime["warm"] = True  # a warm sandbox served this create (edge/metrics.py)
        rec.runtime = runtime
        self.vms.pop(wid, None)
        vm.sandbox_id, vm.rec, vm.qemu_name = sid, rec, wid
        vm.qmp.address = self.host.address(sid, "qmp")
        self.vms[sid] = vm
        w.conn.sandbox_id = sid
        self.channels.keep(sid, w.conn)
        t1 = time.perf_counter()
        try:
            await asyncio.to_thread(self.host.set_cpu, sid, rec.spec)
            if rec.spec.qos == "BEST_EFFORT":  # a running QEMU: each of its threads
                await asyncio.to_thread(qos.set_idle_all_threads, vm.pid)
            await self._claim(w.conn, rec, image)
        except BaseException:
            await self.destroy(rec)
            raise
        self._log_start(rec, t0, {"claim_ms": (time.perf_counter() - t1) * 1000})
        return True

    def warm_status(self) -> dict[str, tuple[int, int, int, int]]:
        """Per image (as "<image>@microvm"): (target, ready, claimed, missed)."""
        if self.warm is None:
            return {}
        return {f"{k}@microvm": v for k, v in self.warm.status().items()}

    async def _claim(
        self, conn: AetherConnection, rec: SandboxRecord, image: ResolvedImage
    ) -> None:
        """The guest becomes the sandbox of `rec`: its environment and identity, applied."""
        await conn.claim(
            guest_channel.sandbox_env(rec, image),
            guest=guest_channel.identity(rec),
            timeout_s=self.ready_timeout_s,
        )

    async def _launch(
        self,
        rec: SandboxRecord,
        memory: qemu.Memory,
        *,
        restore_from: Path | None = None,
        ignore_shared: bool = False,
    ) -> None:
        """QEMU for the sandbox of `rec` (its recorded shape, disks and MAC), in its cgroups,
        running: booting, or restored from `restore_from`."""
        sid = rec.sandbox_id
        shape = Shape(**rec.runtime["shape"])
        disks = [qemu.Disk(s, Path(p), ro) for s, p, ro in rec.runtime["disks"]]
        tap = None
        if self.network is not None:  # every guest has its namespace and tap, networked or not
            netns = await asyncio.to_thread(guest_net.create_netns, self.netns_dir, sid)
            tap = await asyncio.to_thread(guest_net.open_tap, netns)
        proc = await self.host.spawn(
            sid,
            shape,
            disks,
            memory,
            rec.runtime["mac"],
            incoming=restore_from is not None,
            tap_fd=tap,
            best_effort=rec.spec.qos == "BEST_EFFORT",
            balloon=bool(rec.runtime.get("balloon")),
        )
        rec.runtime["pid"] = proc.pid
        rec.runtime["qemu_name"] = sid
        try:
            await asyncio.to_thread(self.host.confine, sid, proc.pid, rec.spec, shape)
            qmp = qemu.Qmp(self.host.address(sid, "qmp"))
            vm = Vm(sid, rec, proc.pid, qmp, self.host.console(sid), proc)
            vm.watch()
            self.vms[sid] = vm
            await vm.qmp.connect()
            if restore_from is not None:
                await qemu.restore(vm.qmp, restore_from, ignore_shared=ignore_shared)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise

    # ------------------------------------------------------------- ending

    async def still_running(self, sandbox_id: str) -> bool:
        vm = self.vms.get(sandbox_id)
        return vm is not None and vm.alive

    async def why_ended(self, sandbox_id: str, channel_reason: str) -> tuple[str, str]:
        vm = self.vms.get(sandbox_id)
        if vm is None:
            return "CHANNEL_CLOSED", channel_reason
        await vm.wait(3.0)
        await vm.console.drained()
        told = vm.console.diagnose()
        if told is not None:
            return told
        if vm.alive:
            return "CHANNEL_CLOSED", f"the guest's agent channel closed: {channel_reason}"
        status = vm.exit_status
        if status is not None and status < 0:
            how = f"was killed by {signal.Signals(-status).name}"
        elif status is not None:
            how = f"exited with status {status}"
        else:
            how = "exited"
        return "RUNTIME_ERROR", f"QEMU (pid {vm.pid}) {how}{self.host.qemu_error(sandbox_id)}"

    async def stop(self, rec: SandboxRecord, grace_s: float) -> None:
        async with self._lock(rec.sandbox_id):
            if rec.sandbox_id in self.channels:
                await self.channels.drop(rec.sandbox_id, shutdown_grace_s=grace_s)
            vm = self.vms.get(rec.sandbox_id)
            if vm is not None:
                await vm.wait(grace_s + 1.0)  # aether's shutdown powers the guest off

    async def destroy(self, rec: SandboxRecord) -> None:
        sid = rec.sandbox_id
        await self.channels.drop(sid)
        vm = self.vms.pop(sid, None)
        if vm is not None:
            await vm.qmp.close()
            if vm.alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(vm.pid, signal.SIGKILL)
            await vm.wait(5.0)
            await vm.console.close()
            vm.console.write(self.logs / f"{sid}.console")
        else:
            self._kill_recorded(rec)
        if self.network is not None:
            await self.network.detach_guest(sid, self.netns_dir)
        await asyncio.to_thread(self._remove_files, sid, disk_id_of(rec))
        self._locks.pop(sid, None)

    def _kill_recorded(self, rec: SandboxRecord) -> None:
        pid = int(rec.runtime.get("pid") or 0)
        if pid and is_our_qemu(pid, rec.runtime.get("qemu_name", rec.sandbox_id), self.host.tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _remove_files(self, sid: str, disk_id: str) -> None:
        """Disk, saved state, sockets and cgroups of a sandbox. Writes nothing."""
        for name in (sid, disk_id):
            if not name or "/" in name or name.startswith("."):
                raise ValueError(f"not a microVM id: {name!r}")  # never the parent cgroup
        (self.disks / f"{disk_id}.img").unlink(missing_ok=True)
        (self.paused / f"{sid}.vmstate").unlink(missing_ok=True)
        self.host.unlink_sockets(sid)
        cgroups.remove(self.host.cgroup(sid))

    # ------------------------------------------------------------- pause

    def _lock(self, sid: str) -> asyncio.Lock:
        return self._locks.setdefault(sid, asyncio.Lock())

    async def pause(self, rec: SandboxRecord) -> PauseOutcome:
        """Save the guest to local disk and end its QEMU: the host gets all its memory back."""
        sid = rec.sandbox_id
        async with self._lock(sid):
            vm = self.vms.get(sid)
            before = await self.memory_usage(rec) or MemoryUsage(0, 0)
            if vm is None or rec.runtime.get("paused"):
                return PauseOutcome(before, before, 0.0)
            t0 = time.perf_counter()
            state = self.paused / f"{sid}.vmstate"
            await self._flush_before_pause(sid)
            await self.channels.drop(sid)  # ours to close: not a lost channel
            try:
                await qemu.save(vm.qmp, state, ignore_shared=False)
                await vm.qmp.execute("quit")
            except BaseException:
                state.unlink(missing_ok=True)
                with contextlib.suppress(Exception):
                    await vm.qmp.execute("cont")
                    await self.channels.connect(sid)
                raise
            await vm.wait(10.0)
            await vm.qmp.close()
            await vm.console.close()
            self.vms.pop(sid, None)
            # QEMU's `cat` wrote the state through the page cache, charged to the sandbox's
            # memory cgroup: written back and dropped, the memory is really the host's again
            # (measured: 22-47% of the cgroup's charge stayed otherwise).
            await asyncio.to_thread(write_back, state)
            rec.runtime["paused"] = True
            rec.runtime.pop("pid", None)
            log.info(
                "microVM %s paused to disk in %.1f ms (%d MB)",
                sid,
                (time.perf_counter() - t0) * 1000,
                state.stat().st_size >> 20,
                extra={"sandbox_id": sid},
            )
            after = await self.memory_usage(rec) or MemoryUsage(0, 0)
            return PauseOutcome(before, after, time.perf_counter() - t0)

    async def memory_usage(self, rec: SandboxRecord) -> MemoryUsage | None:
        """Running: the QEMU cgroup's charge (guest RAM it touched, QEMU itself). Paused: no
        process; the guest's memory is the saved state on local disk."""
        sid = rec.sandbox_id
        if rec.runtime.get("paused"):
            state = self.paused / f"{sid}.vmstate"
            saved = state.stat().st_size if state.exists() else 0
            return MemoryUsage(0, saved)
        d = cgroups.controller_dir("memory", self.host.cgroup(sid))
        if d is None or not d.is_dir():
            return None
        return await asyncio.to_thread(pausing.usage, d)

    async def resume(self, rec: SandboxRecord) -> None:
        """Restore the guest from its saved state in a new QEMU."""
        sid = rec.sandbox_id
        async with self._lock(sid):
            if not rec.runtime.get("paused"):
                return
            t0 = time.perf_counter()
            state = self.paused / f"{sid}.vmstate"
            if not state.is_file():
                raise ResumeFailed(f"the guest's saved memory {state} is gone")
            try:
                async with self._starting:  # a burst of resumes takes turns, as starts do
                    await self._launch(rec, qemu.Memory("ram"), restore_from=state)
                    conn = await self.channels.connect(sid)
                await conn.sync_guest(
                    guest_channel.sync(rec, bool(rec.runtime.pop("net_pending", 0)))
                )
            except BaseException as exc:
                await self.channels.drop(sid)
                vm = self.vms.pop(sid, None)
                if vm is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(vm.pid, signal.SIGKILL)
                    await vm.qmp.close()
                    await vm.console.close()
                    vm.console.write(self.logs / f"{sid}.console")
                if isinstance(exc, Exception):
                    # The saved state is the same on every retry: a sandbox that cannot be
                    # resumed ends (the manager: RESUME_FAILED), with why, rather than
                    # staying PAUSED for ever.
                    why = getattr(exc, "message", None) or str(exc) or type(exc).__name__
                    raise ResumeFailed(f"the guest could not be restored: {why}") from exc
                raise
            rec.runtime["paused"] = False
            state.unlink(missing_ok=True)
            log.info(
                "microVM %s resumed in %.1f ms",
                sid,
                (time.perf_counter() - t0) * 1000,
                extra={"sandbox_id": sid},
            )

    # ------------------------------------------------------------- fork

    async def fork(self, source: SandboxRecord, children: Sequence[SandboxRecord]) -> ForkOutcome:
        """Every child a copy of the source's guest at one instant: its memory, devices and
        writable disk, captured once in a directory of `forks/` and removed when the children
        run (each maps the RAM file privately, as a template's clone does; the mapping
        outlives the file).

        1. Capture. A running source is stopped, saved with all of its RAM (a clone maps its
           RAM share=off, which x-ignore-shared does not skip) and its disk copied while it
           stands still, then continued: its agent channel stays connected, held (a stopped
           aether answers no ping) over the stall. A paused source already is its saved
           state and disk; it stays paused.
        2. Share. A helper QEMU loads that state into a share=on RAM file, without running it,
           and saves only its devices (x-ignore-shared): the template layout, `ram` + `vmstate`.
        3. Children, started as clones of that template (taking turns, as creates do): each
           its own disk (a sparse copy: ext4 here has no reflink), QEMU, network; then a
           GuestSync makes it itself (hostname, /etc files, address, clock, entropy); its
           aether drops the source's streams at the new channel's first Ping."""
        sid = source.sandbox_id
        if source.runtime.get("balloon"):
            raise BackendCapabilityMissing(
                f"sandbox {sid} reports free pages (it started with "
                "DSEC_EDGE_MICROVM_FREE_PAGE_REPORTING on): its children would map one RAM file "
                "copy-on-write, and QEMU returns a page a guest reports free by punching a hole "
                "in that file, under every sibling",
                reason="FREE_PAGE_REPORTING",
                metadata={"backend": self.name, "capability": Capability.FORK.value},
            )
        work = self.forks / f"{sid}.{secrets.token_hex(4)}"
        t0 = time.perf_counter()
        conn: AetherConnection | None = None
        running = False  # the source: captured running (else its pause's saved state)
        await asyncio.to_thread(work.mkdir, parents=True)
        try:
            async with self._lock(sid):
                vm = self.vms.get(sid)
                if source.runtime.get("paused"):
                    # Its saved state and disk are read under the lock: nothing changes them.
                    saved = self.paused / f"{sid}.vmstate"
                    if not saved.is_file():
                        raise FailedPrecondition(
                            f"the paused sandbox {sid}'s saved memory {saved} is gone",
                            reason="FORK_SOURCE_LOST",
                        )
                    stall = 0.0
                    await asyncio.to_thread(sparse_copy, writable_disk(source), work / "rw.img")
                    await self._share_memory(source, saved, work)
                elif vm is not None and vm.alive:
                    running = True
                    stall, conn = await self._capture(source, vm, work)
                else:
                    raise FailedPrecondition(
                        f"sandbox {sid} has no running guest to fork",
                        reason="FORK_SOURCE_LOST",
                    )
            if running:  # the source runs again: its state is made shareable meanwhile
                async with asyncio.TaskGroup() as tg:
                    if conn is not None:
                        tg.create_task(_release(conn, RELEASE_S))
                    tg.create_task(self._share_memory(source, work / "full.state", work))
                await asyncio.to_thread((work / "full.state").unlink)
            t1 = time.perf_counter()
            results = await asyncio.gather(
                *(self._start_fork_child(source, child, work) for child in children),
                return_exceptions=True,
            )
        finally:
            if conn is not None and conn.held:  # the capture's stall ended, whatever failed
                await _release(conn, RELEASE_S)
            await asyncio.to_thread(shutil.rmtree, work, True)
        errors: list[Exception | None] = []
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r
            errors.append(r)
        log.info(
            "microVM %s forked %d ways (%d failed) in %.1f ms: stall %.1f ms, capture %.1f ms",
            sid,
            len(children),
            sum(e is not None for e in errors),
            (time.perf_counter() - t0) * 1000,
            stall * 1000,
            (t1 - t0) * 1000,
            extra={"sandbox_id": sid},
        )
        return ForkOutcome(errors, stall)

    async def _connect_while_alive(self, sid: str) -> AetherConnection:
        """The guest's channel, or why its QEMU ended first (a guest that panics at once is
        told at once, not after ready_timeout_s of connecting to its dead socket)."""
        vm = self.vms[sid]
        connect = asyncio.ensure_future(self.channels.connect(sid))
        ended = asyncio.ensure_future(vm.exited.wait())
        try:
            await asyncio.wait({connect, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (connect, ended):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        if connect.done() and not connect.cancelled():
            return connect.result()
        reason, message = await self.why_ended(sid, "QEMU exited before aether's Hello")
        raise Unavailable(f"the guest ended at its start ({reason}): {message}", reason=reason)

    async def _capture(
        self, source: SandboxRecord, vm: Vm, work: Path
    ) -> tuple[float, AetherConnection | None]:
        """The running source's RAM and devices into `work/full.state` and its disk into
        `work/rw.img`, of one instant; the source runs again before this returns. Returns
        the stall (seconds it stood still: the save, the disk copy, `cont`) and its held
        channel (the caller releases it)."""
        conn = self.channels.get(source.sandbox_id)
        if conn is not None:
            conn.hold()  # stopped, its aether answers no ping: not a death
        stopped_at = time.perf_counter()
        try:
            try:
                await qemu.save(vm.qmp, work / "full.state", ignore_shared=False)
                # QEMU drained and flushed the disk at the stop: the file is the guest's disk
                # as of the saved memory (its page cache is in that memory).
                await asyncio.to_thread(sparse_copy, writable_disk(source), work / "rw.img")
            finally:
                # After a completed migration QEMU reactivates its block devices at `cont`.
                await vm.qmp.execute("cont")
        except BaseException:
            if conn is not None:
                await _release(conn, RELEASE_S)  # judged by its keepalive again
            raise
        return time.perf_counter() - stopped_at, conn

    async def _share_memory(self, source: SandboxRecord, state: Path, work: Path) -> None:
        """`state` (devices and all of RAM) as a template: `work/ram` (the RAM, a file) and
        `work/vmstate` (the devices only), through a helper QEMU of the source's shape and
        disks (the writable one: `work/rw.img`) that loads it and saves it again, never
        running the guest."""
        hid = f"fork-{work.name.rsplit('.', 1)[-1]}"
        shape = Shape(**source.runtime["shape"])
        disks = disks_with_writable(source, work / "rw.img")
        tap = None
        try:
            if self.network is not None:
                # The source's NIC is a tap's (vnet headers): its state loads only onto a tap.
                netns = await asyncio.to_thread(guest_net.create_netns, self.netns_dir, hid)
                tap = await asyncio.to_thread(guest_net.open_tap, netns)
            proc = await self.host.spawn(
                hid,
                shape,
                disks,
                qemu.Memory("file", work / "ram", share=True),
                str(source.runtime["mac"]),
                incoming=True,
                tap_fd=tap,
                paused=True,  # -S: whatever run state was saved, the guest never runs here
                balloon=bool(source.runtime.get("balloon")),
            )
        except BaseException:
            await self._remove_helper_netns(hid)
            raise
        q = qemu.Qmp(self.host.address(hid, "qmp"))
        try:
            await q.connect()
            await qemu.restore(q, state, ignore_shared=False, start=False)
            await qemu.save(q, work / "vmstate", ignore_shared=True)
            await q.execute("quit")
            (self.logs / f"{hid}.qemu").unlink(missing_ok=True)  # kept when it failed
        except QmpError as exc:
            raise Unavailable(
                f"the fork's state could not be prepared: {exc.message}{self.host.qemu_error(hid)}",
                reason="FORK_FAILED",
            ) from exc
        finally:
            await q.close()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.to_thread(proc.wait)
            self.host.unlink_sockets(hid)
            await self._remove_helper_netns(hid)

    async def _remove_helper_netns(self, hid: str) -> None:
        if self.network is not None:
            path = guest_net.netns_path(self.netns_dir, hid)
            await asyncio.to_thread(guest_net.remove_netns, path)

    async def _start_fork_child(
        self, source: SandboxRecord, child: SandboxRecord, work: Path
    ) -> None:
        """`child` running as a clone of the fork's template in `work`, told who it is."""
        cid = child.sandbox_id
        queued = time.perf_counter()
        rw = self.disks / f"{cid}.img"
        child.runtime = {
            "shape": dict(source.runtime["shape"]),
            "disks": [[d.serial, str(d.path), d.readonly] for d in disks_with_writable(source, rw)],
            "mac": mac_of(cid),
            "accel": self.accel,
            "disk_id": cid,
            "balloon": bool(source.runtime.get("balloon")),
            "from": f"fork {source.sandbox_id}",
            # the same image: what the child's own pack_diff stacks its diff on
            **{k: source.runtime[k] for k in IMAGE_RECORD_KEYS if k in source.runtime},
        }
        async with self._starting:  # CPU-bound under TCG: children take turns, as creates do
            t0 = time.perf_counter()
            try:
                await asyncio.to_thread(rw.unlink, True)  # a new inode: never one a QEMU holds
                await asyncio.to_thread(sparse_copy, work / "rw.img", rw)
                t1 = time.perf_counter()
                memory = qemu.Memory("file", work / "ram", share=False)
                await self._launch(child, memory, restore_from=work / "vmstate", ignore_shared=True)
                if self.network is not None:
                    await self._attach_network(child)
                t2 = time.perf_counter()
                conn = await self._connect_while_alive(cid)
                t3 = time.perf_counter()
                # Applied before anything else the channel carries (aether reads in order).
                await conn.sync_guest(guest_channel.fork_sync(child))
            except BaseException:
                await self.destroy(child)
                raise
        times = {
            "queued_ms": (t0 - queued) * 1000,  # behind its siblings (or creates)
            "disk_ms": (t1 - t0) * 1000,
            "qemu_ms": (t2 - t1) * 1000,
            "hello_ms": (t3 - t2) * 1000,
        }
        self._log_start(child, t0, times)

    # ------------------------------------------------------------- pack_diff

    async def pack_diff(
        self,
        rec: SandboxRecord,
        name: str,
        *,
        exclude: Sequence[str] = (),
        default_excludes: bool = True,
        config: Mapping[str, str] | None = None,
    ) -> PackResult:
        """Checkpoint the guest's writable layer as environment `name`: the sandbox's layers
        plus the diff, the overlay upper directory on its writable disk (/upper; the disk's
        `work` and lost+found are not the sandbox's).

        The host never mounts the live disk: it copies it (sparse) to a private file and reads
        that. A running guest first writes its page cache out (sync in the guest), then stops
        for the copy only (QMP stop ... cont: the stall, logged); a paused guest's disk is
        quiescent (its QEMU has exited; the pause flushed it). The copy is checked and repaired
        (e2fsck) before it is mounted read-only: a guest wrote that filesystem. The copy and its
        mount go on every path."""
        packing.check_packable(rec)
        layers = await self._pack_layers(rec)
        sid = rec.sandbox_id
        t0 = time.perf_counter()
        self.packs.mkdir(exist_ok=True)
        work = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix=f"{sid}.", dir=self.packs))
        try:
            times = await self._copy_disk(rec, work / "disk.img")
            result = await asyncio.to_thread(
                self._pack_copy,
                work,
                layers=layers,
                config={**packing.environment_config(rec), **(config or {})},
                name=name,
                source=f"pack_diff:{sid}",
                # the guest's identity files (aether writes them at the claim; a container
                # has them bind-mounted, never in its upper) are the edge's, not its work
                exclude=[*exclude, *GUEST_IDENTITY_FILES],
                default_excludes=default_excludes,
                mountpoints=list(GUEST_MOUNT_POINTS),
            )
        finally:
            await asyncio.to_thread(_remove_pack_dir, work)
        packing.log_packed(rec, result, t0, **{k: round(v, 2) for k, v in times.items()})
        return result

    async def _pack_layers(self, rec: SandboxRecord) -> list[LayerRef]:
        """The layers the guest started from. A record made before they were recorded: its
        image resolved now, taken only if it still is the disks the guest has attached."""
        if rec.runtime.get("layers"):
            return packing.recorded_layers(rec)
        image = await asyncio.to_thread(self.images.resolve, rec.spec.image, rec.spec.toolkits)
        attached = [
            [s, p, ro] for s, p, ro in rec.runtime.get("disks", []) if s not in ("rw", "tk")
        ]
        now = [[d.serial, str(d.path), d.readonly] for d in self._layer_disks(image)]
        if attached == now:
            rec.runtime.update(packing.image_record(image))
        return packing.recorded_layers(rec)

    async def _copy_disk(self, rec: SandboxRecord, copy: Path) -> dict[str, float]:
        """A sparse copy of the guest's writable disk at one instant. Returns how long the
        guest took to flush and how long it was stopped for the copy (ms; 0 when paused)."""
        sid = rec.sandbox_id
        disk = writable_disk(rec)
        async with self._lock(sid):  # no pause, resume or stop meanwhile
            vm = self.vms.get(sid)
            if rec.runtime.get("paused") or vm is None:
                if not disk.is_file():
                    raise FailedPrecondition(f"sandbox {sid} has no writable disk any more")
                await asyncio.to_thread(sparse_copy, disk, copy)
                return {"flush_ms": 0.0, "stall_ms": 0.0}
            t0 = time.perf_counter()
            await guest_channel.flush(self.channels.channel(sid))
            t1 = time.perf_counter()
            self.channels.hold(sid)  # a stopped guest answers no ping
            try:
                await vm.qmp.execute("stop")  # in-flight writes drained and flushed to the file
                try:
                    await asyncio.to_thread(sparse_copy, disk, copy)
                finally:
                    await vm.qmp.execute("cont")
            finally:
                t2 = time.perf_counter()
                try:
                    await self.channels.release(sid)
                except Unavailable as exc:
                    await self.channels.report_exit(sid, *await self.why_ended(sid, exc.message))
            return {"flush_ms": (t1 - t0) * 1000, "stall_ms": (t2 - t1) * 1000}

    def _pack_copy(self, work: Path, **pack: Any) -> PackResult:
        """Blocking: repair the private copy, mount it read-only, pack its /upper, unmount."""
        copy, mnt = work / "disk.img", work / "mnt"
        fixed = disk_image.repair(copy)
        if fixed:  # always the free counts (ext4 updates them lazily); more if stopped mid-write
            log.debug("pack_diff: e2fsck repaired the copy of %s: %s", work.name, fixed[-500:])
        mnt.mkdir()
        disk_image.mount_image(copy, mnt, MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        try:
            upper = mnt / "upper"
            if not upper.is_dir():
                raise FailedPrecondition(
                    "the guest's writable disk has no /upper (not a dsec microVM disk)",
                    reason="NO_WRITABLE_LAYER",
                )
            return self.environments.pack_diff(upper=upper, **pack)
        finally:
            umount_quiet(mnt)

    def _remove_packs(self) -> None:
        """Leftovers of pack_diffs an edge crash interrupted (at start: none is under way)."""
        if self.packs.is_dir():
            for work in self.packs.iterdir():
                _remove_pack_dir(work)

    async def _flush_before_pause(self, sid: str) -> None:
        """A paused guest's disk holds all it wrote (pack_diff reads it without restoring the
        guest): its page cache is written out first. A guest that cannot (no channel, too
        slow) is paused anyway: what it held is then saved with its memory, as before."""
        try:
            await guest_channel.flush(self.channels.channel(sid), timeout_s=PAUSE_FLUSH_TIMEOUT_S)
        except DSecError as exc:
            log.warning("microVM %s paused without a flush: %s", sid, exc.message)

    # ------------------------------------------------------------- restart

    async def adopt(self, rec: SandboxRecord) -> bool:
        sid = rec.sandbox_id
        self._adopted.add(disk_id_of(rec))
        if not await guests.adopt_network(self.network, rec):
            return False
        if rec.runtime.get("paused"):
            return (self.paused / f"{sid}.vmstate").exists()
        pid = int(rec.runtime.get("pid") or 0)
        name = str(rec.runtime.get("qemu_name", sid))
        if not pid or not is_our_qemu(pid, name, self.host.tag):
            return False
        vm = Vm(
            sid,
            rec,
            pid,
            qemu.Qmp(self.host.address(sid, "qmp")),
            self.host.console(sid),
            None,
            name,
        )
        self._adopted.add(name)
        vm.watch()
        self.vms[sid] = vm
        try:
            await vm.qmp.connect(timeout_s=5.0)
            await self.channels.connect(sid, timeout_s=10.0)
        except Unavailable as exc:
            log.warning("cannot take microVM %s back: %s", sid, exc)
            self.vms.pop(sid, None)
            await vm.qmp.close()
            await vm.console.close()
            return False
        return True

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        """QEMU processes, disks, saved states and sockets of sandboxes no record keeps."""
        removed = []
        for pid, vm_id in our_qemus(self.host.tag):
            if vm_id not in keep and vm_id not in self._adopted:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                removed.append(vm_id)
        # A fork's directory outlives only a fork that an edge crash interrupted.
        for d in list(self.forks.iterdir()):
            await asyncio.to_thread(shutil.rmtree, d, True)
        await asyncio.to_thread(self._remove_packs)
        files = [p.name for d in (self.disks, self.paused, self.sockets) for p in d.iterdir()]
        ids = {n.rsplit(".", 1)[0] for n in files if not n.startswith(".") and "." in n}
        for vm_id in sorted(ids - keep - self._adopted):
            await asyncio.to_thread(self._remove_files, vm_id, vm_id)
            removed.append(vm_id)
        if self.network is not None:
            removed += await self.network.cleanup_orphans(keep, netns_dir=self.netns_dir)
        return sorted(set(removed))

    def background_loops(self) -> Sequence[BackgroundLoop]:
        return [self.watch_loop] + ([self.warm.run] if self.warm is not None else [])

    async def watch_loop(self) -> None:
        """Per running guest, every second: what its console counted into its violations."""
        while True:
            await asyncio.sleep(1.0)
            for vm in list(self.vms.values()):
                if vm.rec is not None:
                    disk_mb = int(vm.rec.runtime.get("shape", {}).get("disk_mb", 0))
                    await account(vm.console, vm.rec, self.channels, self.network, disk_mb)

    async def close(self) -> None:
        """The edge goes; the guests stay (taken back by the next edge). Warm ones go."""
        if self.warm is not None:
            await self.warm.close()
        await self.channels.close_all()
        for vm in self.vms.values():
            await vm.qmp.close()
            await vm.console.close()
        self.vms.clear()

    # ------------------------------------------------------------- disk usage

    def disk_paths(self) -> list[Path]:
        return [self.disks, self.paused, self.forks, self.templates.root]

    def disk_allocations(self) -> Allocations:
        out: Allocations = {}
        for sid, vm in list(self.vms.items()):
            with contextlib.suppress(OSError):
                disk_id = disk_id_of(vm.rec) if vm.rec is not None else sid
                st = (self.disks / f"{disk_id}.img").stat()
                out[sid] = (st.st_dev, st.st_blocks * 512)
        return out


# ----------------------------------------------------------------- helpers


async def _release(conn: AetherConnection, timeout_s: float) -> None:
    """A channel held over a stall is judged by its keepalive again; a guest that does not
    answer at once is not ended here: the keepalive closes a silent channel and the keeper
    then asks whether the guest still runs (edge/backends/channels.py)."""
    with contextlib.suppress(Unavailable):
        await conn.release(timeout_s)


def _control(state: str, detail: str) -> Control:
    """The `microvm` control: which accelerator runs guests, or why there are none."""
    return Control("microvm", state, detail, status_line=True)


def _remove_pack_dir(work: Path) -> None:
    """A pack_diff's private disk copy and its mount point (unmounted first if need be)."""
    mnt = work / "mnt"
    if mnt.is_dir():
        umount_quiet(mnt)
    shutil.rmtree(work, ignore_errors=True)
