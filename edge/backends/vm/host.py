"""The full-VM backend's host-side chores: disks (qcow2 overlays), the memory limit of a
running domain, waiting for the guest's console to say something."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import libvirt

from edge.backends.guest_console import Console
from libdsec.errors import FailedPrecondition, Unavailable

#: libvirt's VIR_DOMAIN_MEMORY_PARAM_UNLIMITED (a C macro libvirt-python does not export).
MEMORY_UNLIMITED_KIB = 9007199254740991


def limit_memory(d: libvirt.virDomain, limit_mb: int | None) -> None:
    """The running QEMU's memory cgroup limit: guest RAM + QEMU's overhead. Set live, after
    the start: libvirt would also raise the process's locked-memory limit to a hard limit
    given in the XML at launch, which this host does not permit. A limit that cannot be set
    fails the start (the caller removes the VM): controls fail closed."""
    kib = MEMORY_UNLIMITED_KIB if limit_mb is None else limit_mb * 1024
    try:
        d.setMemoryParameters(
            {libvirt.VIR_DOMAIN_MEMORY_HARD_LIMIT: kib}, libvirt.VIR_DOMAIN_AFFECT_LIVE
        )
    except libvirt.libvirtError as exc:
        raise FailedPrecondition(
            f"cannot limit the VM's memory to {limit_mb} MB: {exc.get_error_message()}",
            reason="LIMIT_UNENFORCEABLE",
        ) from exc


def overlay(path: Path, backing: Path, size_mb: int | None) -> None:
    """A qcow2 overlay on `backing` (virtual size `size_mb`, or the backing's)."""
    path.unlink(missing_ok=True)
    argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(backing), "-F", "qcow2", str(path)]
    if size_mb is not None:
        argv.append(f"{size_mb}M")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise FailedPrecondition(
            f"qemu-img create failed: {out.stderr.strip()}", reason="VM_DISK_FAILED"
        )


async def wait_for(console: Console, marker: bytes, timeout_s: float) -> None:
    """Until the guest's console has printed `marker` (UNAVAILABLE GUEST_NOT_READY after
    `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while marker not in console.text():
        if time.monotonic() > deadline:
            raise Unavailable(
                f"the guest did not print {marker.decode()} within {timeout_s:.0f} s",
                reason="GUEST_NOT_READY",
            )
        await asyncio.sleep(0.5)
