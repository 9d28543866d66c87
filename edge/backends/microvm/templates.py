"""Template snapshots: one booted guest per shape, saved once, restored by every create.

A template is a directory of the node-wide cache, named by its key (a hash of the guest kit,
the accelerator, the optional devices, the shape -- vCPUs, RAM, disk size -- and the toolkit
and layer files):

    ram      the guest's memory: a memory-backend-file (share=on while the template ran);
             clones map it with share=off, copy-on-write: the file never changes again
    vmstate  the devices' state (saved with x-ignore-shared: no RAM in it), ~60 KB
    rw.img   the writable disk as the guest left it; every clone starts from a sparse copy
    ready    written last: a directory without it is an interrupted build

A changed image, toolkit or kernel changes the key, so a stale template is never restored; the
least recently used templates beyond `max_templates` are removed (a running clone keeps its
mapping of a removed RAM file; a paused one saved all of its memory). Builds are single-flight
per key within an edge and serialized across the node's edges by a lock file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from edge.backends.channels import ChannelKeeper
from edge.backends.microvm import qemu
from edge.backends.microvm.host import QemuHost
from edge.backends.microvm.vm import Shape, mac_of
from edge.backends.template_cache import CachedTemplate, TemplateCache
from edge.runtime.disk import blank_image

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Template(CachedTemplate):
    @property
    def ram(self) -> Path:
        return self.dir / "ram"

    @property
    def vmstate(self) -> Path:
        return self.dir / "vmstate"

    @property
    def rw(self) -> Path:
        return self.dir / "rw.img"


def _read_ahead(t: Template) -> None:
    """A template's RAM file into the page cache, charged to the edge: a clone's first write
    to a page would otherwise read it in charged to that clone's memory cgroup (and leave it
    there after the clone's pause: measured, 11% of a paused 256 MB clone's charge)."""
    fd = os.open(t.ram, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


class Templates(TemplateCache[Template]):
    FORMAT = "dsec-microvm-template/2"

    def __init__(self, root: Path, max_templates: int = 8) -> None:
        super().__init__(
            root, Template, max_templates=max_templates, label="microVM", first_use=_read_ahead
        )


def template_key(
    kit_digest: str, accel: str, shape: Shape, disks: list[qemu.Disk], *, balloon: bool = False
) -> str:
    """The key of the template of `shape` over `disks` (the toolkit first, then the image's
    layers): a changed file, kernel, accelerator or device list is a new key (a clone's
    devices must be its template's)."""
    devices = ["balloon"] if balloon else []
    h = hashlib.sha256(json.dumps([Templates.FORMAT, kit_digest, accel, *devices]).encode())
    h.update(json.dumps(shape.__dict__).encode())
    for d in disks:
        st = d.path.stat()
        h.update(f"{d.serial}\0{d.path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:20]


async def build_template(
    d: Path,
    shape: Shape,
    disks: list[qemu.Disk],
    *,
    host: QemuHost,
    channels: ChannelKeeper,
    blank_dir: Path,
    ready_timeout_s: float,
    balloon: bool = False,
) -> None:
    """Boot a guest to "aether ready" in `d` and save it with x-ignore-shared: `d/ram` is
    its memory, `d/vmstate` its devices, `d/rw.img` its writable disk at that moment. `disks`
    are the guest's read-only ones (toolkit, layers)."""
    tid = "tmpl-" + d.name[-12:]
    rw = d / "rw.img"
    await asyncio.to_thread(blank_image, rw, shape.disk_mb, blank_dir)
    proc = await host.spawn(
        tid,
        shape,
        [qemu.Disk("rw", rw, False), *disks],
        qemu.Memory("file", d / "ram", share=True),
        mac_of(tid),
        balloon=balloon,
    )
    q = qemu.Qmp(host.address(tid, "qmp"))
    try:
        await q.connect()
        conn = channels.new_connection(tid)
        await conn.connect(timeout_s=ready_timeout_s)
        # Saved while the edge is connected: a clone's aether wakes up holding an open
        # channel device and answers the first Ping at once (closing first left it
        # waiting to reopen the port, ~0.2 s more per create).
        await qemu.save(q, d / "vmstate", ignore_shared=True)
        await q.execute("quit")
        await conn.close()
    finally:
        await q.close()
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.to_thread(proc.wait)
        host.unlink_sockets(tid)
