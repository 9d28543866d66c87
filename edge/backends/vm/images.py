"""The full-VM backend's images: complete Debian systems built by scripts/build-vm-images.sh.

An image is a directory of the node's VM image directory (DSEC_EDGE_VM_IMAGE_DIR):

    <name>/disk.qcow2    the root filesystem (ext4, no partition table), never written: every
                         sandbox's disk is a copy-on-write overlay on it
    <name>/vmlinuz       the image's own kernel and initramfs, booted directly
    <name>/initrd.img
    <name>/image.json    {"name", "kernel_release", "root_mb", "display", "recipe", "built"}

A VM image is not a layered environment: the container and microVM backends' images (EROFS
layers in the layer store) are not bootable systems, and these are not layers. So the `image`
of a vm sandbox names one of these directories, and an unknown name is refused listing them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from libdsec.errors import InvalidArgument

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


@dataclass(frozen=True)
class VmImage:
    name: str
    dir: Path
    kernel_release: str
    root_mb: int
    display: bool
    recipe: str

    @property
    def disk(self) -> Path:
        return self.dir / "disk.qcow2"

    @property
    def kernel(self) -> Path:
        return self.dir / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.dir / "initrd.img"

    def digest(self) -> str:
        """Changes when the image is rebuilt (part of every template's key)."""
        h = hashlib.sha256(self.recipe.encode())
        for p in (self.disk, self.kernel, self.initrd):
            st = p.stat()
            h.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0".encode())
        return h.hexdigest()[:20]


class VmImages:
    def __init__(self, root: Path) -> None:
        self.root = root

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            d.name
            for d in self.root.iterdir()
            if (d / "image.json").is_file() and _NAME.match(d.name)
        )

    def get(self, name: str) -> VmImage:
        """The image `name`, or INVALID_ARGUMENT (IMAGE_NOT_FOUND) naming those there are."""
        if not _NAME.match(name or "") or not (self.root / name / "image.json").is_file():
            known = ", ".join(self.names()) or f"none: run scripts/build-vm-images.sh ({self.root})"
            raise InvalidArgument(
                f"image {name!r} is not a VM image on this edge (VM images: {known})",
                reason="IMAGE_NOT_FOUND",
                metadata={"field": "image"},
            )
        d = self.root / name
        meta = json.loads((d / "image.json").read_text())
        image = VmImage(
            name=name,
            dir=d,
            kernel_release=str(meta.get("kernel_release", "")),
            root_mb=int(meta.get("root_mb", 0)),
            display=bool(meta.get("display", False)),
            recipe=str(meta.get("recipe", "")),
        )
        for p in (image.disk, image.kernel, image.initrd):
            if not os.access(p, os.R_OK):
                raise InvalidArgument(
                    f"VM image {name!r} is incomplete: {p} is missing (rebuild it with "
                    "scripts/build-vm-images.sh)",
                    reason="IMAGE_NOT_BOOTABLE",
                    metadata={"field": "image"},
                )
        return image
