"""Which files of the read-only layers a sandbox modified or deleted (from its writable upper).

The evaluation step of an RL task must know whether the agent tampered with the environment
(overwrote /bin/bash, patched a test runner, deleted a checker). Everything a sandbox changes
lands in its overlay upper directory, so the answer is a walk of the upper compared with the
lower layers:

- a regular file, symlink or other non-directory in the upper whose path exists in a lower:
  modified (copied up: written, truncated, chmod-ed or replaced);
- a whiteout (a 0/0 character device) whose path exists in a lower: deleted;
- an opaque directory (xattr trusted.overlay.opaque=y: the directory was removed and made
  again) hides everything of the lowers below it: every lower path under it that the upper
  does not have again is deleted.

Files that exist only in the upper (new files) are not reported: they are the agent's work.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from edge.runtime.mounts import read_mountinfo

_OPAQUE = "trusted.overlay.opaque"


@dataclass(frozen=True)
class ModifiedFile:
    path: str  # absolute, as the sandbox sees it
    deleted: bool


def overlay_lowers(pid: int) -> list[Path]:
    """The lower directories (top-most first) of the overlay that is the root of process `pid`
    (a sandbox's init): read from its own mount table, since the host keeps no mount of a started
    sandbox's rootfs. [] if that root is not an overlay or the process is gone."""
    try:
        infos = read_mountinfo(f"/proc/{pid}/mountinfo")
    except OSError:
        return []
    for m in infos:
        if m.mountpoint == "/" and m.fstype == "overlay":
            for opt in m.super_options.split(","):
                if opt.startswith("lowerdir="):
                    return [Path(p) for p in opt[len("lowerdir=") :].split(":") if p]
    return []


def _in_lowers(lowers: list[Path], rel: str) -> bool:
    return any(os.path.lexists(lower / rel) for lower in lowers)


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, _OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def modified_files(upper: Path, lowers: list[Path], limit: int = 100_000) -> list[ModifiedFile]:
    """Walk `upper` (blocking); at most `limit` entries, sorted by path."""
    out: list[ModifiedFile] = []
    seen: set[str] = set()

    def report(rel: str, deleted: bool) -> bool:
        if rel not in seen:
            seen.add(rel)
            out.append(ModifiedFile("/" + rel, deleted))
        return len(out) < limit

    def hidden_by_opaque(rel: str, upper_dir: Path) -> bool:
        """Lower entries under an opaque directory that the upper does not have again."""
        for lower in lowers:
            base = lower / rel
            if not base.is_dir() or base.is_symlink():
                continue
            for root, dirs, files in os.walk(base):
                sub = os.path.relpath(root, lower)
                for name in sorted(files) + sorted(
                    d for d in dirs if os.path.islink(os.path.join(root, d))
                ):
                    r = os.path.join(sub, name)
                    if not os.path.lexists(upper / r) and not report(r, True):
                        return False
        return True

    def walk(rel: str) -> bool:
        d = upper / rel if rel else upper
        try:
            names = sorted(os.listdir(d))
        except OSError:
            return True
        for name in names:
            r = os.path.join(rel, name) if rel else name
            p = upper / r
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if _opaque(p) and not hidden_by_opaque(r, upper):
                    return False
                if not walk(r):
                    return False
            elif _is_whiteout(st):
                if _in_lowers(lowers, r) and not report(r, True):
                    return False
            elif _in_lowers(lowers, r) and not report(r, False):
                return False
        return True

    walk("")
    out.sort(key=lambda m: m.path)
    return out
