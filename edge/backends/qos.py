"""CPU QoS of sandboxes: best-effort ones under SCHED_IDLE, latency-sensitive ones with a core
scheduling cookie of their own where the kernel has it.

SCHED_IDLE (a best-effort sandbox): it runs only on CPU time nothing else on the node wants; a
process inherits the policy of the thread that forks it, so setting it on a sandbox's first
process (its init, before anything else runs there) covers everything it ever starts, and a
sandbox cannot leave it (that takes CAP_SYS_NICE or an RLIMIT_NICE above 0).

Core scheduling (``prctl(PR_SCHED_CORE)``, Linux >= 5.14 with ``CONFIG_SCHED_CORE``, useful
only on SMT hosts): tasks whose cookies differ never run on the two hyperthreads of one core at
the same time. A latency-sensitive sandbox gets a cookie of its own on its init before anything
else runs there (children inherit it at fork), so no best-effort sandbox (cookie 0, like the
host's tasks) and no other sandbox shares its core — the report's remedy for SMT interference.
The kernel of this machine kind has no ``CONFIG_SCHED_CORE``: the probe says so, the edge reports
``core_scheduling`` absent (``dsec status``) and the cookie path is not exercised here.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from dataclasses import dataclass
from pathlib import Path

PR_SCHED_CORE = 62
PR_SCHED_CORE_GET, PR_SCHED_CORE_CREATE = 0, 1
#: pid scopes of PR_SCHED_CORE (``enum pid_type``): one thread, a thread group, a process group.
PIDTYPE_PID, PIDTYPE_TGID, PIDTYPE_PGID = 0, 1, 2


@dataclass(frozen=True)
class CoreScheduling:
    available: bool
    detail: str


def _prctl(option: int, *args: int) -> int:
    """prctl(option, args...) with the unused arguments 0: 0, or the errno it failed with."""
    libc = ctypes.CDLL(None, use_errno=True)
    values = [ctypes.c_ulong(a) for a in (*args, 0, 0, 0, 0)[:4]]
    if libc.prctl(ctypes.c_int(option), *values) == -1:
        return ctypes.get_errno()
    return 0


@functools.cache
def core_scheduling() -> CoreScheduling:
    """Whether this kernel offers core scheduling, probed once (the edge's start asks first):
    reading the edge's own cookie works exactly where creating one would."""
    cookie = ctypes.c_uint64(0)
    err = _prctl(PR_SCHED_CORE, PR_SCHED_CORE_GET, 0, PIDTYPE_PID, ctypes.addressof(cookie))
    if err == 0:
        return CoreScheduling(True, "a PR_SCHED_CORE cookie per latency-sensitive sandbox")
    if err == errno.EINVAL:
        why = "this kernel has no core scheduling (CONFIG_SCHED_CORE; prctl PR_SCHED_CORE: EINVAL)"
    elif err == errno.ENODEV:
        why = "no SMT on this host: no core is shared (prctl PR_SCHED_CORE: ENODEV)"
    else:
        why = f"prctl PR_SCHED_CORE: {errno.errorcode.get(err, str(err))}"
    return CoreScheduling(False, why + "; latency-sensitive sandboxes get no cookie")


def new_core_cookie(pid: int) -> None:
    """A new core scheduling cookie for process `pid` (all its threads; what it forks later
    inherits it). Only where `core_scheduling()` is available; untested on this machine kind."""
    err = _prctl(PR_SCHED_CORE, PR_SCHED_CORE_CREATE, pid, PIDTYPE_TGID)
    if err:
        raise OSError(err, f"PR_SCHED_CORE_CREATE for pid {pid}: {os.strerror(err)}")


def set_idle(pid: int) -> None:
    """SCHED_IDLE for one thread (`pid` as a thread id), e.g. a sandbox's only process."""
    os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))


def set_idle_all_threads(pid: int) -> None:
    """SCHED_IDLE for every thread of running process `pid`. A thread started meanwhile inherits
    the policy of its creator, so the listing is repeated until it shows no thread not set."""
    done: set[int] = set()
    while True:
        try:
            tids = {int(t) for t in os.listdir(f"/proc/{pid}/task")}
        except FileNotFoundError:
            raise ProcessLookupError(pid) from None
        todo = tids - done
        if not todo:
            return
        for tid in todo:
            try:
                set_idle(tid)
            except ProcessLookupError:
                pass  # that thread ended
        done |= todo


def set_cgroup_idle(cpu_dir: Path | None, idle: bool) -> None:
    """A cpu cgroup (v1 directory) idle or not (`cpu.idle`, Linux >= 5.15): an idle group
    weighs what a SCHED_IDLE task does against its siblings and yields to them at wakeup. Its
    `cpu.shares` cannot be written while it is idle (EINVAL). Nothing on a kernel without it."""
    if cpu_dir is not None and (cpu_dir / "cpu.idle").exists():
        (cpu_dir / "cpu.idle").write_text("1" if idle else "0")
