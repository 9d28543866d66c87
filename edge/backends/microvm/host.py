"""The host side of the edge's microVMs: their sockets (agent port, QMP, console: the edge
listens, QEMU is handed the listening fds), the QEMU processes themselves, and their cgroups.
Everything here is named by vm id; what a sandbox is lives in backend.py."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import subprocess
from pathlib import Path

from edge.backends import qos
from edge.backends.guest_console import Console
from edge.backends.microvm import qemu
from edge.backends.microvm.guest import GuestKit
from edge.backends.microvm.vm import SCHED_IDLE, Shape, cpu_quota_us
from edge.model import SandboxSpec
from edge.network import guest as guest_net
from edge.network.manager import NetworkManager
from edge.runtime import cgroups, mounts


class QemuHost:
    def __init__(
        self,
        state_dir: Path,
        *,
        kit: GuestKit,
        accel: str,
        append: str,
        qemu_binary: str,
        cgroup_parent: str,
        overhead_mb: int,
        network: NetworkManager | None,
    ) -> None:
        self.sockets = state_dir / "sockets"
        self.logs = state_dir / "logs"
        #: Every guest's network namespace (its tap; a veth onto the node bridge when networked).
        self.netns_dir = state_dir / "netns"
        for d in (self.sockets, self.logs, self.netns_dir):
            d.mkdir(parents=True, exist_ok=True)
        mounts.mount_volatile(self.sockets, "16m")
        self._sockets_fd = os.open(self.sockets, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.kit = kit
        self.accel = accel
        self.append = append
        self.qemu_binary = qemu_binary
        self.cgroup_parent = cgroup_parent
        self.overhead_mb = overhead_mb
        self.network = network
        #: In every QEMU's -name: whose it is (orphan cleanup kills only this edge's guests).
        self.tag = hashlib.sha256(os.fsencode(state_dir.resolve())).hexdigest()[:10]

    async def spawn(
        self,
        vm_id: str,
        shape: Shape,
        disks: list[qemu.Disk],
        memory: qemu.Memory,
        mac: str,
        *,
        incoming: bool = False,
        tap_fd: int | None = None,
        best_effort: bool = False,
        paused: bool = False,
        balloon: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Start QEMU with the edge's listening sockets for its agent port, QMP and console
        (and the guest's tap: the edge's copies are closed once QEMU has them). A best-effort
        guest's QEMU is SCHED_IDLE from before its exec: every thread it starts inherits it.
        `paused` (-S): the guest never runs unless told to, also after loading a state saved
        while it ran (a fork's helper). `balloon`: the free-page-reporting device (as the
        guest first booted: see qemu.py)."""
        listeners = [self.listen(vm_id, kind) for kind in ("agent", "qmp", "console")]
        try:
            machine = qemu.Machine(
                vcpus=shape.vcpus,
                memory_mb=shape.memory_mb,
                kernel=self.kit.kernel,
                initrd=self.kit.initrd,
                append=self.append,
                disks=disks,
                memory=memory,
                agent_fd=listeners[0].fileno(),
                qmp_fd=listeners[1].fileno(),
                console_fd=listeners[2].fileno(),
                mac=mac,
                accel=self.accel,
                incoming=incoming,
                tap_fd=tap_fd,
                balloon=balloon,
                extra=["-name", f"dsec:{self.tag}:{vm_id}", *(["-S"] if paused else [])],
            )
            with open(self.logs / f"{vm_id}.qemu", "ab") as err:
                return await asyncio.to_thread(
                    subprocess.Popen,
                    [*(SCHED_IDLE if best_effort else []), *machine.argv(self.qemu_binary)],
                    pass_fds=machine.fds(),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,
                )
        finally:
            for s in listeners:
                s.close()
            if tap_fd is not None:
                os.close(tap_fd)

    def console(self, vm_id: str) -> Console:
        c = Console(self.address(vm_id, "console"))
        c.start()
        return c

    def confine(self, sid: str, pid: int, spec: SandboxSpec, shape: Shape) -> None:
        """QEMU into the sandbox's cgroups: cpu quota, guest RAM + overhead, pids; a best-effort
        guest's cpu cgroup is idle (see edge/backends/qos.py)."""
        path = self.cgroup(sid)
        for controller in ("cpu", "memory", "pids"):
            d = cgroups.controller_dir(controller, path)
            if d is None:
                raise FileNotFoundError(f"no cgroup v1 {controller} hierarchy")
            d.mkdir(parents=True, exist_ok=True)
        memory = (shape.memory_mb + self.overhead_mb) << 20
        # A resume's cgroup is the paused guest's: an idle one refuses cpu.shares (qos.py).
        qos.set_cgroup_idle(cgroups.controller_dir("cpu", path), False)
        cgroups.set_limits(
            path,
            cpu_quota_us=cpu_quota_us(spec),
            cpu_shares=max(2, spec.cpu_millis * 1024 // 1000),
            memory_bytes=memory,
            pids_max=256 + 2 * shape.vcpus,  # QEMU's own threads (I/O workers, vCPUs)
        )
        qos.set_cgroup_idle(cgroups.controller_dir("cpu", path), spec.qos == "BEST_EFFORT")
        for controller in ("cpu", "memory", "pids"):
            d = cgroups.controller_dir(controller, path)
            assert d is not None
            (d / "cgroup.procs").write_text(str(pid))

    def cgroup(self, sid: str) -> str:
        return f"{self.cgroup_parent}/{sid}"

    # ------------------------------------------------------------- sockets

    def name(self, vm_id: str, kind: str) -> str:
        return f"{vm_id}.{kind}"

    def address(self, vm_id: str, kind: str) -> str:
        return f"/proc/self/fd/{self._sockets_fd}/{self.name(vm_id, kind)}"

    def address_of_agent(self, vm_id: str) -> str:
        return self.address(vm_id, "agent")

    def listen(self, vm_id: str, kind: str) -> socket.socket:
        path = self.sockets / self.name(vm_id, kind)
        path.unlink(missing_ok=True)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.address(vm_id, kind))
        os.chmod(path, 0o600)
        s.listen(4)
        return s

    def unlink_sockets(self, vm_id: str) -> None:
        for kind in ("agent", "qmp", "console"):
            (self.sockets / self.name(vm_id, kind)).unlink(missing_ok=True)

    def qemu_error(self, vm_id: str) -> str:
        with contextlib.suppress(OSError):
            text = (self.logs / f"{vm_id}.qemu").read_text(errors="replace").strip()
            lines = [ln for ln in text.splitlines() if "warning: hub" not in ln]
            if lines:
                return ": " + lines[-1][-300:]
        return ""

    def rename(self, old: str, new: str) -> None:
        """Every host-side name of guest `old` becomes `new`'s, or none does (rolled back)."""
        pairs = [
            *((self.sockets / self.name(old, k), self.sockets / self.name(new, k))
              for k in ("agent", "qmp", "console")),
        ]  # fmt: skip
        done: list[tuple[Path, Path]] = []
        try:
            for a, b in pairs:
                if b.exists():
                    raise FileExistsError(f"{b} exists")
                os.rename(a, b)
                done.append((a, b))
            cgroups.rename(self.cgroup(old), self.cgroup(new))  # v1 only: no cgroup2 dir
            if self.network is not None:
                guest_net.move_netns(self.netns_dir, old, new)
            os.replace(self.logs / f"{old}.qemu", self.logs / f"{new}.qemu")
        except OSError:
            for a, b in reversed(done):
                with contextlib.suppress(OSError):
                    os.rename(b, a)
            with contextlib.suppress(OSError):
                cgroups.rename(self.cgroup(new), self.cgroup(old))
            raise

    def set_cpu(self, sid: str, spec: SandboxSpec) -> None:
        """A claimed warm guest's cpu quota: the request's (its shape, vCPUs, is the pool's)."""
        d = cgroups.controller_dir("cpu", self.cgroup(sid))
        if d is None:
            raise FileNotFoundError("no cgroup v1 cpu hierarchy")
        (d / "cpu.cfs_quota_us").write_text(str(cpu_quota_us(spec)))
        (d / "cpu.shares").write_text(str(max(2, spec.cpu_millis * 1024 // 1000)))
        qos.set_cgroup_idle(d, spec.qos == "BEST_EFFORT")
