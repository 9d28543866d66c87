"""The node's free-space reserve: every filesystem the edge writes keeps `reserve_bytes` free.

Each sandbox's writable layer has a limit of its own (a sparse ext4 image, edge/runtime/disk.py),
but the limits are overcommitted — their sum may exceed the disk — and the edge also writes
records, logs, layer metadata and, later, swap and VM disks. So the guard watches the
filesystems themselves (one statvfs each, every `interval_s`):

- below the reserve, admission refuses creates (RESOURCE_EXHAUSTED, reason NODE_DISK_LOW:
  placement tries another edge);
- and the sandbox writing fastest onto that filesystem is ended (reason DISK_QUOTA), so one
  runaway writer cannot take the node — and every neighbour — down with it.

"Writing fastest" comes from each backend's allocations (bytes its sandboxes hold on each
filesystem, DiskUsage capability) sampled by the guard: the largest growth since the previous
sample. When nothing of ours grew, nothing is ended (the space went to something else; the
refusal of creates still holds). Domain code: no gRPC, blocking calls run in threads by the caller.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: Per sandbox: (st_dev of the filesystem, bytes allocated there).
Allocations = dict[str, tuple[int, int]]
#: Growth between two samples below which a sandbox is not "writing" (its log, a shell
#: history): the fill came from elsewhere, and ending it would not stop it.
MIN_GROWTH_BYTES = 1 << 20


@dataclass(frozen=True)
class Filesystem:
    """One filesystem the edge writes, as of a sample."""

    dev: int
    path: Path  # the first registered path on it (what messages name)
    free_bytes: int
    total_bytes: int

    @property
    def free_mb(self) -> int:
        return self.free_bytes >> 20


class DiskGuard:
    def __init__(self, paths: Iterable[Path], reserve_bytes: int) -> None:
        if reserve_bytes < 0:
            raise ValueError("reserve_bytes must be >= 0")
        self.reserve_bytes = reserve_bytes
        self._paths: dict[int, Path] = {}
        self.last: dict[int, Filesystem] = {}
        self.sampled_at = 0.0  # time.monotonic() of the last sample
        self._previous: Allocations = {}  # the allocations of the previous sample
        for p in paths:
            self.watch(p)

    def watch(self, path: Path) -> None:
        """Add a directory the edge writes (its filesystem, once per st_dev)."""
        path.mkdir(parents=True, exist_ok=True)
        self._paths.setdefault(os.stat(path).st_dev, path)

    def sample(self) -> list[Filesystem]:
        """statvfs of every watched filesystem (blocking, microseconds each)."""
        out: dict[int, Filesystem] = {}
        for dev, path in self._paths.items():
            try:
                st = os.statvfs(path)
            except OSError as exc:
                log.warning("disk guard: statvfs %s: %s", path, exc.strerror)
                continue
            out[dev] = Filesystem(dev, path, st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)
        self.last = out
        self.sampled_at = time.monotonic()
        return list(out.values())

    def low(self) -> Filesystem | None:
        """The watched filesystem with the least free space, if it is below the reserve (as of
        the last sample)."""
        below = [fs for fs in self.last.values() if fs.free_bytes < self.reserve_bytes]
        return min(below, key=lambda fs: fs.free_bytes) if below else None

    def fastest_writer(self, fs: Filesystem, allocations: Allocations) -> str | None:
        """The sandbox to end on `fs`: the one whose allocation there grew most since the
        previous sample, or None when none grew (then the space went elsewhere: ending a
        sandbox that is not writing would not stop the fill). Records `allocations` as the
        new previous sample."""
        before = self._previous
        self.remember(allocations)
        growth = {
            sid: used - (before[sid][1] if sid in before and before[sid][0] == dev else 0)
            for sid, (dev, used) in allocations.items()
            if dev == fs.dev
        }
        sid = max(growth, key=lambda s: growth[s], default=None)
        return sid if sid is not None and growth[sid] >= MIN_GROWTH_BYTES else None

    def remember(self, allocations: Allocations) -> None:
        """Record a sample of allocations (the baseline the next fastest_writer compares to)."""
        self._previous = dict(allocations)


def allocated_bytes(path: Path) -> tuple[int, int]:
    """(st_dev, bytes allocated) of a file, (0, 0) when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0)
    return (st.st_dev, st.st_blocks * 512)


def sum_allocations(ids: Iterable[str], files_of: Callable[[str], Iterable[Path]]) -> Allocations:
    """Per sandbox, the bytes its files allocate, on the filesystem of its first file."""
    out: Allocations = {}
    for sid in ids:
        dev_total: tuple[int, int] | None = None
        for f in files_of(sid):
            dev, used = allocated_bytes(f)
            if dev == 0:
                continue
            if dev_total is None:
                dev_total = (dev, used)
            elif dev == dev_total[0]:
                dev_total = (dev, dev_total[1] + used)
        if dev_total is not None:
            out[sid] = dev_total
    return out
