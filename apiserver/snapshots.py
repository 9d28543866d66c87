"""Project-private environments: the ``snapshots/<project_id>/...`` namespace.

Environments are cluster-wide names (apiserver/environments.py), but a snapshot of a
sandbox (its files packed as an environment: PackDiff) belongs to the project that made it.
A name ``snapshots/<project_id>/<rest>`` is that project's alone: only it may pack into it,
see it (get, list), create sandboxes from it and delete it (no ADMIN token needed); to any
other caller it does not exist (NOT_FOUND, left out of lists). No I/O here.
"""

from __future__ import annotations

from libdsec.errors import ImageNotFound, PermissionDenied

PREFIX = "snapshots/"


def owner_of(name: str) -> str | None:
    """The project a snapshot name belongs to; None for an ordinary environment name.

    ``snapshots/team/sub/snap-1:default`` -> ``team/sub`` (everything between the prefix and
    the last part)."""
    if not name.startswith(PREFIX):
        return None
    base = name.rpartition(":")[0] if ":" in name.rpartition("/")[2] else name
    owner, _, _ = base[len(PREFIX) :].rpartition("/")
    return owner


def visible(project_id: str, name: str) -> bool:
    owner = owner_of(name)
    return owner is None or owner == project_id


def check_visible(project_id: str, name: str) -> None:
    """ImageNotFound (NOT_FOUND) for another project's snapshot, exactly like a missing one."""
    if not visible(project_id, name):
        raise ImageNotFound(f"environment {name!r} not found", reason="IMAGE_NOT_FOUND")


def check_packable(project_id: str, name: str) -> None:
    """A pack into the snapshot namespace must name the caller's own project."""
    owner = owner_of(name)
    if owner is not None and owner != project_id:
        raise PermissionDenied(
            f"environment {name!r}: names under {PREFIX}<project>/ are that project's; "
            f"yours is {PREFIX}{project_id}/",
            reason="SNAPSHOT_NAMESPACE",
        )
