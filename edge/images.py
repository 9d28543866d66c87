"""Image names -> read-only lower layers on this node.

Until the layer store (content-addressed EROFS layers, on-demand loading)
arrives, an image is one flat layer in the image directory:

- ``<name>.erofs``: an EROFS image (mounted file-backed, shared by every
  sandbox on the node), or ``<name>.rootfs/``: a plain directory;
- ``docker:<repo>[:<tag>]``: an image of the local Docker engine, imported on
  first use (``docker create`` + ``docker export`` -> unpack -> mkfs.erofs)
  into ``<image_dir>/docker/<digest>.erofs``, keyed by the Docker image id, so
  a re-tagged image with the same content is not imported twice. Its config
  (Env, WorkingDir) becomes the sandbox's defaults.

Unknown names fail fast with IMAGE_NOT_FOUND at admission, before anything
is created.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libdsec.errors import ImageNotFound, InvalidArgument, Unavailable

log = logging.getLogger(__name__)

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
DOCKER_REF = re.compile(r"^[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9._-]+)?(@sha256:[0-9a-f]{64})?$")


@dataclass(frozen=True)
class ResolvedImage:
    name: str
    lowers: list[Path]  # top-most first
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""


class ImageResolver:
    def __init__(self, image_dir: Path, default_image: str = "bookworm") -> None:
        self.image_dir = image_dir
        self.default_image = default_image
        self._docker_lock = threading.Lock()

    def resolve(self, name: str) -> ResolvedImage:
        """Blocking (a Docker import can take seconds): call through asyncio.to_thread."""
        name = name or self.default_image
        if name.startswith("docker:"):
            return self._docker(name.removeprefix("docker:"))
        if not NAME.match(name.split(":")[0]):
            raise InvalidArgument(f"image name {name!r} is not valid", reason="INVALID_IMAGE")
        base = name.split(":")[0] if name.endswith(":latest") else name.replace(":", "-")
        image = self.image_dir / f"{base}.erofs"
        if image.is_file():
            return ResolvedImage(name, [image])
        rootfs = self.image_dir / f"{base}.rootfs"
        if rootfs.is_dir():
            return ResolvedImage(name, [rootfs])
        raise ImageNotFound(
            f"image {name!r} not found (looked for {image} and {rootfs}; "
            f"Docker images are named 'docker:<repo>:<tag>')",
            metadata={"image": name},
        )

    def check(self, name: str) -> None:
        """Raises ImageNotFound/InvalidArgument unless ``name`` can be resolved (no import)."""
        name = name or self.default_image
        if name.startswith("docker:"):
            self._inspect(name.removeprefix("docker:"))
        else:
            self.resolve(name)

    def known(self) -> list[str]:
        names = {p.name.removesuffix(".erofs") for p in self.image_dir.glob("*.erofs")}
        names |= {
            p.name.removesuffix(".rootfs") for p in self.image_dir.glob("*.rootfs") if p.is_dir()
        }
        return sorted(names)

    # ------------------------------------------------------------- docker

    def _inspect(self, ref: str) -> dict[str, Any]:
        if not DOCKER_REF.match(ref):
            raise InvalidArgument(
                f"docker image reference {ref!r} is not valid", reason="INVALID_IMAGE"
            )
        if shutil.which("docker") is None:
            raise Unavailable("no docker client on this node", reason="DOCKER_UNAVAILABLE")
        inspect = subprocess.run(
            ["docker", "image", "inspect", ref], capture_output=True, text=True, timeout=30
        )
        if inspect.returncode != 0:
            if "No such image" in inspect.stderr or "No such object" in inspect.stderr:
                raise ImageNotFound(
                    f"docker image {ref!r} is not in the local Docker engine",
                    metadata={"image": f"docker:{ref}"},
                )
            raise Unavailable(
                f"docker inspect failed: {inspect.stderr.strip()}", reason="DOCKER_UNAVAILABLE"
            )
        info: dict[str, Any] = json.loads(inspect.stdout)[0]
        return info

    def _docker(self, ref: str) -> ResolvedImage:
        info = self._inspect(ref)
        digest = info["Id"].removeprefix("sha256:")[:24]
        config = info.get("Config") or {}
        env = dict(e.split("=", 1) for e in (config.get("Env") or []) if "=" in e)
        workdir = config.get("WorkingDir") or ""
        target = self.image_dir / "docker" / f"{digest}.erofs"
        with self._docker_lock:
            if not target.is_file():
                self._import(ref, target)
        return ResolvedImage(f"docker:{ref}", [target], env, workdir)

    def _import(self, ref: str, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".import-", dir=target.parent))
        container = ""
        try:
            created = subprocess.run(
                ["docker", "create", ref, "/bin/true"], capture_output=True, text=True, timeout=60
            )
            if created.returncode != 0:
                raise Unavailable(
                    f"docker create {ref} failed: {created.stderr.strip()}",
                    reason="DOCKER_UNAVAILABLE",
                )
            container = created.stdout.strip()
            rootfs = tmp / "rootfs"
            rootfs.mkdir()
            # GNU tar keeps ownership, modes and special files, and refuses
            # members that would land outside the target (.. or via links).
            export = subprocess.Popen(["docker", "export", container], stdout=subprocess.PIPE)
            untar = subprocess.run(
                ["tar", "-x", "--numeric-owner", "-C", str(rootfs)],
                stdin=export.stdout,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            if export.stdout is not None:
                export.stdout.close()
            if export.wait(timeout=60) != 0 or untar.returncode != 0:
                raise Unavailable(
                    f"docker export {ref} failed: {untar.stderr.strip()[-500:]}",
                    reason="DOCKER_UNAVAILABLE",
                )
            part = tmp / "image.erofs"
            mk = subprocess.run(
                ["mkfs.erofs", "--quiet", "-zlz4hc", str(part), str(rootfs)],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if mk.returncode != 0:
                raise Unavailable(
                    f"mkfs.erofs failed: {mk.stderr.strip()}", reason="IMAGE_BUILD_FAILED"
                )
            part.rename(target)
            log.info("imported docker image %s into %s", ref, target)
        finally:
            if container:
                subprocess.run(["docker", "rm", "-f", container], capture_output=True, timeout=60)
            shutil.rmtree(tmp, ignore_errors=True)
