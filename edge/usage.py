"""Samples of a sandbox's resource use (GetSandboxMetrics, and E2B's metrics routes).

The container backend's watchdog (edge/backends/container/containment.py) takes one per
running sandbox every ``usage_sample_s`` (default 5 s, as E2B's envd does): its CPU time so far,
the memory it uses and the page cache charged to it (cgroup v1 memory.usage_in_bytes and
memory.stat), and its writable layer's use (statvfs). A sandbox whose CPU time did not move
since its last sample is sampled without reading anything again (nothing of it ran, so
nothing of that moved). The samples of the last ``usage_keep_s`` (default 600 s) are kept in a
ring of doubles per sandbox, six per sample: at 5 s over 10 minutes 5.6 KiB a sandbox, 11 MiB
for 2,000. CPU use is turned into a percentage of the sandbox's CPU limit when asked for,
from consecutive samples.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

#: Numbers per sample in a ring: at (Unix time), CPU seconds so far, memory used, page cache,
#: disk used, disk total.
_FIELDS = 6


@dataclass(frozen=True)
class Sample:
    at: float  # Unix time
    cpu_used_pct: float  # of the sandbox's CPU limit, since the sample before
    mem_used_bytes: int
    mem_cache_bytes: int
    disk_used_bytes: int
    disk_total_bytes: int


@dataclass(frozen=True)
class UsageSamples:
    """What GetSandboxMetrics answers: samples oldest first, and the sandbox's limits."""

    samples: list[Sample]
    cpu_count: float
    mem_total_bytes: int
    interval_s: float
    kept_s: float


class UsageRing:
    """One sandbox's samples of the last ``capacity`` intervals."""

    __slots__ = ("_a", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._a = array("d")

    def __len__(self) -> int:
        return len(self._a) // _FIELDS

    @property
    def last_at(self) -> float:
        return self._a[-_FIELDS] if self._a else 0.0

    def last(self) -> tuple[float, ...] | None:
        return tuple(self._a[-_FIELDS:]) if self._a else None

    def add(
        self,
        at: float,
        cpu_s: float,
        mem_used: int,
        mem_cache: int,
        disk_used: int,
        disk_total: int,
    ) -> None:
        self._a.extend((at, cpu_s, mem_used, mem_cache, disk_used, disk_total))
        if len(self._a) > self.capacity * _FIELDS:
            del self._a[:_FIELDS]

    def between(self, start: float, end: float, cpu_count: float) -> list[Sample]:
        """The samples taken in [start, end], each with its CPU use since the one before
        (0 for the oldest kept)."""
        a = self._a[:]  # a copy: the watchdog's thread may add meanwhile
        out = []
        prev_at = prev_cpu = -1.0
        for i in range(0, len(a), _FIELDS):
            at, cpu_s = a[i], a[i + 1]
            if start <= at <= end:
                pct = 0.0
                if prev_at >= 0 and at > prev_at and cpu_count > 0:
                    pct = (cpu_s - prev_cpu) / ((at - prev_at) * cpu_count) * 100.0
                out.append(
                    Sample(
                        at,
                        round(min(max(pct, 0.0), 100.0), 2),
                        int(a[i + 2]),
                        int(a[i + 3]),
                        int(a[i + 4]),
                        int(a[i + 5]),
                    )
                )
            prev_at, prev_cpu = at, cpu_s
        return out


def memory_v1(usage: bytes, stat: bytes) -> tuple[int, int]:
    """(used, page cache) from cgroup v1 memory.usage_in_bytes and memory.stat: used is the
    usage less the inactive file cache the kernel reclaims first (what `docker stats` shows)."""
    try:
        total = int(usage.split()[0])
    except (ValueError, IndexError):
        return 0, 0
    cache = inactive_file = 0
    for line in stat.splitlines():
        key, _, value = line.partition(b" ")
        if key == b"total_cache":
            cache = int(value or 0)
        elif key == b"total_inactive_file":
            inactive_file = int(value or 0)
    return max(total - inactive_file, 0), cache
