"""Memory of processes as the kernel accounts it (for tests and benchmarks).

PSS divides each shared page among the processes mapping it, so the PSS of
aether + chronus is what one sandbox really costs; USS (private pages) is
what it would free on exit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Memory:
    rss: int  # bytes
    pss: int
    uss: int
    anonymous: int
    swap: int

    def __add__(self, other: Memory) -> Memory:
        return Memory(
            self.rss + other.rss,
            self.pss + other.pss,
            self.uss + other.uss,
            self.anonymous + other.anonymous,
            self.swap + other.swap,
        )


def memory_of(pid: int) -> Memory:
    """One process's memory, from /proc/<pid>/smaps_rollup."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return Memory(
        rss=fields.get("Rss", 0),
        pss=fields.get("Pss", 0),
        uss=fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
        anonymous=fields.get("Anonymous", 0),
        swap=fields.get("Swap", 0),
    )


def pss_of(pids: Iterable[int]) -> Memory:
    """Summed memory of `pids` (PSS sums correctly; RSS double-counts sharing)."""
    total = Memory(0, 0, 0, 0, 0)
    for pid in pids:
        total = total + memory_of(pid)
    return total
