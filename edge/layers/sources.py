"""Imports: a directory, a tar archive, or an image of the local Docker engine -> layers.

Every import ends in `build_layer`: an unpacked tree (node-local scratch) -> mkfs.erofs into a
staging directory of the store -> hashed -> renamed into layers/<hex>. Imports are idempotent
(the build is reproducible, so the same content gives the same digest and the store keeps one
copy) and Docker layers are deduplicated before any work by their diff id (the sha256 of the
uncompressed layer tarball), remembered in the store's import cache.

Docker images are read through the Docker SDK (`docker` on PyPI): `images.get(ref)` for the
config and the diff ids, then `image.save()`, streamed: each layer tarball inside the saved
archive is hashed while it is unpacked (GNU tar), so an image is never held on disk twice and
each layer is checked against the diff id the image declares ("verified on import"). Whiteout
files are then converted to overlayfs form (tree.convert_whiteouts).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import shutil
import subprocess
import tarfile
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.layers import erofs
from edge.layers.model import (
    ENV_PREFIX,
    WORKDIR_KEY,
    LayerInfo,
    LayerKind,
    LayerRef,
)
from edge.layers.node import NodeLayers
from edge.layers.store import LayerStore
from edge.layers.tree import convert_whiteouts
from libdsec.errors import ImageNotFound, InvalidArgument, LayerCorrupt, Unavailable

log = logging.getLogger(__name__)

TAR_TIMEOUT_S = 3600
DOCKER_TIMEOUT_S = 600
_DOCKER_DIFF = "docker-diff"


@dataclass(frozen=True)
class DockerImage:
    ref: str
    image_id: str
    layers: list[LayerRef]
    config: dict[str, str]
    reused: int  # layers found in the store by diff id (no work)
    built: int


class Importer:
    """Blocking; one per edge."""

    def __init__(
        self,
        store: LayerStore,
        node: NodeLayers,
        *,
        erofs_chunk_size: int = erofs.DEFAULT_EROFS_CHUNK,
        verify_chunk_size: int = erofs.DEFAULT_VERIFY_CHUNK,
    ) -> None:
        self.store = store
        self.node = node
        self.erofs_chunk_size = erofs_chunk_size
        self.verify_chunk_size = verify_chunk_size

    # ------------------------------------------------------------------ build

    def build_layer(
        self, tree: Path, *, kind: LayerKind, source: str, all_root: bool = False
    ) -> LayerInfo:
        """mkfs `tree` into the store (or find the identical layer there)."""
        staging = self.store.staging("build")
        try:
            desc = erofs.build(
                tree,
                staging / "layer",
                erofs_chunk_size=self.erofs_chunk_size,
                verify_chunk_size=self.verify_chunk_size,
                all_root=all_root,
            )
            info, added = self.store.add_layer(staging / "layer", desc, kind=kind, source=source)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.node.record_built(info.digest, written=added)
        return info

    def from_directory(
        self, path: Path, *, kind: LayerKind, source: str = "", all_root: bool = False
    ) -> LayerInfo:
        """A directory as one layer, as it is (already in overlayfs form, if it has deletions)."""
        if not path.is_dir():
            raise InvalidArgument(f"{path} is not a directory", reason="INVALID_SOURCE")
        return self.build_layer(path, kind=kind, source=source or f"dir:{path}", all_root=all_root)

    def from_tar(self, path: Path, *, kind: LayerKind, source: str = "") -> LayerInfo:
        """A tar archive (plain or compressed) as one layer; OCI whiteouts are converted."""
        if not path.is_file():
            raise InvalidArgument(f"{path} is not a file", reason="INVALID_SOURCE")
        scratch = self.node.scratch("tar")
        try:
            tree = scratch / "tree"
            tree.mkdir()
            started = unpack_start()
            r = subprocess.run(
                [*_tar_extract(tree), "-f", os.fspath(path)],
                capture_output=True,
                text=True,
                timeout=TAR_TIMEOUT_S,
            )
            if r.returncode != 0:
                raise InvalidArgument(
                    f"cannot unpack {path}: {r.stderr.strip()[-500:]}", reason="INVALID_SOURCE"
                )
            normalize_tree(tree, started)
            convert_whiteouts(tree)
            return self.build_layer(tree, kind=kind, source=source or f"tar:{path}")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    # ----------------------------------------------------------------- docker

    def _docker(self) -> Any:
        try:
            import docker  # the Docker SDK; imported on use (a node may have no engine)
        except ImportError:
            raise Unavailable(
                "the docker SDK is not installed on this node", reason="DOCKER_UNAVAILABLE"
            ) from None
        try:
            return docker.from_env(timeout=DOCKER_TIMEOUT_S)
        except docker.errors.DockerException as exc:
            raise Unavailable(
                f"no Docker engine reachable on this node: {exc}", reason="DOCKER_UNAVAILABLE"
            ) from None

    def docker_inspect(self, ref: str) -> dict[str, Any]:
        """The engine's view of an image (raises ImageNotFound / Unavailable)."""
        import docker

        client = self._docker()
        try:
            attrs: dict[str, Any] = client.images.get(ref).attrs
            return attrs
        except docker.errors.ImageNotFound:
            raise ImageNotFound(
                f"docker image {ref!r} is not in the local Docker engine",
                metadata={"image": f"docker:{ref}"},
            ) from None
        except docker.errors.DockerException as exc:
            raise Unavailable(
                f"docker inspect {ref} failed: {exc}", reason="DOCKER_UNAVAILABLE"
            ) from None
        finally:
            client.close()

    def docker_pull(self, ref: str) -> dict[str, Any]:
        """Pulls ``ref`` into the engine (a machine that reaches its registry) and returns its
        view of it; ImageNotFound naming the image and the engine's reason otherwise."""
        import docker

        client = self._docker()
        try:
            client.images.pull(ref)
            attrs: dict[str, Any] = client.images.get(ref).attrs
            return attrs
        except docker.errors.DockerException as exc:
            why = getattr(exc, "explanation", None) or str(exc)
            raise ImageNotFound(
                f"docker image {ref!r} is not in the local Docker engine, and pulling it "
                f"failed: {why}",
                metadata={"image": f"docker:{ref}"},
            ) from None
        finally:
            client.close()

    def from_docker(self, ref: str, pins: set[str] | None = None) -> DockerImage:
        """Import every layer of a Docker image (those not in the store yet)."""
        import docker

        attrs = self.docker_inspect(ref)
        image_id = str(attrs["Id"])
        diff_ids = [str(d) for d in (attrs.get("RootFS") or {}).get("Layers") or []]
        if not diff_ids:
            raise InvalidArgument(f"docker image {ref} has no layers", reason="INVALID_SOURCE")
        found: dict[str, str] = {}
        for d in diff_ids:
            digest = self.store.source_get(_DOCKER_DIFF, d.removeprefix("sha256:"))
            if digest is not None:
                found[d] = digest
                if pins is not None:
                    pins.add(digest)
        reused = len(found)
        missing = set(diff_ids) - set(found)
        if missing:
            client = self._docker()
            try:
                image = client.images.get(image_id)
                stream = _ChunkStream(image.save(named=False))
                with tarfile.open(fileobj=stream, mode="r|") as outer:
                    for member in outer:
                        if not missing:
                            break
                        if not member.isfile() or not _maybe_layer(member.name):
                            continue
                        fileobj = outer.extractfile(member)
                        if fileobj is None:
                            continue
                        got = self._docker_layer(ref, fileobj, missing)
                        if got is not None:
                            diff_id, digest = got
                            found[diff_id] = digest
                            missing.discard(diff_id)
                            if pins is not None:
                                pins.add(digest)
            except docker.errors.DockerException as exc:
                raise Unavailable(
                    f"docker save {ref} failed: {exc}", reason="DOCKER_UNAVAILABLE"
                ) from None
            finally:
                client.close()
        if missing:
            raise LayerCorrupt(
                f"docker image {ref}: the saved image has no layer matching diff id(s) "
                f"{sorted(missing)} (corrupt export?)",
                metadata={"image": f"docker:{ref}", "layer": sorted(missing)[0]},
            )
        config = docker_config(attrs)
        return DockerImage(
            ref=ref,
            image_id=image_id,
            layers=[LayerRef(found[d], LayerKind.BASE) for d in diff_ids],
            config=config,
            reused=reused,
            built=len(diff_ids) - reused,
        )

    def _docker_layer(
        self, ref: str, fileobj: io.BufferedReader | Any, wanted: set[str]
    ) -> tuple[str, str] | None:
        """Unpack one candidate member of the saved archive while hashing it; build a layer if
        its hash is a diff id we still need. Returns (diff id, layer digest) or None."""
        head = fileobj.read(512)
        gzipped = head[:2] == b"\x1f\x8b"
        if not gzipped and head[257:262] != b"ustar" and any(head):
            return None  # a JSON config or manifest of an OCI layout, not a layer
        scratch = self.node.scratch("docker")
        try:
            tree = scratch / "tree"
            tree.mkdir()
            started = unpack_start()
            diff_id = _unpack_stream(_chain(head, fileobj), tree, gzipped=gzipped)
            if diff_id not in wanted:
                return None
            normalize_tree(tree, started)
            convert_whiteouts(tree)
            info = self.build_layer(tree, kind=LayerKind.BASE, source=f"docker:{ref}@{diff_id}")
            self.store.source_put(_DOCKER_DIFF, diff_id.removeprefix("sha256:"), info.digest)
            return diff_id, info.digest
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def docker_config(attrs: dict[str, Any]) -> dict[str, str]:
    """Environment config from a Docker image's: Env, WorkingDir, and where it came from."""
    cfg = attrs.get("Config") or {}
    out = {"source": "docker", "docker_image_id": str(attrs.get("Id", ""))}
    for item in cfg.get("Env") or []:
        k, sep, v = str(item).partition("=")
        if sep and k:
            out[ENV_PREFIX + k] = v
    if cfg.get("WorkingDir"):
        out[WORKDIR_KEY] = str(cfg["WorkingDir"])
    for key in ("Entrypoint", "Cmd", "User"):
        if cfg.get(key):
            out[key.lower()] = str(cfg[key])
    return out


def _maybe_layer(name: str) -> bool:
    return name.endswith("/layer.tar") or name.startswith("blobs/sha256/")


def _tar_extract(dest: Path) -> list[str]:
    # GNU tar as root keeps owners, modes, special files and xattrs; it refuses members that
    # would land outside `dest` (".." or absolute names) and creates symlinks last, so no
    # member can be written through one.
    return [
        "tar",
        "-x",
        "--numeric-owner",
        "--same-owner",
        "--same-permissions",
        "--xattrs",
        "--xattrs-include=*",
        "-C",
        os.fspath(dest),
    ]


def _unpack_stream(chunks: Iterable[bytes], dest: Path, *, gzipped: bool) -> str:
    """Pipe a tar stream into GNU tar; returns "sha256:<hex>" of the uncompressed tar."""
    h = hashlib.sha256()
    inflate = zlib.decompressobj(wbits=31) if gzipped else None
    proc = subprocess.Popen(
        _tar_extract(dest), stdin=subprocess.PIPE, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL
    )
    assert proc.stdin is not None and proc.stderr is not None
    broken = False
    try:
        for chunk in chunks:
            data = inflate.decompress(chunk) if inflate is not None else chunk
            h.update(data)
            if not broken:
                try:
                    proc.stdin.write(data)
                except BrokenPipeError:
                    broken = True  # keep hashing; tar's error is reported below
        if inflate is not None:
            tail = inflate.flush()
            h.update(tail)
            if not broken:
                with contextlib.suppress(BrokenPipeError):
                    proc.stdin.write(tail)
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
        err = proc.stderr.read().decode(errors="replace")
        rc = proc.wait(timeout=TAR_TIMEOUT_S)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        proc.stderr.close()
    if rc != 0:
        raise InvalidArgument(
            f"cannot unpack a layer tarball: {err.strip()[-500:]}", reason="INVALID_SOURCE"
        )
    return "sha256:" + h.hexdigest()


def unpack_start() -> int:
    """A timestamp every directory created by an unpack that starts now is newer than, while
    every mtime taken from an archive is older. File timestamps come from the kernel's coarse
    clock, which lags time.time_ns() by up to a tick; waiting two ticks covers that."""
    started = time.time_ns()
    time.sleep(0.025)
    return started


def normalize_tree(root: Path, started_ns: int) -> None:
    """Make an unpacked tree reproducible: directories the archive did not list (their mtime
    is the time of unpacking) get mtime 0, and the root is 0755 root:root with mtime 0 (a lower
    layer's root attributes never show through overlayfs; the upper's do)."""
    for dirpath, _dirnames, _ in os.walk(root):
        st = os.lstat(dirpath)
        if st.st_mtime_ns >= started_ns:
            os.utime(dirpath, ns=(0, 0), follow_symlinks=False)
    os.chown(root, 0, 0)
    os.chmod(root, 0o755)
    os.utime(root, ns=(0, 0))


def _chain(head: bytes, rest: Any, size: int = 1 << 20) -> Iterator[bytes]:
    if head:
        yield head
    while chunk := rest.read(size):
        yield chunk


class _ChunkStream(io.RawIOBase):
    """A file object over an iterator of byte chunks (docker's save stream)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it = iter(chunks)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            try:
                self._buf = next(self._it)
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n
