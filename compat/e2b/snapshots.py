"""E2B snapshots on dsec: a snapshot is the sandbox's files packed as an environment.

``POST /sandboxes/{id}/snapshots`` packs the sandbox's writable layer (PackDiff, every file:
no default excludes) as the environment ``snapshots/<project>/<id>:<tag>``, the caller's
project's private namespace (apiserver/snapshots.py: other projects get NOT_FOUND); a
create whose templateID names one starts from it; ``GET /snapshots`` lists them;
``DELETE /templates/{id}`` (what the SDK's ``delete_snapshot`` calls) forgets one. A
sandbox running from a deleted snapshot keeps running (its edge holds the layers it
mounted).

What is kept: the files (and the source's E2B template, user and memory, recorded with the
packed environment), never processes or memory: ``X-Dsec-Snapshot-Kind: files``. Pure
helpers; the routes are in compat/e2b/control.py.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from compat.e2b import mapping
from compat.e2b.http import HttpError
from libdsec import Environment

#: The environment namespace of a project's snapshots (apiserver/snapshots.py).
PREFIX = "snapshots/"
DEFAULT_TAG = "default"
#: What a snapshot keeps (the response header, like fork's X-Dsec-Fork-Kind).
KIND = "files"
KIND_HEADER = "X-Dsec-Snapshot-Kind"
#: Provenance a packed environment's config carries (edge/backends/packing.py).
SANDBOX_KEY = "sandbox"
LABEL_PREFIX = "label."

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class SnapshotRef:
    name: str
    tag: str

    @property
    def snapshot_id(self) -> str:
        return f"{self.name}:{self.tag}"

    def environment(self, project_id: str) -> str:
        return f"{PREFIX}{project_id}/{self.name}:{self.tag}"


def parse_ref(text: str, *, strict: bool = True) -> SnapshotRef | None:
    """``name[:tag]`` (E2B's snapshot id); a ``team/`` namespace in front is dropped (dsec's
    are per project already). Not of that form: 400 when ``strict``, else None."""
    base, sep, tag = text.rpartition(":")
    if not sep:
        base, tag = text, DEFAULT_TAG
    base = base.rpartition("/")[2]
    if _NAME.fullmatch(base) and _TAG.fullmatch(tag):
        return SnapshotRef(base, tag)
    if strict:
        raise HttpError(
            400,
            f"snapshot {text!r}: expected name[:tag], name [a-z0-9][a-z0-9._-]* (at most 100), "
            "tag [A-Za-z0-9_][A-Za-z0-9._-]*",
        )
    return None


def new_ref(name: Any) -> SnapshotRef:
    """The snapshot a create makes: named (a repeat replaces the previous one of that name,
    as E2B assigns a new build to it) or ``snap-<random>``."""
    if name is None or name == "":
        return SnapshotRef(f"snap-{os.urandom(6).hex()}", DEFAULT_TAG)
    if not isinstance(name, str):
        raise HttpError(400, "name must be a string")
    ref = parse_ref(name)
    assert ref is not None
    return ref


def ref_of(env: Environment) -> SnapshotRef:
    base, _, tag = env.name.rpartition(":")
    return SnapshotRef(base.rpartition("/")[2], tag or DEFAULT_TAG)


def info_json(ref: SnapshotRef) -> dict[str, Any]:
    """E2B's ``SnapshotInfo``."""
    return {"snapshotID": ref.snapshot_id, "names": [ref.snapshot_id]}


def source_labels(env: Environment) -> dict[str, str]:
    """The labels the snapshot's source sandbox had (its E2B template, user, memory)."""
    return {k[len(LABEL_PREFIX) :]: v for k, v in env.config.items() if k.startswith(LABEL_PREFIX)}


def page(
    envs: Sequence[Environment],
    *,
    sandbox_id: str,
    name: str,
    limit: str | None,
    next_token: str | None,
) -> tuple[list[Environment], str]:
    """One page of snapshots by environment name, and the token of the next ("" if none)."""
    n = mapping.page_limit(limit)
    after = ""
    if next_token:
        try:
            after = base64.b64decode(next_token.encode(), altchars=b"-_", validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise HttpError(400, "nextToken is not one this API returned") from None
        if not after.startswith(PREFIX):
            raise HttpError(400, "nextToken is not one this API returned")
    wanted = parse_ref(name, strict=False) if name else None
    tag_given = ":" in name
    chosen = sorted(
        (
            e
            for e in envs
            if (not sandbox_id or e.config.get(SANDBOX_KEY) == sandbox_id)
            and (
                not name
                or (
                    wanted is not None
                    and ref_of(e).name == wanted.name
                    and (not tag_given or ref_of(e).tag == wanted.tag)
                )
            )
            and e.name > after
        ),
        key=lambda e: e.name,
    )
    out = chosen[:n]
    token = ""
    if len(chosen) > n:
        token = base64.urlsafe_b64encode(out[-1].name.encode()).decode()
    return out, token
