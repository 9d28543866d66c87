"""dsec's version, as every edge reports it (EdgeInfo.version) and the watcher compares it.

Nodes of one cluster must run the same major.minor: the watcher registers an edge of another
one UNHEALTHY (VERSION_MISMATCH) and placement never uses it. The patch level may differ (a
rolling upgrade of fixes). Kept equal to pyproject.toml's version (tests/unit/test_nodes.py).
"""

from __future__ import annotations

import re

DSEC_VERSION = "0.1.0"

_VERSION = re.compile(r"^(\d+)\.(\d+)(?:[.+-].*)?$")


def major_minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version such as "0.1.0" or "1.2"; None if it is not one."""
    m = _VERSION.match(version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def compatible(version: str, ours: str = DSEC_VERSION) -> bool:
    """Whether a node of ``version`` may join a cluster of ``ours`` (same major.minor)."""
    theirs = major_minor(version)
    return theirs is not None and theirs == major_minor(ours)
