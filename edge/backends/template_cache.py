"""A node-wide cache of saved, booted guests ("templates"), shared by the VM backends.

A template is a directory named by its key (a hash of everything that must match between the
template and the guests made from it: the guest's kernel and image, the accelerator, the
shape, the toolkit). What is in it is the backend's (a microVM's RAM file and device state, a
full VM's libvirt save file and frozen disk); this module only keeps the directories:

    <root>/<key>/ready   written last: a directory without it is an interrupted build

Builds are single-flight per key within an edge and serialized across the node's edges by a
lock file; the least recently used templates beyond `max_templates` are removed (a running
guest keeps what it maps or holds open; a paused one saved all of its state).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedTemplate:
    key: str
    dir: Path


T = TypeVar("T", bound=CachedTemplate)


class TemplateCache(Generic[T]):
    #: Written into every template's `ready` file; a backend's own class sets its own.
    FORMAT = "dsec-template/1"

    def __init__(
        self,
        root: Path,
        make: Callable[[str, Path], T],
        *,
        max_templates: int = 8,
        label: str = "guest",
        first_use: Callable[[T], None] | None = None,
    ) -> None:
        self.root = root
        self.make = make
        self.max_templates = max(1, max_templates)
        self.label = label
        #: Called once per template and edge when it is first used (e.g. a read-ahead).
        self.first_use = first_use
        root.mkdir(parents=True, exist_ok=True)
        self._building: dict[str, asyncio.Future[T]] = {}
        self._used: set[str] = set()
        self.built = 0  # by this edge (tests and the benches read it)

    def ready(self, key: str) -> T | None:
        t = self.make(key, self.root / key)
        if (t.dir / "ready").exists():
            with contextlib.suppress(OSError):
                os.utime(t.dir / "ready")  # recently used
                if key not in self._used and self.first_use is not None:
                    self._used.add(key)
                    self.first_use(t)
            return t
        return None

    async def get(self, key: str, build: Callable[[Path], Awaitable[None]]) -> T:
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

    async def _build(self, key: str, build: Callable[[Path], Awaitable[None]]) -> T:
        lock = await asyncio.to_thread(self.lock, key)
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
            log.info("%s template %s built in %.2f s", self.label, key, time.perf_counter() - t0)
            await asyncio.to_thread(self._evict, keep=key)
            return self.make(key, final)
        finally:
            os.close(lock)

    def lock_path(self, key: str) -> Path:
        return self.root / f".{key}.lock"

    def lock(self, key: str) -> int:
        """The node-wide lock of template `key` (blocking until held): its descriptor; close
        it to unlock. Builds hold it; so does whatever else must not race them."""
        fd = os.open(self.lock_path(key), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _evict(self, keep: str) -> None:
        ready = sorted(
            (p.stat().st_mtime, p.parent)
            for p in self.root.glob("*/ready")
            if p.parent.name != keep
        )
        for _, d in ready[: max(0, len(ready) + 1 - self.max_templates)]:
            log.info("removing %s template %s (least recently used)", self.label, d.name)
            shutil.rmtree(d, ignore_errors=True)
            self.lock_path(d.name).unlink(missing_ok=True)
