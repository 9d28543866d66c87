"""The sandbox's process tree: reading it from /proc, and signalling its processes.

aether signals every descendant at shutdown; chronus kills a command's whole session at its
timeout (`kill_session`). Every process a command forks stays findable by its session id (each
command starts in a session of its own, `chronus.proc.spawn`), even after it leaves its group.
"""

from __future__ import annotations

import _signal  # not `signal`: its enums cost ~1 MB per process
import os


class ProcEntry:
    __slots__ = ("pgid", "pid", "ppid", "sid")

    def __init__(self, pid: int, ppid: int, pgid: int, sid: int) -> None:
        self.pid = pid
        self.ppid = ppid
        self.pgid = pgid
        self.sid = sid


def proc_table() -> list[ProcEntry]:
    """Every visible process (in a sandbox: every process of the sandbox)."""
    table: list[ProcEntry] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                raw = fh.read()
        except OSError:
            continue  # exited while we looked
        # The command name may contain spaces and parentheses: split after the last ')'.
        fields = raw[raw.rfind(b")") + 2 :].split()
        table.append(ProcEntry(int(name), int(fields[1]), int(fields[2]), int(fields[3])))
    return table


def descendants(roots: set[int], table: list[ProcEntry]) -> set[int]:
    """Pids below `roots` in the parent tree (excluding the roots)."""
    children: dict[int, list[int]] = {}
    for p in table:
        children.setdefault(p.ppid, []).append(p.pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_quietly(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def killpg_quietly(pgid: int, sig: int) -> bool:
    if pgid <= 1:
        return False  # never signal init's group or "every process"
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_session(sid: int, root: int, sig: int = _signal.SIGKILL) -> int:
    """Signal the process group `sid`, every process of session `sid` and
    every descendant of `root`: the stragglers that left the group or forked
    away still die. Returns how many processes were signalled."""
    killpg_quietly(sid, sig)
    table = proc_table()
    me = os.getpid()
    targets = {p.pid for p in table if p.sid == sid} | descendants({root}, table)
    targets.discard(me)
    return sum(kill_quietly(pid, sig) for pid in targets)
