"""The vm backend: one libvirt domain per sandbox, a complete Debian system with its own init.

A sandbox's VM (see docs/ARCHITECTURE.md, "Full VMs"):

- is a q35 machine booting the image's own kernel into systemd (images.py: the images are
  built by scripts/build-vm-images.sh); its disk is a qcow2 overlay sized by the sandbox's
  disk limit; aether runs as a systemd service from the toolkit disk and talks to the edge
  over a virtio-serial port, the same wire as a container's and a microVM's, so every
  exec/file/HTTP call of the SDK works unchanged (domain.py has the machine);
- is created by restoring its image's template (one boot per image and shape, saved by
  libvirt once the guest's aether, and for a desktop its desktop, is up: kept in
  edge/backends/template_cache.py; each clone's name written into the save file by
  domain.py), else by a cold boot (DSEC_EDGE_VM_TEMPLATES=false); then claimed like a microVM (hostname,
  environment, network, clock, entropy: edge/backends/guest_channel.py);
- pauses with libvirt's managed save: its memory to local disk, QEMU gone, the host's memory
  back; any call resumes it (the manager's touch) from that save;
- is a persistent libvirt domain, so it outlives an edge restart and the next edge takes it
  back by name (`dsec-<edge tag>-<sandbox id>`); domains of this edge no record keeps are
  removed;
- has a screen when its image does (the desktop image): screenshots taken by the host
  (libvirt's screenshot of the VGA display), input delivered as USB tablet and keyboard
  events through QMP (screen.py, input.py), VNC on a Unix socket for the live view. host.py
  has the disks and the memory limit.

How a VM ends: its console (edge/backends/guest_console.py) tells a kernel panic
(KERNEL_FAULT) or an OOM kill of aether (OOM); libvirt's lifecycle events tell a crash
(pvpanic: KERNEL_FAULT), QEMU failing (RUNTIME_ERROR) or the domain destroyed by someone else
(RUNTIME_ERROR); a guest that powered off on its own is CHANNEL_CLOSED. libvirtd being
unreachable does not end a sandbox (QEMU runs on without it); creates, pauses and display
calls fail with UNAVAILABLE LIBVIRT_UNREACHABLE meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import libvirt

from edge.aether_client import AetherConnection
from edge.backends import guest_channel, guests
from edge.backends.channels import ChannelKeeper
from edge.backends.contract import (
    BackgroundLoop,
    Capability,
    ExitCallback,
    MemoryUsage,
    PauseOutcome,
    ResumeFailed,
)
from edge.backends.guest_console import Console, account
from edge.backends.registry import Built
from edge.backends.template_cache import CachedTemplate, TemplateCache
from edge.backends.vm import domain as dom_xml
from edge.backends.vm import host, screen
from edge.backends.vm.images import VmImage, VmImages
from edge.backends.vm.libvirt_conn import STOPPED_DETAIL, Libvirt, lookup
from edge.config import MIN_DISK_MB, EdgeConfig
from edge.controls import ABSENT, DISABLED, ENFORCED, Control, ControlMissing
from edge.disk_guard import Allocations
from edge.model import SandboxRecord, SandboxSpec
from edge.network import guest as guest_net
from edge.network.links import veth_name
from edge.network.policy import Policy
from edge.node import NodeServices
from libdsec.errors import (
    BackendCapabilityMissing,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)

log = logging.getLogger(__name__)

#: Where libvirt's system driver keeps managed saves (a paused VM's memory).
MANAGED_SAVE_DIR = Path("/var/lib/libvirt/qemu/save")
CPU_PERIOD_US = 100_000
#: What the console says when a desktop image's session is up (build-vm-images.sh).
DESKTOP_READY = b"DSEC-DESKTOP-READY"


@dataclass(frozen=True)
class Shape:
    vcpus: int
    memory_mb: int
    disk_mb: int


@dataclass(frozen=True)
class VmTemplate(CachedTemplate):
    """A saved, booted guest: `state.save` (libvirt's save file: the domain XML, the memory
    and devices) and `disk.qcow2` (its disk at that moment, never written again: every clone's
    overlay is backed by it)."""

    @property
    def state(self) -> Path:
        return self.dir / "state.save"

    @property
    def disk(self) -> Path:
        return self.dir / "disk.qcow2"


class VmTemplates(TemplateCache[VmTemplate]):
    FORMAT = "dsec-vm-template/2"  # 2: a desktop is saved drawn

    def __init__(self, root: Path, max_templates: int) -> None:
        super().__init__(root, VmTemplate, max_templates=max_templates, label="VM")


@dataclass
class Running:
    """What the edge holds of a running VM: its console reader and its record (None for a
    template's guest)."""

    console: Console
    rec: SandboxRecord | None
    #: libvirt said the guest crashed (pvpanic: its kernel panicked).
    panicked: bool = False
    #: How libvirt said the domain stopped (STOPPED_DETAIL's words), "" while it runs.
    stopped: str = ""  # the last lifecycle event libvirt sent, as words


class VmBackend:
    name = "vm"
    serves: tuple[str, ...] = ("VM",)
    persistent = True
    starts_inline = False
    capabilities: frozenset[Capability] = frozenset(
        {
            Capability.EXEC,
            Capability.PAUSE,
            Capability.DISK_USAGE,
            Capability.NETWORK_POLICY,
            Capability.DISPLAY,
        }
    )

    def __init__(
        self,
        node: NodeServices,
        state_dir: Path,
        *,
        libvirt_conn: Libvirt,
        accel: str,
        images: VmImages,
        cache_dir: Path,
        socket_dir: Path,
        templates: bool = True,
        max_templates: int = 4,
        min_memory_mb: int = 512,
        max_memory_mb: int = 16384,
        max_vcpus: int = 0,
        overhead_mb: int = 256,
        ready_timeout_s: float = 600.0,
    ) -> None:
        self.state_dir = state_dir
        self.disks = state_dir / "disks"
        self.logs = state_dir / "logs"
        for d in (self.disks, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        #: Whose domains these are: a hash of the state directory (two edges on one node).
        self.tag = hashlib.sha256(os.fsencode(state_dir.resolve())).hexdigest()[:10]
        # Sockets live under a short path (a Unix socket's path has 108 bytes at most).
        self.sockets = socket_dir / self.tag
        self.sockets.mkdir(parents=True, exist_ok=True)
        os.chmod(self.sockets, 0o700)
        self.libvirt = libvirt_conn
        self.accel = accel
        self.images = images
        self.network = node.network
        self.toolkit_image = node.toolkit.image
        self.use_templates = templates
        self.templates = VmTemplates(cache_dir / "templates", max_templates)
        self.min_memory_mb = min_memory_mb
        self.max_memory_mb = max_memory_mb
        self.max_vcpus = max_vcpus or os.cpu_count() or 1
        self.overhead_mb = overhead_mb
        self.ready_timeout_s = ready_timeout_s
        self.channels = ChannelKeeper(self._agent, self, ready_timeout_s, ask_hello=True)
        self.running: dict[str, Running] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._template_locks: dict[str, asyncio.Lock] = {}
        self._adopted: set[str] = set()
        #: Guests starting at once (a boot or a restore is CPU-bound under TCG).
        self._starting = asyncio.Semaphore(max(1, (os.cpu_count() or 2) // 2))
        self._watching = False
        self._toolkit_stamp: tuple[str, int, int] | None = None
        self._toolkit_sha = ""

    @classmethod
    def from_config(cls, cfg: EdgeConfig, node: NodeServices) -> Built:
        """The registry's factory: the backend when libvirtd answers and a guest kernel boots
        under an accelerator (the probe, cached per host boot), and the `vm` control saying
        which accelerator, or why VMs are not offered (its own line in `dsec status`)."""
        if cfg.vm == "off":
            return Built(None, (_control(DISABLED, "DSEC_EDGE_VM=off"),))
        images = VmImages(cfg.vm_image_dir)
        conn = Libvirt(cfg.vm_uri)
        why = ""
        accel = ""
        try:
            conn.open()
            names = images.names()
            if not names:
                why = f"no VM images in {cfg.vm_image_dir} (scripts/build-vm-images.sh)"
            elif node.network is not None and not os.path.exists("/dev/net/tun"):
                why = "/dev/net/tun is missing (the guests' taps)"
            else:
                from edge.backends.vm.accel import probe

                accel, why = probe(conn, images.get(names[0]), cfg.vm_cache_dir, cfg.vm_accel)
        except (Unavailable, FailedPrecondition, InvalidArgument, OSError) as exc:
            why = getattr(exc, "message", None) or str(exc)
        if not accel:
            msg = f"full VMs not offered: {why}"
            if cfg.vm == "on":
                raise ControlMissing(msg + "; DSEC_EDGE_VM=on requires them")
            log.warning("%s", msg)
            conn.close()
            return Built(None, (_control(ABSENT, msg),))
        backend = cls(
            node,
            cfg.state_dir / "vm",
            libvirt_conn=conn,
            accel=accel,
            images=images,
            cache_dir=cfg.vm_cache_dir,
            socket_dir=cfg.vm_socket_dir,
            templates=cfg.vm_templates,
            max_templates=cfg.vm_max_templates,
            min_memory_mb=cfg.vm_min_memory_mb,
            max_memory_mb=cfg.vm_max_memory_mb,
            max_vcpus=cfg.vm_max_vcpus,
            overhead_mb=cfg.vm_overhead_mb,
            ready_timeout_s=cfg.vm_ready_timeout_s,
        )
        log.info("full VMs offered: %s (%s)", accel, why)
        return Built(backend, (_control(ENFORCED, f"{accel}: {why}"),))

    # ------------------------------------------------------------- names

    def _agent(self, vm_id: str) -> str:
        return str(self.sockets / f"{vm_id}.agent")

    def _paths(self, vm_id: str, disk: Path, display: bool) -> dom_xml.DomainPaths:
        return dom_xml.DomainPaths(
            disk=disk,
            toolkit=self.toolkit_image,
            agent=self.sockets / f"{vm_id}.agent",
            console=self.sockets / f"{vm_id}.console",
            vnc=self.sockets / f"{vm_id}.vnc" if display else None,
        )

    def _domain(self, vm_id: str) -> str:
        return dom_xml.domain_name(self.tag, vm_id)

    def _cmdline(self, image: VmImage) -> str:
        parts = [
            "root=/dev/vda rw console=ttyS0 net.ifnames=0 quiet panic=-1",
            "systemd.show_status=0 systemd.log_target=null",
            f"tsc_early_khz={guests.tsc_khz()}",
        ]
        return " ".join(parts)

    def _spec(self, vm_id: str, spec: SandboxSpec | None, shape: Shape, image: VmImage,
              disk: Path) -> dom_xml.DomainSpec:  # fmt: skip
        cpu_millis = spec.cpu_millis if spec is not None else shape.vcpus * 1000
        return dom_xml.DomainSpec(
            name=self._domain(vm_id),
            sandbox_id=vm_id,
            vcpus=shape.vcpus,
            memory_mb=shape.memory_mb,
            kernel=image.kernel,
            initrd=image.initrd,
            cmdline=self._cmdline(image),
            paths=self._paths(vm_id, disk, image.display),
            tap=veth_name(vm_id),
            mac=guest_net.guest_mac(vm_id),
            accel=self.accel,
            display=image.display,
            cpu_quota_us=max(1000, cpu_millis * CPU_PERIOD_US // 1000),
            memory_limit_mb=shape.memory_mb + self.overhead_mb,
        )

    # ------------------------------------------------------------- contract

    def set_exit_callback(self, callback: ExitCallback) -> None:
        self.channels.on_exit = callback

    def channel(self, rec: SandboxRecord) -> Any:
        return self.channels.channel(rec.sandbox_id)

    def validate(self, spec: SandboxSpec) -> None:
        image = self.images.get(spec.image)
        self.shape_of(spec, image)
        if spec.toolkits:
            raise InvalidArgument(
                "toolkits are layers: a full VM boots a complete image and takes none",
                reason="INVALID_ARGUMENT",
                metadata={"field": "toolkits"},
            )
        self._policy(spec.network)

    def _policy(self, raw: Mapping[str, Any] | None) -> tuple[Policy, dict[str, list[str]]]:
        return guests.check_policy(self.network, raw)

    def shape_of(self, spec: SandboxSpec, image: VmImage) -> Shape:
        vcpus, mem = guests.vcpus_and_memory(
            spec,
            min_mb=self.min_memory_mb,
            max_mb=self.max_memory_mb,
            max_vcpus=self.max_vcpus,
            what="a VM's RAM",
        )
        least = max(MIN_DISK_MB, image.root_mb + 512)
        disk = spec.disk_mb or max(least, 8192)
        if disk < least:
            raise InvalidArgument(
                f"resources.disk_mb={spec.disk_mb}: image {image.name!r} needs at least "
                f"{least} MB (its root filesystem is {image.root_mb} MB)",
                reason="INVALID_RESOURCES",
                metadata={"field": "resources.disk_mb"},
            )
        return Shape(vcpus, mem, disk)

    # ------------------------------------------------------------- create

    async def start(self, rec: SandboxRecord) -> None:
        t0 = time.perf_counter()
        image = await asyncio.to_thread(self.images.get, rec.spec.image)
        shape = self.shape_of(rec.spec, image)
        sid = rec.sandbox_id
        disk = self.disks / f"{sid}.qcow2"
        rec.runtime = {
            "domain": self._domain(sid),
            "image": image.name,
            "display": image.display,
            "shape": asdict(shape),
            "accel": self.accel,
        }
        self._watch()
        try:
            await asyncio.to_thread(guest_net.create_root_tap, veth_name(sid))
            async with self._starting:
                if self.use_templates:
                    await self._restore_clone(rec, shape, image, disk)
                else:
                    await self._cold_boot(rec, shape, image, disk)
            self.running[sid] = Running(self._console(sid), rec)
            t1 = time.perf_counter()
            conn = await self.channels.connect(sid)
            t2 = time.perf_counter()
            if self.network is not None:
                await self._attach_network(rec)
            await conn.claim(
                self._env(rec, image),
                guest=guest_channel.identity(rec),
                timeout_s=self.ready_timeout_s,
            )
        except BaseException:
            await self.destroy(rec)
            raise
        log.info(
            "VM %s started in %.1f ms (%s)",
            sid,
            (time.perf_counter() - t0) * 1000,
            rec.runtime.get("from", ""),
            extra={
                "sandbox_id": sid,
                "domain_ms": round((t1 - t0) * 1000, 1),
                "hello_ms": round((t2 - t1) * 1000, 1),
            },
        )

    def _env(self, rec: SandboxRecord, image: VmImage) -> dict[str, str]:
        from edge.images import ResolvedImage

        env = {"DISPLAY": ":0"} if image.display else {}
        resolved = ResolvedImage(name=image.name, lowers=[], env=env, workdir="/root")
        return guest_channel.sandbox_env(rec, resolved)

    async def _cold_boot(
        self, rec: SandboxRecord, shape: Shape, image: VmImage, disk: Path
    ) -> None:
        sid = rec.sandbox_id
        await asyncio.to_thread(host.overlay, disk, image.disk, shape.disk_mb)
        xml = dom_xml.domain_xml(self._spec(sid, rec.spec, shape, image, disk))

        limit_mb = shape.memory_mb + self.overhead_mb

        def boot(c: libvirt.virConnect) -> None:
            d = c.defineXML(xml)
            d.create()
            host.limit_memory(d, limit_mb)

        await self.libvirt.call(boot)
        rec.runtime["from"] = "boot"

    async def _restore_clone(
        self, rec: SandboxRecord, shape: Shape, image: VmImage, disk: Path
    ) -> None:
        sid = rec.sandbox_id
        key = self._template_key(image, shape)
        tmpl = await self.templates.get(key, lambda d: self._build_template(d, image, shape))
        await asyncio.to_thread(host.overlay, disk, tmpl.disk, None)
        spec = self._spec(sid, rec.spec, shape, image, disk)
        lock = self._template_locks.setdefault(key, asyncio.Lock())
        async with lock:
            fd = await asyncio.to_thread(self.templates.lock, key)
            try:
                saved, cookie = await asyncio.to_thread(dom_xml.read_saved_xml, tmpl.state)
                xml = dom_xml.clone_xml(saved, spec)
                await asyncio.to_thread(dom_xml.write_saved_xml, tmpl.state, xml, cookie)

                def restore(c: libvirt.virConnect) -> None:
                    c.restore(str(tmpl.state))
                    d = c.lookupByName(spec.name)
                    c.defineXML(d.XMLDesc(libvirt.VIR_DOMAIN_XML_SECURE))  # persistent
                    host.limit_memory(d, spec.memory_limit_mb)

                await self.libvirt.call(restore)
            finally:
                os.close(fd)
        rec.runtime["from"] = "template " + key

    def _template_key(self, image: VmImage, shape: Shape) -> str:
        """What a template and its clones share: the image (rebuilt: a new key), the
        accelerator, the shape and the toolkit's bytes (reproducible: the same on every edge
        of the node, so every edge's clones can restore one edge's template)."""
        h = hashlib.sha256(
            json.dumps(
                [VmTemplates.FORMAT, image.name, image.digest(), self.accel, asdict(shape),
                 self._toolkit_digest()]
            ).encode()
        )  # fmt: skip
        return h.hexdigest()[:20]

    def _toolkit_digest(self) -> str:
        st = self.toolkit_image.stat()
        stamp = (str(self.toolkit_image), st.st_size, st.st_mtime_ns)
        if self._toolkit_stamp != stamp:
            h = hashlib.sha256()
            with open(self.toolkit_image, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            self._toolkit_stamp, self._toolkit_sha = stamp, h.hexdigest()
        return self._toolkit_sha

    async def _build_template(self, d: Path, image: VmImage, shape: Shape) -> None:
        """Boot a guest of `image` and `shape` in `d` until its aether answers (and, for a
        desktop image, its desktop is up), then save it: `d/state.save` and `d/disk.qcow2`."""
        tid = "tmpl-" + d.name.split(".")[1][-12:]
        disk = d / "disk.qcow2"
        await asyncio.to_thread(host.overlay, disk, image.disk, shape.disk_mb)
        spec = self._spec(tid, None, shape, image, disk)
        await asyncio.to_thread(guest_net.create_root_tap, spec.tap)
        console = None
        conn: AetherConnection | None = None
        try:

            def boot(c: libvirt.virConnect) -> None:
                c.createXML(dom_xml.domain_xml(spec), 0)

            await self.libvirt.call(boot)
            console = self._console(tid)
            conn = self.channels.new_connection(tid)
            await conn.connect(timeout_s=self.ready_timeout_s)
            if image.display:
                t0 = time.monotonic()
                await host.wait_for(console, DESKTOP_READY, self.ready_timeout_s)
                left = self.ready_timeout_s - (time.monotonic() - t0)
                waited = await screen.wait_painted(self.libvirt, spec.name, left)
                log.info("template %s: the desktop was drawn %.1f s after it was up", tid, waited)

            def save(c: libvirt.virConnect) -> None:
                c.lookupByName(spec.name).save(str(d / "state.save"))

            await self.libvirt.call(save)
        except BaseException:
            if console is not None:
                await console.drained(0.5)
                console.write(self.logs / f"{tid}.console")
            raise
        finally:
            if conn is not None:
                await conn.close()
            if console is not None:
                await console.close()

            def gone(c: libvirt.virConnect) -> None:
                dom = lookup(c, spec.name)
                if dom is not None and dom.isActive():
                    dom.destroy()

            with contextlib.suppress(Exception):
                await self.libvirt.call(gone)
            await asyncio.to_thread(guest_net.remove_root_tap, spec.tap)
            self._unlink_sockets(tid)

    async def _attach_network(self, rec: SandboxRecord) -> None:
        assert self.network is not None
        policy, resolved = await asyncio.to_thread(self._policy, rec.spec.network)
        if policy.networked:
            rec.runtime["net"] = await self.network.attach_guest(
                rec.sandbox_id, None, policy, resolved
            )

    async def update_network_policy(self, rec: SandboxRecord, policy: dict[str, Any]) -> None:
        await guests.update_policy(
            self.network,
            self.channels,
            rec,
            policy,
            netns_dir=None,
            lock=self._lock(rec.sandbox_id),
        )

    def _console(self, vm_id: str) -> Console:
        c = Console(str(self.sockets / f"{vm_id}.console"))
        c.start()
        return c

    def _watch(self) -> None:
        if not self._watching:
            self._watching = True
            self.libvirt.watch(self._on_event)

    def _on_event(self, name: str, event: int, detail: int) -> None:
        sid = dom_xml.sandbox_of(name, self.tag)
        run = self.running.get(sid or "")
        if run is None:
            return
        if event == libvirt.VIR_DOMAIN_EVENT_STOPPED:
            run.stopped = STOPPED_DETAIL.get(detail, f"stopped ({detail})")
        elif event == libvirt.VIR_DOMAIN_EVENT_CRASHED:
            run.panicked = True

    # ------------------------------------------------------------- ending

    async def _state(self, sid: str) -> tuple[int, int] | None:
        """libvirt's (state, reason) of the sandbox's domain; None if there is none."""

        def state(c: libvirt.virConnect) -> tuple[int, int] | None:
            d = lookup(c, self._domain(sid))
            if d is None:
                return None
            s, r = d.state()
            return int(s), int(r)

        return await self.libvirt.call(state)

    async def still_running(self, sandbox_id: str) -> bool:
        try:
            st = await self._state(sandbox_id)
        except Unavailable:
            return True  # libvirtd is away; QEMU runs on without it
        return st is not None and st[0] in (libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_PAUSED)

    async def why_ended(self, sandbox_id: str, channel_reason: str) -> tuple[str, str]:
        run = self.running.get(sandbox_id)
        if run is not None:
            await run.console.drained()
            told = run.console.diagnose()
            if told is not None:
                return told
            if run.console.oom_kills:
                return "OOM", (
                    f"the guest kernel killed {run.console.oom_kills} process(es) for memory, "
                    "aether among them"
                )
        try:
            st = await self._state(sandbox_id)
        except Unavailable as exc:
            return "RUNTIME_ERROR", f"libvirtd is unreachable: {exc.message}"
        if st is None:
            return "RUNTIME_ERROR", "the VM's libvirt domain is gone (undefined outside the edge)"
        if (run is not None and run.panicked) or st[0] == libvirt.VIR_DOMAIN_CRASHED:
            return "KERNEL_FAULT", "the guest kernel panicked (pvpanic: libvirt reports a crash)"
        if st[0] in (libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_PAUSED):
            return "CHANNEL_CLOSED", f"the guest's agent channel closed: {channel_reason}"
        stopped = run.stopped if run is not None else ""
        if stopped == "shut down" or st[1] == libvirt.VIR_DOMAIN_SHUTOFF_SHUTDOWN:
            return "CHANNEL_CLOSED", "the guest powered itself off"
        if stopped == "destroyed" or st[1] == libvirt.VIR_DOMAIN_SHUTOFF_DESTROYED:
            return "RUNTIME_ERROR", "the VM was destroyed outside the edge (its QEMU is gone)"
        return "RUNTIME_ERROR", f"the VM's QEMU ended: {stopped or f'libvirt state {st}'}"

    async def stop(self, rec: SandboxRecord, grace_s: float) -> None:
        sid = rec.sandbox_id
        async with self._lock(sid):
            if sid in self.channels:
                await self.channels.drop(sid, shutdown_grace_s=grace_s)
            deadline = time.monotonic() + grace_s + 5.0
            while time.monotonic() < deadline:  # aether's shutdown powers the guest off
                with contextlib.suppress(Unavailable):
                    if not await self.still_running(sid):
                        return
                await asyncio.sleep(0.2)

    async def destroy(self, rec: SandboxRecord) -> None:
        await self._teardown(rec.sandbox_id)

    async def _teardown(self, sid: str) -> None:
        """Everything of VM `sid`: its channel, domain (and managed save), console, network,
        tap, disk and sockets. Writes nothing but the console's log."""
        await self.channels.drop(sid)
        run = self.running.pop(sid, None)
        name = self._domain(sid)

        def remove(c: libvirt.virConnect) -> None:
            d = lookup(c, name)
            if d is None:
                return
            if d.isActive():
                with contextlib.suppress(libvirt.libvirtError):
                    d.destroy()
            if d.isPersistent():
                d.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE)

        try:
            await self.libvirt.call(remove)
        except Unavailable as exc:
            log.warning("VM %s: %s; its domain stays until libvirtd is back", sid, exc.message)
        if run is not None:
            await run.console.drained(0.5)
            await run.console.close()
            run.console.write(self.logs / f"{sid}.console")
        if self.network is not None:
            await self.network.detach_guest(sid, None)
        await asyncio.to_thread(guest_net.remove_root_tap, veth_name(sid))
        await asyncio.to_thread(self._remove_files, sid)
        self._locks.pop(sid, None)

    def _remove_files(self, sid: str) -> None:
        if not sid or "/" in sid or sid.startswith("."):
            raise ValueError(f"not a VM id: {sid!r}")
        (self.disks / f"{sid}.qcow2").unlink(missing_ok=True)
        self._unlink_sockets(sid)

    def _unlink_sockets(self, vm_id: str) -> None:
        for kind in ("agent", "console", "vnc"):
            (self.sockets / f"{vm_id}.{kind}").unlink(missing_ok=True)

    # ------------------------------------------------------------- pause

    def _lock(self, sid: str) -> asyncio.Lock:
        return self._locks.setdefault(sid, asyncio.Lock())

    async def pause(self, rec: SandboxRecord) -> PauseOutcome:
        """libvirt's managed save: the guest's memory to local disk, QEMU gone."""
        sid = rec.sandbox_id
        async with self._lock(sid):
            before = await self.memory_usage(rec) or MemoryUsage(0, 0)
            if rec.runtime.get("paused"):
                return PauseOutcome(before, before, 0.0)
            t0 = time.perf_counter()
            await self.channels.drop(sid)
            run = self.running.pop(sid, None)

            def save(c: libvirt.virConnect) -> None:
                d = c.lookupByName(self._domain(sid))
                # The save keeps the live XML, and a restore launched with a hard limit in it
                # fails here (see _limit_memory): lifted for the save, set again at resume.
                host.limit_memory(d, None)
                d.managedSave(0)

            try:
                await self.libvirt.call(save)
            except BaseException:
                if run is not None:
                    self.running[sid] = run
                with contextlib.suppress(Exception):
                    await self.channels.connect(sid)
                raise
            if run is not None:
                await run.console.close()
            rec.runtime["paused"] = True
            took = time.perf_counter() - t0
            after = await self.memory_usage(rec) or MemoryUsage(0, 0)
            log.info(
                "VM %s paused (managed save) in %.1f ms (%d MB)",
                sid,
                took * 1000,
                after.swapped_bytes >> 20,
                extra={"sandbox_id": sid},
            )
            return PauseOutcome(before, after, took)

    async def memory_usage(self, rec: SandboxRecord) -> MemoryUsage | None:
        """Running: QEMU's resident memory (libvirt's rss). Paused: nothing resident; the
        managed save on local disk."""
        name = self._domain(rec.sandbox_id)
        if rec.runtime.get("paused"):
            with contextlib.suppress(OSError):
                return MemoryUsage(0, (MANAGED_SAVE_DIR / f"{name}.save").stat().st_size)
            return MemoryUsage(0, 0)

        def rss(c: libvirt.virConnect) -> int | None:
            d = lookup(c, name)
            if d is None or not d.isActive():
                return None
            return int(d.memoryStats().get("rss", 0)) * 1024

        try:
            got = await self.libvirt.call(rss)
        except (Unavailable, FailedPrecondition):
            return None
        return None if got is None else MemoryUsage(got, 0)

    async def resume(self, rec: SandboxRecord) -> None:
        """Restore the guest from its managed save (libvirt's create does)."""
        sid = rec.sandbox_id
        async with self._lock(sid):
            if not rec.runtime.get("paused"):
                return
            t0 = time.perf_counter()
            limit_mb = int(rec.runtime["shape"]["memory_mb"]) + self.overhead_mb

            def restore(c: libvirt.virConnect) -> None:
                d = lookup(c, self._domain(sid))
                if d is None:
                    raise ResumeFailed("the VM's libvirt domain is gone")
                # libvirt remembers it saved; without the file its create would boot afresh
                save = MANAGED_SAVE_DIR / f"{d.name()}.save"
                if not d.hasManagedSaveImage(0) or not save.is_file():
                    raise ResumeFailed(f"the VM's managed save {save} is gone")
                d.create()
                host.limit_memory(d, limit_mb)

            try:
                async with self._starting:
                    await self.libvirt.call(restore)
                self.running[sid] = Running(self._console(sid), rec)
                conn = await self.channels.connect(sid)
                await conn.sync_guest(
                    guest_channel.sync(rec, bool(rec.runtime.pop("net_pending", 0)))
                )
            except ResumeFailed:
                raise
            except FailedPrecondition as exc:  # libvirt refused (libvirt_conn.call)
                raise ResumeFailed(f"the guest could not be restored: {exc.message}") from exc
            rec.runtime["paused"] = False
            log.info(
                "VM %s resumed in %.1f ms",
                sid,
                (time.perf_counter() - t0) * 1000,
                extra={"sandbox_id": sid},
            )

    # ------------------------------------------------------------- restart

    async def adopt(self, rec: SandboxRecord) -> bool:
        sid = rec.sandbox_id
        self._adopted.add(sid)
        self._watch()
        try:
            st = await self._state(sid)
        except Unavailable as exc:
            log.warning("cannot take VM %s back: %s", sid, exc.message)
            return False
        if st is None:
            return False
        if not await guests.adopt_network(self.network, rec):
            return False
        if rec.runtime.get("paused"):

            def saved(c: libvirt.virConnect) -> bool:
                d = lookup(c, self._domain(sid))
                return d is not None and bool(d.hasManagedSaveImage(0))

            return await self.libvirt.call(saved)
        if st[0] != libvirt.VIR_DOMAIN_RUNNING:
            return False
        self.running[sid] = Running(self._console(sid), rec)
        try:
            await self.channels.connect(sid, timeout_s=15.0)
        except Unavailable as exc:
            log.warning("cannot take VM %s back: %s", sid, exc)
            run = self.running.pop(sid)
            await run.console.close()
            return False
        return True

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        """This edge's domains (and their disks, sockets, taps) no record keeps."""
        keep = keep | self._adopted

        def ours(c: libvirt.virConnect) -> list[str]:
            out = []
            for d in c.listAllDomains(0):
                sid = dom_xml.sandbox_of(d.name(), self.tag)
                if sid is not None and sid not in keep:
                    out.append(sid)
            return out

        try:
            orphans = await self.libvirt.call(ours)
        except Unavailable:
            orphans = []
        files = {p.name.rsplit(".", 1)[0] for p in self.disks.iterdir() if "." in p.name}
        files |= {p.name.rsplit(".", 1)[0] for p in self.sockets.iterdir() if "." in p.name}
        removed = sorted(set(orphans) | {f for f in files if f not in keep and f})
        for sid in removed:
            await self._teardown(sid)
        return removed

    def background_loops(self) -> Sequence[BackgroundLoop]:
        return [self.watch_loop]

    async def watch_loop(self) -> None:
        """Per running VM, every second: its accounting (guest_console.account)."""
        while True:
            await asyncio.sleep(1.0)
            for run in list(self.running.values()):
                if run.rec is not None:
                    disk_mb = int(run.rec.runtime["shape"]["disk_mb"])
                    await account(run.console, run.rec, self.channels, self.network, disk_mb)

    async def close(self) -> None:
        """The edge goes; the VMs stay (taken back by the next edge)."""
        await self.channels.close_all()
        for run in self.running.values():
            await run.console.close()
        self.running.clear()
        self.libvirt.close()
        with contextlib.suppress(OSError):  # gone only when no VM of this edge is left
            self.sockets.rmdir()

    # ------------------------------------------------------------- display

    def _require_display(self, rec: SandboxRecord) -> None:
        if not rec.runtime.get("display"):
            raise BackendCapabilityMissing(
                f"sandbox {rec.sandbox_id}'s image {rec.runtime.get('image')!r} has no display "
                "(the desktop image has one)",
                metadata={"backend": self.name, "capability": Capability.DISPLAY.value},
            )

    async def display_size(self, rec: SandboxRecord) -> tuple[int, int]:
        self._require_display(rec)
        _, w, h = await screen.screenshot(self.libvirt, self._domain(rec.sandbox_id))
        return w, h

    async def screenshot(self, rec: SandboxRecord) -> tuple[bytes, int, int]:
        self._require_display(rec)
        return await screen.screenshot(self.libvirt, self._domain(rec.sandbox_id))

    async def send_input(self, rec: SandboxRecord, actions: Sequence[Any]) -> int:
        size = await self.display_size(rec)
        return await screen.send_input(self.libvirt, self._domain(rec.sandbox_id), actions, size)

    async def open_vnc(self, rec: SandboxRecord) -> tuple[Any, Any]:
        self._require_display(rec)
        return await screen.open_vnc(self.sockets / f"{rec.sandbox_id}.vnc")

    # ------------------------------------------------------------- disk usage

    def disk_paths(self) -> list[Path]:
        return [self.disks, self.templates.root]

    def disk_allocations(self) -> Allocations:
        out: Allocations = {}
        for sid in list(self.running):
            with contextlib.suppress(OSError):
                st = (self.disks / f"{sid}.qcow2").stat()
                out[sid] = (st.st_dev, st.st_blocks * 512)
        return out


# ----------------------------------------------------------------- helpers


def _control(state: str, detail: str) -> Control:
    return Control("vm", state, detail, status_line=True)
