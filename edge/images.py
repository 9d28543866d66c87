"""Image names -> the verified, read-only layer stack of a sandbox on this node.

An image name is an environment of the layer store (``edge.layers``): ``name[:tag]`` (e.g.
``busybox``, ``swe-bench/django:v2``), or ``docker:<repo>[:<tag>]``, an image of the local
Docker engine imported per layer on first use (and again when the engine's image changes). The
flat base images of the image directory (``<name>.erofs`` / ``<name>.rootfs``, built by
scripts/build-base-images.sh) are imported into the store on first use too, so ``busybox`` and
``bookworm`` work on a fresh store.

Given a directory instead of an ``Environments``, the resolver serves the flat images of that
directory as they are (one layer each, no store): what the FnCall warm pools use for their fixed
runtime images.

Resolution also verifies every layer on its first use on the node and copies its metadata
image to local disk, so it runs at admission (``check``): an unknown name fails with NOT_FOUND
(IMAGE_NOT_FOUND), a missing layer with NOT_FOUND (LAYER_NOT_FOUND, naming it), a corrupt one
with FAILED_PRECONDITION (LAYER_CORRUPT), an unreachable store with UNAVAILABLE
(STORE_UNAVAILABLE), all before anything is created.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from edge.layers import Environments, LayerRef
from edge.runtime.mounts import Layer, LayerImage
from libdsec.errors import ImageNotFound, InvalidArgument

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedImage:
    name: str  # the environment's canonical name:tag
    lowers: list[Layer]  # top-most first (overlayfs order)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    layers: list[LayerRef] = field(default_factory=list)  # bottom first


class ImageResolver:
    """Blocking (first use of a layer hashes it; a Docker import takes seconds): call through
    asyncio.to_thread."""

    def __init__(self, source: Environments | Path, default_image: str = "bookworm") -> None:
        self.environments = source if isinstance(source, Environments) else None
        self.image_dir = source if isinstance(source, Path) else None
        self.default_image = default_image

    def resolve(self, name: str, toolkits: Sequence[str] = ()) -> ResolvedImage:
        if self.environments is None:
            return self._flat(name or self.default_image)
        r = self.environments.resolve(name, list(toolkits))
        lowers: list[Layer] = list(r.lowers)
        return ResolvedImage(r.name, lowers, r.env, r.workdir, r.layers)

    def _flat(self, name: str) -> ResolvedImage:
        assert self.image_dir is not None
        if not _FLAT_NAME.match(name.split(":")[0]):
            raise InvalidArgument(f"image name {name!r} is not valid", reason="INVALID_IMAGE")
        stem = name.split(":")[0] if name.endswith(":latest") else name.replace(":", "-")
        image = self.image_dir / f"{stem}.erofs"
        if image.is_file():
            return ResolvedImage(name, [LayerImage(image)])
        rootfs = self.image_dir / f"{stem}.rootfs"
        if rootfs.is_dir():
            return ResolvedImage(name, [rootfs])
        raise ImageNotFound(
            f"image {name!r} not found (looked for {image} and {rootfs})",
            metadata={"image": name},
        )

    def check(self, name: str, toolkits: Sequence[str] = ()) -> None:
        """Raises unless ``name`` (+ toolkits) resolves to verified layers."""
        self.resolve(name, toolkits)

    def known(self) -> list[str]:
        if self.environments is None:
            assert self.image_dir is not None
            return sorted(p.name.removesuffix(".erofs") for p in self.image_dir.glob("*.erofs"))
        return [e.name for e in self.environments.list_environments()]


_FLAT_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
