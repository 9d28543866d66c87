"""Pause that gives a container's memory back: the edge's swap area and the page-out of a
frozen sandbox (the mechanics are edge/runtime/pager.py), and the memory sampling every
backend reports `memory_usage` with (`usage`). The swap area is the node's: built once by
edge/node.py and handed to the backends and to the servicer (`GetNodeStatus.pause`).

Without a swap area (``DSEC_EDGE_PAUSE_SWAP_MB=0``, or one that cannot be made: no room
within the disk reserve, a filesystem swap files do not work on, the host's table of swap
areas full) a pause only freezes; the edge says why at start (``dsec status``: the
``pause_reclaim`` control) and on every paused sandbox (``memory.frozen_only``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from edge.backends.contract import MemoryUsage, PauseOutcome
from edge.controls import ABSENT, DISABLED, ENFORCED, Control
from edge.runtime import pager
from edge.runtime.pager import SwapArea, SwapUnavailable

log = logging.getLogger(__name__)


class PauseReclaim:
    """The swap area of one edge and the page-outs into it. Page-outs run a few at a time
    (each is a kernel walk plus swap writes: more in parallel only queue on the disk)."""

    def __init__(self, swap: SwapArea | None, why_not: str, *, concurrency: int = 0) -> None:
        self.swap = swap
        self.why_not = why_not
        self._slots = asyncio.Semaphore(concurrency or max(2, os.cpu_count() or 1))
        #: Read-ahead still running after a resume, per memory cgroup (a pause waits for it).
        self._prefetching: dict[Path, asyncio.Task[None]] = {}

    @classmethod
    def make(cls, path: Path, size_mb: int, reserve_mb: int) -> PauseReclaim:
        if size_mb <= 0:
            return cls(None, "DSEC_EDGE_PAUSE_SWAP_MB=0: pause freezes only")
        try:
            swap = SwapArea.ensure(path, size_mb, reserve_bytes=reserve_mb << 20)
        except SwapUnavailable as exc:
            log.warning("no swap area for paused sandboxes, pause will freeze only: %s", exc)
            return cls(None, str(exc))
        log.info("swap area for paused sandboxes: %s (%d MiB)", swap.path, swap.size_bytes >> 20)
        return cls(swap, "")

    def control(self) -> Control:
        if self.swap is not None:
            return Control(
                "pause_reclaim",
                ENFORCED,
                f"swap area {self.swap.path} ({self.swap.size_bytes >> 20} MiB), "
                "process_madvise(MADV_PAGEOUT) + memory.force_empty",
            )
        state = DISABLED if self.why_not.startswith("DSEC_EDGE_PAUSE_SWAP_MB=0") else ABSENT
        return Control("pause_reclaim", state, self.why_not)

    async def page_out(self, memory_dir: Path | None) -> PauseOutcome:
        """The sandbox is frozen: push its memory out (or, without a swap area, measure)."""
        if memory_dir is None:
            zero = MemoryUsage(0, 0)
            return PauseOutcome(zero, zero, 0.0, "the sandbox has no memory cgroup")
        if self.swap is None:
            now = usage(memory_dir)
            return PauseOutcome(now, now, 0.0, self.why_not)
        prefetch = self._prefetching.get(memory_dir)
        if prefetch is not None:
            await asyncio.shield(prefetch)
        async with self._slots:
            r = await asyncio.to_thread(pager.page_out, memory_dir)
        log.debug(
            "paged out %s: %d processes, %d MiB advised, %d MiB freed in %.0f ms",
            memory_dir.name,
            r.processes,
            r.advised_bytes >> 20,
            r.freed_bytes >> 20,
            r.seconds * 1000,
        )
        return PauseOutcome(_usage(r.before), _usage(r.after), r.seconds)

    async def resume(self, memory_dir: Path | None, thaw: Callable[[], Awaitable[None]]) -> None:
        """Read the small processes' memory back (what the first command touches), thaw, and
        read the large rest in the background (a page touched first faults in at once)."""
        if memory_dir is None or self.swap is None:
            await thaw()
            return
        small, large = await asyncio.to_thread(pager.prefetch_plan, memory_dir)
        if small:
            await asyncio.to_thread(pager.prefetch, small)
        await thaw()
        if not large:
            return
        task = asyncio.get_running_loop().create_task(self._prefetch(large))
        self._prefetching[memory_dir] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._prefetching.get(memory_dir) is t:
                del self._prefetching[memory_dir]

        task.add_done_callback(done)

    async def _prefetch(self, pids: list[int]) -> None:
        try:
            await asyncio.to_thread(pager.prefetch, pids)
        except Exception as exc:  # the sandbox runs on: its pages fault in instead
            log.warning("read-ahead of processes %s failed: %s", pids[:8], exc)

    def status(self) -> tuple[int, int]:
        """(size, used) bytes of the swap area; (0, 0) without one."""
        return self.swap.usage() if self.swap is not None else (0, 0)

    def release(self) -> None:
        """The edge stops and no sandbox of ours is left: remove the swap area."""
        if self.swap is not None:
            try:
                self.swap.release()
            except (OSError, SwapUnavailable) as exc:
                log.warning("cannot remove the swap area %s: %s", self.swap.path, exc)


def usage(memory_dir: Path) -> MemoryUsage:
    return _usage(pager.sample(memory_dir))


def _usage(s: pager.MemorySample) -> MemoryUsage:
    return MemoryUsage(s.resident_bytes, s.swapped_bytes)
