"""Environments on an edge: resolve names to verified layers, import, pack, collapse, collect.

The one object the edge's container backend and gRPC adapter use; everything below it (store,
node cache, importers) stays plain domain code. All methods block (file I/O, mkfs, hashing):
call them through asyncio.to_thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from edge.layers import erofs
from edge.layers.diff import snapshot
from edge.layers.model import (
    Environment,
    LayerInfo,
    LayerKind,
    LayerRef,
    canonical_name,
    stack,
)
from edge.layers.node import NodeLayers
from edge.layers.sources import Importer
from edge.layers.store import GcReport, LayerStore
from edge.layers.tree import CopyStats, apply_layer
from edge.runtime.mounts import LayerImage
from libdsec.errors import ImageNotFound, InvalidArgument

log = logging.getLogger(__name__)

DOCKER_PREFIX = "docker:"
#: Environment names under which Docker images are registered: docker/<repo>:<tag>.
DOCKER_NAMESPACE = "docker/"
_DOCKER_REF = re.compile(r"^[a-z0-9][a-z0-9._/:-]*(@sha256:[0-9a-f]{64})?$")


def _open_lock_file(path: Path, attempts: int = 100) -> int:
    """Opens (creating it if need be) a lock file on the store. A shared file system's
    create racing another node's create of the same name can fail with EEXIST even without
    O_EXCL (seen on MooseFS: three edges importing one image at once): the file exists by
    then, so the open is simply tried again."""
    for _ in range(attempts - 1):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            time.sleep(0.01)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


@dataclass(frozen=True)
class LayerSettings:
    """How an edge uses the layer store (from EdgeConfig)."""

    store_root: Path
    cache_dir: Path
    node_id: str = "node"
    #: "full": hash the whole blob on a layer's first use on a node (never mount a corrupt
    #: one); "sampled": size + sampled chunks, the rest in the background.
    verify: str = "full"
    erofs_chunk_size: int = erofs.DEFAULT_EROFS_CHUNK
    gc_grace_s: float = 3600.0
    store_timeout_s: float = 5.0
    #: Flat base images of the Container issue (<name>.erofs / <name>.rootfs), imported into
    #: the store on first use.
    image_dir: Path | None = None
    default_image: str = "bookworm"
    #: Extra default exclusions of pack_diff (on top of diff.DEFAULT_EXCLUDES).
    exclude: tuple[str, ...] = ()
    #: Consecutive layers of one kind smaller than this are collapsed after a Docker import
    #: (0 = never).
    collapse_below_bytes: int = 0


@dataclass(frozen=True)
class ResolvedEnvironment:
    name: str
    layers: list[LayerRef]  # bottom first
    images: list[LayerImage]  # same order, prepared (verified, metadata local)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""

    @property
    def lowers(self) -> list[LayerImage]:
        """overlayfs order: top-most first."""
        return list(reversed(self.images))


@dataclass(frozen=True)
class PackResult:
    environment: Environment
    layer: LayerInfo | None  # None when the sandbox changed nothing worth keeping
    stats: CopyStats


class Environments:
    def __init__(self, settings: LayerSettings) -> None:
        self.settings = settings
        self.store = LayerStore(settings.store_root, node_id=settings.node_id)
        self.node = NodeLayers(self.store, settings.cache_dir, verify=settings.verify)
        self.importer = Importer(self.store, self.node, erofs_chunk_size=settings.erofs_chunk_size)
        self._name_locks: dict[str, threading.Lock] = {}
        self._name_locks_lock = threading.Lock()

    def close(self) -> None:
        self.store.close()

    def check_store(self) -> None:
        """Fail fast (UNAVAILABLE, STORE_UNAVAILABLE) when the store does not answer."""
        self.store.check(self.settings.store_timeout_s)

    @contextlib.contextmanager
    def _exclusive(self, key: str) -> Iterator[None]:
        """One import of `key` at a time: in this process, and across edges sharing the store
        (flock on a file in the store's staging area)."""
        with self._name_locks_lock:
            lock = self._name_locks.setdefault(key, threading.Lock())
        with lock:
            path = self.store.tmp_dir / f".lock-{hashlib.sha256(key.encode()).hexdigest()[:24]}"
            fd = _open_lock_file(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    # ---------------------------------------------------------------- resolve

    def environment(self, image: str) -> Environment:
        """The environment an image name denotes, importing on first use what can be imported:
        `docker:<ref>` from the Docker engine, a flat base image from the image directory."""
        self.check_store()
        image = image or self.settings.default_image
        if image.startswith(DOCKER_PREFIX):
            return self._docker_environment(image.removeprefix(DOCKER_PREFIX))
        name = canonical_name(image)
        env = self.store.find_environment(name)
        legacy = self._legacy_image(name)
        if legacy is not None:
            stamp = _stamp(*legacy)
            if env is None or (
                env.config.get("source") == "image" and env.config.get("source_stamp") != stamp
            ):
                return self._import_legacy(name, *legacy, stamp=stamp)
        if env is None:
            raise ImageNotFound(
                f"environment {name!r} not found in the layer store {self.store.root}"
                + (
                    f" (nor as an image in {self.settings.image_dir})"
                    if self.settings.image_dir
                    else ""
                )
                + "; Docker images are named 'docker:<repo>:<tag>'",
                metadata={"image": image},
            )
        return env

    def resolve(self, image: str, toolkits: list[str] | None = None) -> ResolvedEnvironment:
        """Name + toolkits -> the verified layer stack a sandbox mounts (blocking).

        Raises ImageNotFound (unknown name), LayerNotFound (a layer the environment names is
        missing), LayerCorrupt (a layer fails verification), Unavailable (store unreachable).
        """
        env = self.environment(image)
        extra: list[LayerRef] = []
        for tk in toolkits or []:
            tk_env = self.environment(tk)
            extra += [LayerRef(r.digest, LayerKind.TOOLKIT) for r in tk_env.layers]
        layers = stack(list(env.layers), extra)
        images = []
        for ref in layers:
            try:
                images.append(self.node.prepare(ref.digest))
            except Exception as exc:
                meta = getattr(exc, "metadata", None)
                if isinstance(meta, dict):
                    meta.setdefault("environment", env.name)
                raise
        return ResolvedEnvironment(env.name, layers, images, env.env, env.workdir)

    # ---------------------------------------------------------------- docker

    def docker_env_name(self, ref: str) -> str:
        repo, at, digest = ref.partition("@")
        base, sep, tag = repo.rpartition(":")
        if not sep or "/" in tag:
            base, tag = repo, "latest"
        if at:
            tag = digest.replace(":", "-")
        return canonical_name(f"{DOCKER_NAMESPACE}{base}:{tag}")

    def _docker_environment(self, ref: str, name: str = "") -> Environment:
        if not _DOCKER_REF.match(ref):
            raise InvalidArgument(
                f"docker image reference {ref!r} is not valid", reason="INVALID_IMAGE"
            )
        name = name or self.docker_env_name(ref)
        try:
            attrs = self.importer.docker_inspect(ref)
        except ImageNotFound:
            attrs = self.importer.docker_pull(ref)  # a machine that reaches the registry
        env = self.store.find_environment(name)
        if env is not None and env.config.get("docker_image_id") == attrs["Id"]:
            return env
        with self._exclusive(f"docker:{attrs['Id']}:{name}"):
            env = self.store.find_environment(name)
            if env is not None and env.config.get("docker_image_id") == attrs["Id"]:
                return env
            with self.node.pinned() as pins:
                t0 = time.monotonic()
                img = self.importer.from_docker(ref, pins)
                env = Environment(name, tuple(img.layers), {**img.config, "image": ref})
                env = self.store.put_environment(env)
                log.info(
                    "imported docker:%s as %s: %d layers (%d built, %d already in the store) "
                    "in %.1f s",
                    ref,
                    name,
                    len(img.layers),
                    img.built,
                    img.reused,
                    time.monotonic() - t0,
                )
                if self.settings.collapse_below_bytes:
                    env = self.collapse(name, self.settings.collapse_below_bytes)
            return env

    # ------------------------------------------------------- flat base images

    def _legacy_image(self, name: str) -> tuple[Path, Path | None] | None:
        """(rootfs dir or .erofs file, .sha256 stamp file) of a flat base image, if any."""
        d = self.settings.image_dir
        if d is None:
            return None
        base, _, tag = name.partition(":")
        if "/" in base:
            return None
        stem = base if tag == "latest" else f"{base}-{tag}"
        rootfs, image, stamp = d / f"{stem}.rootfs", d / f"{stem}.erofs", d / f"{stem}.sha256"
        if image.is_file():
            return (rootfs if rootfs.is_dir() else image), (stamp if stamp.is_file() else None)
        if rootfs.is_dir():
            return rootfs, None
        return None

    def _import_legacy(
        self, name: str, source: Path, stamp_file: Path | None, *, stamp: str
    ) -> Environment:
        with self._exclusive(f"image:{name}"):
            env = self.store.find_environment(name)
            if env is not None and env.config.get("source_stamp") == stamp:
                return env
            t0 = time.monotonic()
            # Every file keeps its owner: the flat images are built as root, and one with
            # files of another account (e2b-base's /home/user, uid 1000's) needs them kept.
            with self.node.pinned() as pins:
                if source.is_dir():
                    info = self.importer.from_directory(
                        source, kind=LayerKind.BASE, source=f"image:{source}"
                    )
                else:
                    with self.node.mounted(LayerImage(source)) as tree:
                        info = self.importer.from_directory(
                            tree, kind=LayerKind.BASE, source=f"image:{source}"
                        )
                pins.add(info.digest)
                env = self.store.put_environment(
                    Environment(
                        name,
                        (LayerRef(info.digest, LayerKind.BASE),),
                        {"source": "image", "source_stamp": stamp, "image": os.fspath(source)},
                    )
                )
            log.info(
                "imported base image %s from %s in %.1f s", name, source, time.monotonic() - t0
            )
            return env

    def import_base_images(self, names: list[str] | None = None) -> list[Environment]:
        """Import the flat base images of the image directory (all, or `names`)."""
        d = self.settings.image_dir
        if d is None or not d.is_dir():
            return []
        if names is None:
            names = sorted(
                {p.name.removesuffix(".erofs") for p in d.glob("*.erofs")}
                | {p.name.removesuffix(".rootfs") for p in d.glob("*.rootfs") if p.is_dir()}
            )
        return [self.environment(n) for n in names]

    # ----------------------------------------------------------------- import

    def import_source(
        self,
        source: str,
        name: str = "",
        *,
        kind: LayerKind | None = None,
        base: str = "",
        all_root: bool = False,
    ) -> Environment:
        """Import `source` and register it as environment `name`.

        source: "docker:<ref>" (every layer of the image; `name` defaults to docker/<ref>),
        "dir:<path>" or "tar:<path>" (one layer of `kind`, default base; with `base`, the new
        environment is that environment's layers plus this one, e.g. a workspace or a toolkit
        on top of a base image).
        """
        self.check_store()
        scheme, sep, rest = source.partition(":")
        if not sep or not rest:
            raise InvalidArgument(
                f"import source {source!r}: expected docker:<ref>, dir:<path> or tar:<path>",
                reason="INVALID_SOURCE",
            )
        if scheme == "docker":
            if base:
                raise InvalidArgument("a Docker image is a base itself", reason="INVALID_SOURCE")
            return self._docker_environment(rest, canonical_name(name) if name else "")
        if scheme not in ("dir", "tar"):
            raise InvalidArgument(
                f"import source scheme {scheme!r}: expected docker, dir or tar",
                reason="INVALID_SOURCE",
            )
        if not name:
            raise InvalidArgument("a name is required to import a directory or an archive")
        name = canonical_name(name)
        kind = kind or (LayerKind.WORKSPACE if base else LayerKind.BASE)
        path = Path(rest)
        if not path.is_absolute():
            raise InvalidArgument(f"{rest!r} must be an absolute path", reason="INVALID_SOURCE")
        parent = self.environment(base) if base else None
        with self.node.pinned(r.digest for r in (parent.layers if parent else ())) as pins:
            if scheme == "dir":
                info = self.importer.from_directory(path, kind=kind, all_root=all_root)
            else:
                info = self.importer.from_tar(path, kind=kind)
            pins.add(info.digest)
            layers = [*(parent.layers if parent else ()), LayerRef(info.digest, kind)]
            config = dict(parent.config) if parent else {}
            config.update({"source": source})
            if parent is not None:
                config["parent"] = parent.name
            return self.store.put_environment(Environment(name, tuple(stack(layers, [])), config))

    def compose(
        self,
        name: str,
        *,
        base: str,
        workspace: str = "",
        toolkits: list[str] | None = None,
    ) -> Environment:
        """A new environment from existing ones: base + workspace + toolkits. Replacing one
        toolkit is composing again with another: no layer is rebuilt."""
        self.check_store()
        b = self.environment(base)
        layers = list(b.layers)
        if workspace:
            # a workspace environment made on top of the base shares its layers: add the rest
            have = {r.digest for r in layers}
            layers += [
                LayerRef(r.digest, LayerKind.WORKSPACE)
                for r in self.environment(workspace).layers
                if r.digest not in have
            ]
        tks = [
            LayerRef(r.digest, LayerKind.TOOLKIT)
            for t in toolkits or []
            for r in self.environment(t).layers
        ]
        config = {**b.config, "parent": b.name}
        return self.store.put_environment(
            Environment(canonical_name(name), tuple(stack(layers, tks)), config)
        )

    # -------------------------------------------------------------- pack_diff

    def pack_diff(
        self,
        *,
        upper: Path,
        layers: list[LayerRef],
        config: dict[str, str],
        name: str,
        source: str,
        exclude: list[str] | None = None,
        default_excludes: bool = True,
        mountpoints: list[str] | None = None,
        freeze: contextlib.AbstractContextManager[object] | None = None,
    ) -> PackResult:
        """Checkpoint a writable layer as a new environment: `layers` + the diff.

        The upper directory is copied (without residue) while `freeze` is held, so the sandbox
        is paused only for the copy; the layer is built afterwards from the copy.
        """
        self.check_store()
        name = canonical_name(name)
        scratch = self.node.scratch("diff")
        try:
            tree = scratch / "tree"
            with freeze or contextlib.nullcontext():
                stats = snapshot(
                    upper,
                    tree,
                    exclude=[*self.settings.exclude, *(exclude or [])]
                    if default_excludes
                    else list(exclude or []),
                    default_excludes=default_excludes,
                    mountpoints=mountpoints or [],
                )
            with self.node.pinned(r.digest for r in layers) as pins:
                info: LayerInfo | None = None
                refs = list(layers)
                if any(tree.iterdir()):
                    info = self.importer.build_layer(tree, kind=LayerKind.DIFF, source=source)
                    pins.add(info.digest)
                    refs.append(LayerRef(info.digest, LayerKind.DIFF))
                env = self.store.put_environment(
                    Environment(name, tuple(refs), {**config, "source": source})
                )
            return PackResult(env, info, stats)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    # --------------------------------------------------------------- collapse

    def collapse(self, name: str, threshold_bytes: int, new_name: str = "") -> Environment:
        """Offline: squash every run of consecutive layers of one kind, each smaller than
        `threshold_bytes`, into one layer; register the result as `new_name` (default: replace
        `name`). The old layers become garbage once nothing else references them."""
        self.check_store()
        env = self.store.get_environment(name)
        sizes = {r.digest: self.store.layer_info(r.digest).size_bytes for r in env.layers}
        groups: list[list[int]] = []
        run: list[int] = []
        for i, ref in enumerate(env.layers):
            small = sizes[ref.digest] < threshold_bytes
            if small and run and env.layers[run[-1]].kind is ref.kind:
                run.append(i)
                continue
            if len(run) > 1:
                groups.append(run)
            run = [i] if small else []
        if len(run) > 1:
            groups.append(run)
        if not groups:
            return env
        out: list[LayerRef] = []
        done = 0
        with self.node.pinned(r.digest for r in env.layers) as pins:
            for group in groups:
                out += env.layers[done : group[0]]
                merged = self._squash([env.layers[i] for i in group], at_bottom=group[0] == 0)
                pins.add(merged.digest)
                out.append(LayerRef(merged.digest, env.layers[group[0]].kind))
                done = group[-1] + 1
            out += env.layers[done:]
            result = self.store.put_environment(
                Environment(canonical_name(new_name or name), tuple(out), dict(env.config))
            )
        log.info("collapsed %s: %d -> %d layers", name, len(env.layers), len(out))
        return result

    def _squash(self, refs: list[LayerRef], *, at_bottom: bool) -> LayerInfo:
        scratch = self.node.scratch("collapse")
        try:
            tree = scratch / "tree"
            tree.mkdir()
            for ref in refs:
                image = self.node.prepare(ref.digest)
                with self.node.mounted(image) as mnt:
                    apply_layer(mnt, tree, keep_whiteouts=not at_bottom)
            source = "collapse:" + ",".join(r.digest.removeprefix("sha256:")[:12] for r in refs)
            return self.importer.build_layer(tree, kind=refs[0].kind, source=source)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    # ------------------------------------------------------------------ query

    def list_environments(self, prefix: str = "") -> list[Environment]:
        self.check_store()
        return self.store.list_environments(prefix)

    def get_environment(self, name: str) -> Environment:
        self.check_store()
        return self.store.get_environment(name)

    def delete_environment(self, name: str) -> bool:
        self.check_store()
        return self.store.delete_environment(name)

    def list_layers(self) -> list[LayerInfo]:
        self.check_store()
        return self.store.list_layers()

    def layer_infos(self, env: Environment) -> list[LayerInfo]:
        out = []
        for ref in env.layers:
            info = self.store.layer_info(ref.digest)
            out.append(
                LayerInfo(
                    info.digest,
                    ref.kind,
                    info.size_bytes,
                    info.meta_bytes,
                    info.source,
                    info.created_at,
                )
            )
        return out

    # ------------------------------------------------------ recovery and gc

    def recover(self) -> list[str]:
        return self.node.recover()

    def maintain(self) -> GcReport | None:
        """One maintenance pass: publish leases, collect garbage (store and local cache),
        verify in the background what was only sampled. None if the store is unreachable."""
        if not self.store.reachable():
            return None
        self.node.refresh_leases()
        report = self.store.gc(self.settings.gc_grace_s, pinned=self.node.pins())
        self.node.gc_local()
        self.node.verify_pending()
        return report


#: How a flat base image is imported, part of its stamp: an environment imported otherwise
#: (before: every file made root's) is imported again.
_IMPORT_POLICY = "owners-kept"


def _stamp(source: Path, stamp_file: Path | None) -> str:
    """What identifies a flat base image's version: its .sha256 file, else size + mtime;
    and the import policy."""
    if stamp_file is not None:
        with contextlib.suppress(OSError):
            return f"{stamp_file.read_text().strip()}+{_IMPORT_POLICY}"
    st = source.stat()
    return f"{st.st_size}-{st.st_mtime_ns}+{_IMPORT_POLICY}"
