"""Giving a paused sandbox's memory back to the node, and taking it again on resume.

A paused container keeps its processes and their state; what the node gets back is their
memory. The edge keeps one **swap area** for paused sandboxes (:class:`SwapArea`, a swap file
on local disk it creates, sized by `DSEC_EDGE_PAUSE_SWAP_MB`, inside the disk reserve), and a
pause of a frozen sandbox (:func:`page_out`):

1. lets its memory cgroup swap (`memory.swappiness`, 0 while the sandbox runs: a running
   sandbox never uses swap — its memsw limit equals its memory limit, and swappiness 0 keeps
   the kernel's own reclaim from pushing its anonymous pages out under node pressure);
2. pushes each process's private mappings out with `process_madvise(MADV_PAGEOUT)` (as
   Android's app freezer does), a batch of iovecs per call;
3. asks the cgroup to reclaim what is left — page cache of its files, shmem, what a
   process's mappings did not cover — with v1 `memory.force_empty`, which reclaims from a
   cgroup that still has tasks (cgroup v2 `memory.reclaim` where the host has it).

Resume (:func:`prefetch_plan`, :func:`prefetch`) puts the cgroup back to swappiness 0 and asks
for the paged-out ranges back with `MADV_WILLNEED` (swap-in read-ahead, asynchronous): first
those of the small processes (aether, chronus, shells: what the next command touches), then
the caller thaws, then the large rest in the background, so the first command waits neither
for every page nor for faults one page at a time.

This module touches only what it is given (a cgroup's directories, its processes, the swap
file); it never changes a host-wide setting (`vm.swappiness`, DAMON, zswap).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from edge.runtime import cgroups

log = logging.getLogger(__name__)

SYS_PIDFD_OPEN = 434
SYS_PROCESS_MADVISE = 440
MADV_WILLNEED = 3
MADV_PAGEOUT = 21
#: iovecs per process_madvise call (the kernel's UIO_MAXIOV).
IOV_BATCH = 1024
#: memory.swappiness of a paused sandbox (and of a running one: 0).
PAUSED_SWAPPINESS = 100

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class SwapUnavailable(Exception):
    """The swap area cannot be made or used; the message says why (pause freezes only)."""


# ------------------------------------------------------------------------------ swap area


def active_swaps() -> dict[str, tuple[int, int]]:
    """Active swap areas of the host: path -> (size, used) in bytes (/proc/swaps)."""
    out: dict[str, tuple[int, int]] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/swaps").read_text().splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 4:
                # Paths with spaces are escaped as \040.
                out[parts[0].replace("\\040", " ")] = (int(parts[2]) << 10, int(parts[3]) << 10)
    return out


@dataclass
class SwapArea:
    """The edge's swap file for paused sandboxes: created (or taken over after an edge
    restart, when it is still active) by :meth:`ensure`, removed by :meth:`release`."""

    path: Path
    size_bytes: int

    @classmethod
    def ensure(cls, path: Path, size_mb: int, *, reserve_bytes: int) -> SwapArea:
        """The swap area at `path`, `size_mb` large, active. An area still active from a
        previous edge process is kept as it is (paused sandboxes may have pages in it).
        Raises SwapUnavailable naming why it cannot be made: no space within the disk reserve,
        a filesystem swap files do not work on, the host's swap-area table full, ..."""
        path = path.absolute()
        active = active_swaps()
        if str(path) in active:
            return cls(path, active[str(path)][0])
        path.parent.mkdir(parents=True, exist_ok=True)
        size = size_mb << 20
        have = path.stat().st_size if path.exists() else 0
        st = os.statvfs(path.parent)
        free = st.f_bavail * st.f_frsize
        if free + have - size < reserve_bytes:
            raise SwapUnavailable(
                f"no room for a {size_mb} MiB swap area in {path.parent}: "
                f"{(free + have) >> 20} MiB free, and {reserve_bytes >> 20} MiB must stay free"
            )
        try:
            if have != size:
                path.unlink(missing_ok=True)
                fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, size)
                finally:
                    os.close(fd)
            os.chmod(path, 0o600)
            _run(["mkswap", str(path)])
            _run(["swapon", str(path)])
        except (OSError, SwapUnavailable) as exc:
            with contextlib.suppress(OSError):
                if str(path) not in active_swaps():
                    path.unlink()
            raise SwapUnavailable(f"cannot make the swap area {path}: {exc}") from exc
        return cls(path, size)

    def usage(self) -> tuple[int, int]:
        """(size, used) bytes; (0, 0) if it is no longer active."""
        return active_swaps().get(str(self.path), (0, 0))

    def release(self) -> None:
        """swapoff (pages still in it come back into memory) and remove the file."""
        if str(self.path) in active_swaps():
            _run(["swapoff", str(self.path)])
        self.path.unlink(missing_ok=True)


def _run(argv: list[str]) -> None:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise SwapUnavailable(f"{argv[0]}: {(p.stderr or p.stdout).strip()}")


# ------------------------------------------------------------------------------ one sandbox


@dataclass(frozen=True)
class MemorySample:
    """A memory cgroup's charge: resident (memory.usage_in_bytes: anonymous, page cache,
    kernel) and swapped (pages of it in swap)."""

    resident_bytes: int
    swapped_bytes: int


def sample(memory_dir: Path) -> MemorySample:
    v1 = (memory_dir / "memory.usage_in_bytes", memory_dir / "memory.stat")
    if v1[0].exists():
        return MemorySample(_int(v1[0]), cgroups.keyed_file(v1[1]).get("total_swap", 0))
    return MemorySample(
        _int(memory_dir / "memory.current"), _int(memory_dir / "memory.swap.current")
    )


@dataclass(frozen=True)
class PageOut:
    before: MemorySample
    after: MemorySample
    advised_bytes: int  # what process_madvise covered
    processes: int
    seconds: float

    @property
    def freed_bytes(self) -> int:
        return max(0, self.before.resident_bytes - self.after.resident_bytes)


def private_ranges(pid: int) -> list[tuple[int, int]]:
    """(start, length) of the process's private mappings (/proc/<pid>/maps), which are what
    MADV_PAGEOUT can move to swap (anonymous and copy-on-write pages) or drop (clean file
    pages no one else maps). The kernel's special mappings are left out."""
    out: list[tuple[int, int]] = []
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 5 or parts[1][3] != "p" or parts[1][0] != "r":
            continue
        name = parts[5] if len(parts) > 5 else ""
        if name in ("[vsyscall]", "[vvar]", "[vdso]", "[vvar_vclock]"):
            continue
        lo, _, hi = parts[0].partition("-")
        start, end = int(lo, 16), int(hi, 16)
        out.append((start, end - start))
    return out


def _madvise(pid: int, ranges: list[tuple[int, int]], advice: int) -> int:
    """process_madvise over `ranges` of `pid`, IOV_BATCH at a time; returns bytes advised.
    A process that exits (or is not ours to advise) is skipped."""
    if not ranges:
        return 0
    pidfd = _libc.syscall(SYS_PIDFD_OPEN, pid, 0)
    if pidfd < 0:
        return 0
    done = 0
    try:
        for i in range(0, len(ranges), IOV_BATCH):
            batch = ranges[i : i + IOV_BATCH]
            iov = (_Iovec * len(batch))(*[_Iovec(s, n) for s, n in batch])
            n = _libc.syscall(SYS_PROCESS_MADVISE, pidfd, iov, len(batch), advice, 0)
            if n < 0:
                err = ctypes.get_errno()
                if err in (errno.ESRCH, errno.EPERM):
                    break
                # EINVAL/ENOMEM: one range went away under us (a mapping changed between
                # reading maps and the call — not while frozen, but a thawed resume can race):
                # advise the batch range by range so the rest still counts.
                for s, length in batch:
                    one = (_Iovec * 1)(_Iovec(s, length))
                    r = _libc.syscall(SYS_PROCESS_MADVISE, pidfd, one, 1, advice, 0)
                    done += max(0, r)
                continue
            done += n
    finally:
        os.close(pidfd)
    return done


def pids_of(memory_dir: Path) -> list[int]:
    """Processes (thread-group leaders) of the cgroup and its children."""
    dirs = [memory_dir, *(p for p in memory_dir.rglob("*") if p.is_dir())]
    return [pid for d in dirs for pid in cgroups.procs(d)]


def page_out(memory_dir: Path) -> PageOut:
    """Push a frozen cgroup's memory out (see the module's docstring). Blocking: seconds for
    GBs; call it in a thread."""
    t0 = time.monotonic()
    before = sample(memory_dir)
    _set_swappiness(memory_dir, PAUSED_SWAPPINESS)
    pids = pids_of(memory_dir)
    advised = sum(_madvise(pid, private_ranges(pid), MADV_PAGEOUT) for pid in pids)
    reclaim_rest(memory_dir)
    return PageOut(before, sample(memory_dir), advised, len(pids), time.monotonic() - t0)


def reclaim_rest(memory_dir: Path) -> None:
    """What the mappings did not cover: page cache, shmem. cgroup v2: memory.reclaim of the
    whole charge; v1: memory.force_empty (reclaims until nothing more can go; EBUSY/EINTR
    mean it stopped early, which leaves what it could not reclaim resident)."""
    v2 = memory_dir / "memory.reclaim"
    target = v2 if v2.exists() else memory_dir / "memory.force_empty"
    value = str(sample(memory_dir).resident_bytes) if v2.exists() else "0"
    try:
        target.write_text(value)
    except OSError as exc:
        if exc.errno not in (errno.EBUSY, errno.EAGAIN, errno.EINTR):
            log.warning("reclaim of %s: %s", memory_dir, exc)


#: At resume, processes with less than this in swap are read back before the thaw (aether,
#: chronus, shells: what the first command needs); the rest after it, in the background.
PREFETCH_FIRST_BYTES = 32 << 20


def prefetch_plan(memory_dir: Path) -> tuple[list[int], list[int]]:
    """The cgroup's processes with pages in swap: (small ones first, the large rest), and the
    cgroup stops swapping again (swappiness 0)."""
    _set_swappiness(memory_dir, 0)
    small: list[int] = []
    large: list[int] = []
    if not sample(memory_dir).swapped_bytes:
        return small, large
    for pid in pids_of(memory_dir):
        swapped = _status_kb(pid, "VmSwap") << 10
        if swapped:
            (small if swapped < PREFETCH_FIRST_BYTES else large).append(pid)
    return small, large


def prefetch(pids: list[int]) -> int:
    """Ask for the processes' paged-out memory back: MADV_WILLNEED starts swap-in read-ahead of
    every private mapping and returns (pages not back yet fault in from swap on first touch);
    returns bytes advised."""
    return sum(_madvise(pid, private_ranges(pid), MADV_WILLNEED) for pid in pids)


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _set_swappiness(memory_dir: Path, value: int) -> None:
    # v1 only (cgroup v2 has no per-cgroup swappiness: memory.swap.max bounds it instead).
    f = memory_dir / "memory.swappiness"
    if f.exists():
        f.write_text(str(value))
    swap_max = memory_dir / "memory.swap.max"
    if swap_max.exists():
        swap_max.write_text("max" if value else "0")


def _int(path: Path) -> int:
    return cgroups.int_file(path) or 0
