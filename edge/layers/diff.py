"""pack_diff's first half: a sandbox's writable layer (overlay upper) -> a clean layer tree.

The upper directory is already in overlayfs form (whiteouts, opaque directories), so packing is
a filtered copy: build residue is left out so that nothing of a task (answers, logs, caches)
leaks into an environment others start from, and overlayfs bookkeeping xattrs are dropped.
"""

from __future__ import annotations

import fnmatch
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from edge.layers.tree import CopyStats, copy_tree
from libdsec.errors import InvalidArgument

#: Left out of every packed layer unless the caller opts out (no_default_excludes).
#: Patterns are sandbox-absolute globs; a match excludes the entry with everything below it.
DEFAULT_EXCLUDES: tuple[str, ...] = (
    # scratch space
    "/tmp",
    "/var/tmp",
    "/run",
    # caches (package managers, pip, npm, ...)
    "/root/.cache",
    "/home/*/.cache",
    "/root/.npm",
    "/home/*/.npm",
    "/var/cache/apt",
    "/var/lib/apt/lists",
    "/var/cache/debconf/*-old",
    "/var/log/apt",
    # shell and REPL history, editor state
    "/root/.*_history",
    "/home/*/.*_history",
    "/root/.lesshst",
    "/root/.viminfo",
    "/root/.wget-hsts",
    # the toolkit's mount point, which runc creates in every upper
    "/.dsec",
)


def mount_points(bundle_config: Path) -> list[str]:
    """Destinations of the sandbox's mounts (from its OCI config.json): runc creates the ones
    the image lacks in the upper layer, empty, and they are not the sandbox's work."""
    try:
        cfg = json.loads(bundle_config.read_text())
    except (OSError, ValueError):
        return []
    return [
        str(m["destination"]).rstrip("/") for m in cfg.get("mounts", []) if m.get("destination")
    ]


class Excluder:
    """skip(path) for copy_tree: glob patterns, plus empty mount-point residue."""

    def __init__(
        self, upper: Path, patterns: Iterable[str], mountpoints: Iterable[str] = ()
    ) -> None:
        self.upper = upper
        self.patterns = [p.rstrip("/") or "/" for p in patterns]
        self.mountpoints = {m for m in mountpoints if m and m != "/"}

    def __call__(self, path: str) -> bool:
        if any(fnmatch.fnmatchcase(path, p) for p in self.patterns):
            return True
        if path in self.mountpoints:
            try:
                st = os.lstat(os.path.join(self.upper, path.lstrip("/")))
            except FileNotFoundError:
                return True
            if stat.S_ISDIR(st.st_mode):
                return not os.listdir(os.path.join(self.upper, path.lstrip("/")))
            return stat.S_ISREG(st.st_mode) and st.st_size == 0
        return False


def snapshot(
    upper: Path,
    dest: Path,
    *,
    exclude: Iterable[str] = (),
    default_excludes: bool = True,
    mountpoints: Iterable[str] = (),
) -> CopyStats:
    """Copy the upper directory to `dest` without residue. Call with the sandbox frozen (or
    stopped) so that the copy is one consistent point in time."""
    patterns = [*(DEFAULT_EXCLUDES if default_excludes else ()), *exclude]
    for p in patterns:
        if not p.startswith("/"):
            raise InvalidArgument(
                f"exclude pattern {p!r} must be an absolute path glob", reason="INVALID_EXCLUDE"
            )
    return copy_tree(upper, dest, skip=Excluder(upper, patterns, mountpoints))
