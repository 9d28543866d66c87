"""Template snapshots: one booted guest per shape, saved once, restored by every create.

A template is a directory of the node-wide cache, named by its key (a hash of the guest kit,
the accelerator, the shape -- vCPUs, RAM, disk size -- and the toolkit and layer files):

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
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from edge.backends.channels import ChannelKeeper
from edge.backends.microvm import qemu
from edge.backends.microvm.host import QemuHost
from edge.backends.microvm.vm import Shape, mac_of
from edge.runtime.disk import blank_image

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Template:
    key: str
    dir: Path

    @property
    def ram(self) -> Path:
        return self.dir / "ram"

    @property
    def vmstate(self) -> Path:
        return self.dir / "vmstate"

    @property
    def rw(self) -> Path:
        return self.dir / "rw.img"


def _read_ahead(path: Path) -> None:
    """A template's RAM file into the page cache, charged to the edge: a clone's first write
    to a page would otherwise read it in charged to that clone's memory cgroup (and leave it
    there after the clone's pause: measured, 11% of a paused 256 MB clone's charge)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


class Templates:
    FORMAT = "dsec-microvm-template/2"

    def __init__(self, root: Path, max_templates: int = 8) -> None:
        self.root = root
        self.max_templates = max(1, max_templates)
        root.mkdir(parents=True, exist_ok=True)
        self._building: dict[str, asyncio.Future[Template]] = {}
        self.built = 0  # by this edge (tests and the bench read it)
        self._read_ahead: set[str] = set()

    def ready(self, key: str) -> Template | None:
        t = Template(key, self.root / key)
        if (t.dir / "ready").exists():
            with contextlib.suppress(OSError):
                os.utime(t.dir / "ready")  # recently used
                if key not in self._read_ahead:
                    self._read_ahead.add(key)
                    _read_ahead(t.ram)
            return t
        return None

    async def get(self, key: str, build: Callable[[Path], Awaitable[None]]) -> Template:
        """The template of `key`, built by `build(directory)` if there is none yet."""
        t = self.ready(key)
        if t is not None:
            return t
        running = self._building.get(key)
        if running is None:
            running = asyncio.ensure_future(self._build(key, build))
            self._building[key] = running
            running.add_done_callback(lambda _: self._building.pop(key, None))
        return await asyncio.shield(running)

    async def _build(self, key: str, build: Callable[[Path], Awaitable[None]]) -> Template:
        lock = await asyncio.to_thread(self._lock, key)
        try:
            t = self.ready(key)
            if t is not None:
                return t  # another edge of the node built it meanwhile
            work = self.root / f".{key}.{os.getpid()}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            t0 = time.perf_counter()
            try:
                await build(work)
                (work / "ready").write_text(
                    json.dumps({"format": self.FORMAT, "built": time.time()})
                )
                final = self.root / key
                shutil.rmtree(final, ignore_errors=True)
                os.rename(work, final)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
            self.built += 1
            log.info("microVM template %s built in %.2f s", key, time.perf_counter() - t0)
            await asyncio.to_thread(self._evict, keep=key)
            return Template(key, final)
        finally:
            os.close(lock)

    def _lock(self, key: str) -> int:
        fd = os.open(self.root / f".{key}.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _evict(self, keep: str) -> None:
        ready = sorted(
            (p.stat().st_mtime, p.parent)
            for p in self.root.glob("*/ready")
            if p.parent.name != keep
        )
        for _, d in ready[: max(0, len(ready) + 1 - self.max_templates)]:
            log.info("removing microVM template %s (least recently used)", d.name)
            shutil.rmtree(d, ignore_errors=True)
            (self.root / f".{d.name}.lock").unlink(missing_ok=True)


def template_key(kit_digest: str, accel: str, shape: Shape, disks: list[qemu.Disk]) -> str:
    """The key of the template of `shape` over `disks` (the toolkit first, then the image's
    layers): a changed file, kernel or accelerator is a new key."""
    h = hashlib.sha256(json.dumps([Templates.FORMAT, kit_digest, accel]).encode())
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
