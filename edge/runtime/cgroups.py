"""Reading and removing a sandbox's cgroups on this machine's hybrid layout.

cgroup v1 controllers (memory, cpu, cpuacct, pids, freezer, ...) each on their own hierarchy under
/sys/fs/cgroup/<controller>, plus a controller-less cgroup2 at /sys/fs/cgroup/unified where runc
also creates the sandbox's directory (that is where eBPF programs attach). runc creates and removes
these itself; this module reads counters from them and removes what a crash left behind.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from functools import lru_cache
from pathlib import Path

from edge import hostfacts

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def hierarchies() -> dict[str, Path]:
    """Controller name -> mount point, for every mounted cgroup hierarchy.

    Keys are the v1 super options' controllers ("memory", "cpu", "name=systemd", ...) and
    "unified" for cgroup2. A hierarchy with several controllers appears once per controller.
    """
    return {name: Path(at) for name, at in hostfacts.host_cgroup_mounts().items()}


def controller_dir(controller: str, cgroup_path: str) -> Path | None:
    root = hierarchies().get(controller)
    return None if root is None else root / cgroup_path.lstrip("/")


def existing_dirs(cgroup_path: str) -> list[Path]:
    """Every hierarchy's directory for `cgroup_path` that exists (one per distinct mount)."""
    seen: set[Path] = set()
    out = []
    for root in hierarchies().values():
        if root in seen:
            continue
        seen.add(root)
        d = root / cgroup_path.lstrip("/")
        if d.is_dir():
            out.append(d)
    return out


def children(parent: str) -> set[str]:
    """Names of child cgroups of `parent` in any hierarchy (the sandbox ids runc created)."""
    names: set[str] = set()
    for root in set(hierarchies().values()):
        d = root / parent.lstrip("/")
        with contextlib.suppress(OSError):
            names.update(e.name for e in d.iterdir() if e.is_dir())
    return names


def read_int(controller: str, cgroup_path: str, name: str) -> int | None:
    d = controller_dir(controller, cgroup_path)
    return None if d is None else int_file(d / name)


def int_file(path: Path) -> int | None:
    """The first number of a cgroup file (None if unreadable)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def read_keyed(controller: str, cgroup_path: str, name: str) -> dict[str, int]:
    """A "key value" per line file such as memory.oom_control or memory.stat."""
    d = controller_dir(controller, cgroup_path)
    return {} if d is None else keyed_file(d / name)


def keyed_file(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[k] = int(v)
    return out


def freezer_state(cgroup_path: str) -> str | None:
    d = controller_dir("freezer", cgroup_path)
    try:
        return None if d is None else (d / "freezer.state").read_text().strip()
    except OSError:
        return None


def freeze(cgroup_path: str, timeout_s: float = 5.0) -> bool:
    """Freeze the v1 freezer and wait until every task is frozen (what `runc pause` does, without
    its Go process: ~10 ms of CPU per call). A freeze stuck in FREEZING (a task in an
    uninterruptible wait) is thawed and tried again, as runc does. Returns whether it froze."""
    d = controller_dir("freezer", cgroup_path)
    if d is None:
        return False
    f = d / "freezer.state"
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            f.write_text("FROZEN")
            attempt_end = min(deadline, time.monotonic() + 0.5)
            delay = 0.0005
            while time.monotonic() < attempt_end:
                if f.read_text().strip() == "FROZEN":
                    return True
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
            f.write_text("THAWED")
    except OSError:
        return False
    return False


def thaw(cgroup_path: str) -> None:
    """Thaw the v1 freezer: frozen tasks do not act on SIGKILL until thawed."""
    d = controller_dir("freezer", cgroup_path)
    if d is not None:
        with contextlib.suppress(OSError):
            (d / "freezer.state").write_text("THAWED")


def procs(d: Path) -> list[int]:
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def remove(cgroup_path: str, timeout_s: float = 2.0) -> list[Path]:
    """Kill whatever is left in `cgroup_path` and remove its directory in every hierarchy.

    Returns the directories removed. Used for crash leftovers; for a healthy sandbox runc has
    already done this and the call finds nothing.
    """
    dirs = existing_dirs(cgroup_path)
    if not dirs:
        return []
    thaw(cgroup_path)
    removed = []
    deadline = time.monotonic() + timeout_s
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        # Nested children first (a sandbox may have made sub-cgroups if it was ever delegated).
        for sub in sorted(
            (p for p in d.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
        ):
            _rmdir_killing(sub, deadline)
        if _rmdir_killing(d, deadline):
            removed.append(d)
    return removed


def _rmdir_killing(d: Path, deadline: float) -> bool:
    while True:
        for pid in procs(d):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        try:
            d.rmdir()
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                log.warning("cannot remove cgroup %s: %s", d, exc)
                return False
        time.sleep(0.005)


def set_limits(
    cgroup_path: str, *, cpu_quota_us: int, cpu_shares: int, memory_bytes: int, pids_max: int
) -> None:
    """Rewrite a running container's cpu, memory (+memsw) and pids limits (what runc set from
    the bundle at its start). Memory and memory+swap are written in the order that keeps
    memsw >= memory at every step. Raises OSError (EBUSY: usage above the new memory limit)."""

    def write(controller: str, name: str, value: int) -> None:
        # Fail closed: a limit whose file is absent is an error, never skipped. The one
        # exception is memory+swap, absent only where the operator turned memory_swap off
        # (edge/controls.py refuses to start otherwise).
        d = controller_dir(controller, cgroup_path)
        if d is None:
            raise FileNotFoundError(f"no cgroup v1 {controller} hierarchy for {cgroup_path}")
        f = d / name
        if name.startswith("memory.memsw.") and not f.exists():
            return
        f.write_text(str(value))

    write("cpu", "cpu.cfs_quota_us", cpu_quota_us)
    write("cpu", "cpu.shares", cpu_shares)
    current = read_int("memory", cgroup_path, "memory.limit_in_bytes") or 0
    order = ["memory.memsw.limit_in_bytes", "memory.limit_in_bytes"]
    for name in order if memory_bytes > current else reversed(order):
        write("memory", name, memory_bytes)
    # A running sandbox never swaps (only a pause pages it out: edge/runtime/pager.py).
    mem = controller_dir("memory", cgroup_path)
    if mem is not None and (mem / "memory.swappiness").exists():
        (mem / "memory.swappiness").write_text("0")
    write("pids", "pids.max", pids_max)


def rename(old_path: str, new_path: str) -> bool:
    """Rename a cgroup (same parent) in every cgroup v1 hierarchy (kernfs renames: cheap, the
    processes stay). cgroup2 refuses renames (EPERM): returns whether a cgroup2 directory is
    left under the old name, for `move_unified`."""
    unified = hierarchies().get("unified")
    left = False
    for d in existing_dirs(old_path):
        if unified is not None and d.is_relative_to(unified):
            left = True
        else:
            os.rename(d, d.parent / Path(new_path).name)
    return left


def move_unified(old_path: str, new_path: str) -> None:
    """The cgroup2 half of `rename`: make the new directory, move the processes into it, remove
    the old one. Each move takes the kernel's threadgroup lock for writing (an RCU grace period:
    2-17 ms measured under load), hence its own step that callers run off the critical path."""
    unified = hierarchies().get("unified")
    if unified is None:
        return
    d = unified / old_path.lstrip("/")
    target = unified / new_path.lstrip("/")
    if not d.is_dir():
        return
    target.mkdir(exist_ok=True)
    for _ in range(100):
        pids = procs(d)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                (target / "cgroup.procs").write_text(str(pid))
    d.rmdir()
