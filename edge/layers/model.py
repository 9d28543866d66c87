"""What the layer store holds: layers (content-addressed EROFS images) and environments.

A *layer* is one chunked EROFS image: a small metadata image (`meta.erofs`, copied to a node's
local disk) and a data blob (`data.blob`, read from the store on demand). Its identity is the
digest of its *descriptor*, a small canonical JSON document naming the sha256 and size of the
metadata image and the size plus per-chunk sha256s of the blob. The descriptor is what a node
verifies: the metadata image completely, the blob completely or chunk by chunk. Because the
EROFS build is reproducible (see `erofs.py`), the same files give the same descriptor, so the
same content imported twice, from anywhere, is one layer.

An *environment* is a name (`name:tag`) for an ordered stack of layers, bottom first: the base
(one or more layers, e.g. a Docker image's), an optional workspace, any number of toolkits, then
the diffs `pack_diff` made. Its config carries image defaults (environment variables, working
directory) and where it came from.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from libdsec.errors import InvalidArgument

_COMPONENT = r"[a-z0-9][a-z0-9._-]{0,127}"
NAME_RE = re.compile(rf"^{_COMPONENT}(/{_COMPONENT}){{0,7}}$")
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
DEFAULT_TAG = "latest"
#: Config keys of an environment that hold image defaults; the rest is provenance.
ENV_PREFIX = "env."
WORKDIR_KEY = "workdir"
DESCRIPTOR_SCHEMA = 1


class LayerKind(enum.Enum):
    """The role of a layer in an environment; names match dsec.types.v1.LayerKind."""

    BASE = "BASE"
    WORKSPACE = "WORKSPACE"
    TOOLKIT = "TOOLKIT"
    DIFF = "DIFF"

    @property
    def rank(self) -> int:
        """Stacking order: base at the bottom, diffs on top."""
        return _RANK[self]

    @classmethod
    def parse(cls, value: str | LayerKind) -> LayerKind:
        if isinstance(value, LayerKind):
            return value
        try:
            return cls(value.upper().removeprefix("LAYER_KIND_"))
        except ValueError:
            raise InvalidArgument(
                f"layer kind {value!r} must be one of base, workspace, toolkit, diff",
                reason="INVALID_LAYER_KIND",
            ) from None


_RANK = {LayerKind.BASE: 0, LayerKind.WORKSPACE: 1, LayerKind.TOOLKIT: 2, LayerKind.DIFF: 3}


def canonical_name(name: str) -> str:
    """`name[:tag]` -> `name:tag` (tag defaults to latest); InvalidArgument if malformed.

    Names are lowercase path-like components (`swe-bench/django-11099`), tags as Docker's.
    """
    if not name:
        raise InvalidArgument("an environment name is required", reason="INVALID_IMAGE")
    base, sep, tag = name.rpartition(":")
    if not sep or "/" in tag:
        base, tag = name, DEFAULT_TAG
    if not NAME_RE.match(base) or not TAG_RE.match(tag) or ".." in base.split("/"):
        raise InvalidArgument(
            f"environment name {name!r} is not valid: expected name[:tag], name "
            "[a-z0-9][a-z0-9._-]* in up to 8 /-separated parts, tag [A-Za-z0-9_][A-Za-z0-9._-]*",
            reason="INVALID_IMAGE",
        )
    return f"{base}:{tag}"


def check_digest(digest: str) -> str:
    if not DIGEST_RE.match(digest):
        raise InvalidArgument(
            f"layer digest {digest!r} is not sha256:<64 hex>", reason="INVALID_DIGEST"
        )
    return digest


@dataclass(frozen=True)
class Descriptor:
    """The digested identity of a layer: what a node checks the store's files against."""

    meta_sha256: str
    meta_size: int
    blob_size: int
    #: Verification granularity of the blob (not the EROFS chunk size).
    blob_chunk_size: int
    blob_chunks: tuple[str, ...]
    #: EROFS --chunksize the image was built with (part of the format, so of the identity).
    erofs_chunk_size: int

    def to_bytes(self) -> bytes:
        doc = {
            "schema": DESCRIPTOR_SCHEMA,
            "meta": {"sha256": self.meta_sha256, "size": self.meta_size},
            "blob": {
                "size": self.blob_size,
                "chunk_size": self.blob_chunk_size,
                "chunks": list(self.blob_chunks),
            },
            "erofs_chunk_size": self.erofs_chunk_size,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.to_bytes()).hexdigest()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Descriptor:
        doc = json.loads(raw)
        if doc.get("schema") != DESCRIPTOR_SCHEMA:
            raise ValueError(f"unknown layer descriptor schema {doc.get('schema')!r}")
        return cls(
            meta_sha256=str(doc["meta"]["sha256"]),
            meta_size=int(doc["meta"]["size"]),
            blob_size=int(doc["blob"]["size"]),
            blob_chunk_size=int(doc["blob"]["chunk_size"]),
            blob_chunks=tuple(str(c) for c in doc["blob"]["chunks"]),
            erofs_chunk_size=int(doc["erofs_chunk_size"]),
        )


@dataclass(frozen=True)
class LayerInfo:
    """A layer as listed: identity, sizes, and the provenance of its first import."""

    digest: str
    kind: LayerKind
    size_bytes: int  # metadata + blob
    meta_bytes: int  # the part a node copies to its local disk
    source: str
    created_at: float


@dataclass(frozen=True)
class LayerRef:
    digest: str
    kind: LayerKind

    def to_dict(self) -> dict[str, str]:
        return {"digest": self.digest, "kind": self.kind.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerRef:
        return cls(check_digest(str(d["digest"])), LayerKind.parse(str(d["kind"])))


@dataclass(frozen=True)
class Environment:
    """name:tag -> layers, bottom first."""

    name: str
    layers: tuple[LayerRef, ...]
    config: dict[str, str] = field(default_factory=dict)
    created_at: float = 0.0

    @property
    def env(self) -> dict[str, str]:
        """Environment variables the image defines (e.g. a Docker image's Env)."""
        return {
            k.removeprefix(ENV_PREFIX): v
            for k, v in self.config.items()
            if k.startswith(ENV_PREFIX)
        }

    @property
    def workdir(self) -> str:
        return self.config.get(WORKDIR_KEY, "")

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "layers": [r.to_dict() for r in self.layers],
                "config": self.config,
                "created_at": self.created_at,
            },
            sort_keys=True,
            indent=1,
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> Environment:
        d = json.loads(raw)
        return cls(
            name=str(d["name"]),
            layers=tuple(LayerRef.from_dict(x) for x in d["layers"]),
            config={str(k): str(v) for k, v in (d.get("config") or {}).items()},
            created_at=float(d.get("created_at") or 0.0),
        )


def stack(layers: list[LayerRef], toolkits: list[LayerRef]) -> list[LayerRef]:
    """The composed stack, bottom first: `layers` in their own order with `toolkits` inserted
    after the last non-diff layer (diffs were taken on top of everything below them, so they
    stay on top). Toolkit layers the stack already has are skipped (a toolkit environment made on
    top of a base shares the base's layers). A layer listed twice keeps only its top-most place
    (overlayfs refuses a lower directory twice, and the top-most one is the one that shows)."""
    present = {r.digest for r in layers}
    # a toolkit environment built on a base shares that base's layers: only its own count
    toolkits = [t for t in toolkits if t.digest not in present]
    cut = len(layers)
    while cut > 0 and layers[cut - 1].kind is LayerKind.DIFF:
        cut -= 1
    ordered = [*layers[:cut], *toolkits, *layers[cut:]]
    seen: set[str] = set()
    out: list[LayerRef] = []
    for ref in reversed(ordered):
        if ref.digest not in seen:
            seen.add(ref.digest)
            out.append(ref)
    out.reverse()
    return out
