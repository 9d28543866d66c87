"""The layer store: a directory of content-addressed layers and named environments.

Its root is any directory: a local one on a single machine (default /var/lib/dsec/store), in a
cluster a shared filesystem mounted at the same path on every node (NFS, CephFS, 3FS). Only
imports, pack_diff and garbage collection write to it, never a sandbox:

    <root>/.dsec-store                  marker: the store is there (a missing one = unreachable)
    <root>/layers/<hex>/descriptor.json the layer's identity: sha256(descriptor) = its digest
                        meta.erofs      metadata image (copied to a node's local disk)
                        data.blob       data blob (read in place, on demand)
                        info.json       kind, source and time of the first import
                        unreferenced-since   set by GC when nothing references the layer
    <root>/environments/<name:tag, %-quoted>.json   an environment (see model.Environment)
    <root>/sources/<kind>/<key>         import cache, e.g. Docker layer diff id -> layer digest
    <root>/leases/<node>/<hex>          layers a node uses (mounted or being built)
    <root>/tmp/<node>-<pid>-<random>/   staging of imports, renamed into layers/ when complete

Every change is one atomic rename (a layer directory, an environment file), so a crash leaves
either the old state or the new one plus a staging directory that recovery removes. Concurrent
imports of the same content from several nodes race harmlessly: the first rename wins, the
others find the layer there and drop their copy.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from edge.layers import erofs
from edge.layers.model import (
    Descriptor,
    Environment,
    LayerInfo,
    LayerKind,
    canonical_name,
    check_digest,
)
from libdsec.errors import ImageNotFound, LayerCorrupt, LayerNotFound, Unavailable

log = logging.getLogger(__name__)

MARKER = ".dsec-store"
INFO_NAME = "info.json"
UNREFERENCED_NAME = "unreferenced-since"


#: In a layer's directory: which version of its blob a node hashed completely (see
#: edge.layers.node, ``verify="store"``).
VERIFIED_NAME = "verified.json"


def hex_of(digest: str) -> str:
    return check_digest(digest).removeprefix("sha256:")


@dataclass
class GcReport:
    removed_layers: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    marked: list[str] = field(default_factory=list)
    removed_tmp: list[str] = field(default_factory=list)
    kept_leased: list[str] = field(default_factory=list)


class LayerStore:
    """Blocking file operations on the store; call from threads (asyncio.to_thread)."""

    def __init__(self, root: Path, *, node_id: str = "node", create: bool = True) -> None:
        self.root = Path(root)
        self.node_id = node_id
        self.layers_dir = self.root / "layers"
        self.envs_dir = self.root / "environments"
        self.sources_dir = self.root / "sources"
        self.leases_dir = self.root / "leases"
        self.tmp_dir = self.root / "tmp"
        self._probe_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="store-probe"
        )
        self._probe: concurrent.futures.Future[None] | None = None
        self._probe_lock = threading.Lock()
        if create:
            self.init()

    def init(self) -> None:
        """Create the layout (idempotent). Only at startup: a store that disappears later must
        stay missing (unreachable), not be silently recreated on the local disk."""
        for d in (self.layers_dir, self.envs_dir, self.sources_dir, self.leases_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        marker = self.root / MARKER
        if not marker.exists():
            _atomic_write(marker, json.dumps({"schema": 1, "created_at": time.time()}).encode())

    # ------------------------------------------------------------ reachability

    def _stat_marker(self) -> None:
        os.stat(self.root / MARKER)

    def check(self, timeout_s: float = 5.0) -> None:
        """Raise Unavailable (STORE_UNAVAILABLE) unless the store answers within `timeout_s`.

        The probe runs on its own thread: a hung network filesystem blocks that thread, not the
        caller, and while one probe hangs every further check fails at once.
        """
        with self._probe_lock:
            probe = self._probe
            if probe is None or probe.done():
                probe = self._probe = self._probe_pool.submit(self._stat_marker)
        try:
            probe.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise Unavailable(
                f"layer store {self.root} did not answer within {timeout_s:.0f} s",
                reason="STORE_UNAVAILABLE",
                metadata={"store": os.fspath(self.root)},
            ) from None
        except OSError as exc:
            raise Unavailable(
                f"layer store {self.root} is unreachable: {exc.strerror or exc}",
                reason="STORE_UNAVAILABLE",
                metadata={"store": os.fspath(self.root)},
            ) from None

    def reachable(self) -> bool:
        return (self.root / MARKER).exists()

    def close(self) -> None:
        self._probe_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ layers

    def layer_dir(self, digest: str) -> Path:
        return self.layers_dir / hex_of(digest)

    def meta_path(self, digest: str) -> Path:
        return self.layer_dir(digest) / erofs.META_NAME

    def blob_path(self, digest: str) -> Path:
        return self.layer_dir(digest) / erofs.BLOB_NAME

    def verified_path(self, digest: str) -> Path:
        """The store's record of a full verification of the layer's blob (``verify="store"``)."""
        return self.layer_dir(digest) / VERIFIED_NAME

    def read_verified(self, digest: str) -> dict[str, Any] | None:
        return read_json(self.verified_path(digest))

    def write_verified(self, digest: str, rec: dict[str, Any]) -> None:
        _atomic_write(self.verified_path(digest), json.dumps(rec).encode())

    def has_layer(self, digest: str) -> bool:
        return (self.layer_dir(digest) / erofs.DESCRIPTOR_NAME).is_file()

    def descriptor(self, digest: str) -> Descriptor:
        """The layer's descriptor, checked against its digest."""
        path = self.layer_dir(digest) / erofs.DESCRIPTOR_NAME
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            self.check()
            raise LayerNotFound(
                f"layer {digest} is not in the store {self.root}",
                metadata={"layer": digest},
            ) from None
        try:
            desc = Descriptor.from_bytes(raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise LayerCorrupt(
                f"layer {digest}: unreadable descriptor {path}: {exc}",
                metadata={"layer": digest, "file": os.fspath(path)},
            ) from None
        if desc.digest != digest:
            raise LayerCorrupt(
                f"layer {digest}: descriptor {path} hashes to {desc.digest}",
                metadata={"layer": digest, "file": os.fspath(path)},
            )
        return desc

    def layer_info(self, digest: str) -> LayerInfo:
        desc = self.descriptor(digest)
        try:
            info = json.loads((self.layer_dir(digest) / INFO_NAME).read_text())
        except (OSError, ValueError):
            info = {}
        return LayerInfo(
            digest=digest,
            kind=LayerKind.parse(str(info.get("kind", "BASE"))),
            size_bytes=desc.meta_size + desc.blob_size,
            meta_bytes=desc.meta_size,
            source=str(info.get("source", "")),
            created_at=float(info.get("created_at", 0.0)),
        )

    def list_layers(self) -> list[LayerInfo]:
        out = []
        for d in self._layer_dirs():
            with contextlib.suppress(LayerNotFound, LayerCorrupt):
                out.append(self.layer_info("sha256:" + d.name))
        out.sort(key=lambda i: (i.created_at, i.digest))
        return out

    def _layer_dirs(self) -> list[Path]:
        try:
            return [
                d for d in self.layers_dir.iterdir() if len(d.name) == 64 and not d.name[0] == "."
            ]
        except FileNotFoundError:
            self.check()
            return []

    def staging(self, what: str = "import") -> Path:
        """A fresh staging directory on the store's filesystem (for an atomic rename later)."""
        path = self.tmp_dir / f"{self.node_id}-{os.getpid()}-{what}-{secrets.token_hex(6)}"
        path.mkdir(parents=True)
        return path

    def add_layer(
        self, built: Path, desc: Descriptor, *, kind: LayerKind, source: str
    ) -> tuple[LayerInfo, bool]:
        """Move a built layer (`built`: meta.erofs, data.blob, descriptor.json, all of them
        hashed into `desc`) into the store. Returns (info, created); an existing identical
        layer wins and `built` is removed."""
        digest = desc.digest
        target = self.layer_dir(digest)
        if self.has_layer(digest):
            shutil.rmtree(built, ignore_errors=True)
            self._touch_referenced(digest)
            return self.layer_info(digest), False
        info = {"kind": kind.value, "source": source, "created_at": time.time()}
        (built / INFO_NAME).write_text(json.dumps(info))
        (built / erofs.DESCRIPTOR_NAME).write_bytes(desc.to_bytes())
        _flush_tree(built)
        try:
            os.rename(built, target)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            shutil.rmtree(built, ignore_errors=True)  # another node got there first
            return self.layer_info(digest), False
        log.info(
            "layer %s added (%s, %d + %d bytes) from %s",
            digest,
            kind.value.lower(),
            desc.meta_size,
            desc.blob_size,
            source,
        )
        return self.layer_info(digest), True

    def _touch_referenced(self, digest: str) -> None:
        (self.layer_dir(digest) / UNREFERENCED_NAME).unlink(missing_ok=True)

    # ------------------------------------------------------------ environments

    def _env_path(self, name: str) -> Path:
        return self.envs_dir / (quote(canonical_name(name), safe="") + ".json")

    def find_environment(self, name: str) -> Environment | None:
        path = self._env_path(name)
        try:
            return Environment.from_json(path.read_bytes())
        except FileNotFoundError:
            self.check()
            return None

    def get_environment(self, name: str) -> Environment:
        env = self.find_environment(name)
        if env is None:
            raise ImageNotFound(
                f"environment {canonical_name(name)!r} is not in the layer store",
                metadata={"image": name},
            )
        return env

    def put_environment(self, env: Environment) -> Environment:
        """Register (or replace) an environment; every layer must be in the store."""
        name = canonical_name(env.name)
        for ref in env.layers:
            if not self.has_layer(ref.digest):
                raise LayerNotFound(
                    f"environment {name}: layer {ref.digest} is not in the store",
                    metadata={"layer": ref.digest, "environment": name},
                )
            self._touch_referenced(ref.digest)
        env = Environment(name, env.layers, dict(env.config), env.created_at or time.time())
        _atomic_write(self._env_path(name), env.to_json().encode())
        log.info("environment %s -> %d layers", name, len(env.layers))
        return env

    def delete_environment(self, name: str) -> bool:
        try:
            self._env_path(name).unlink()
            return True
        except FileNotFoundError:
            self.check()
            return False

    def list_environments(self, prefix: str = "") -> list[Environment]:
        out = []
        try:
            paths = sorted(self.envs_dir.glob("*.json"))
        except FileNotFoundError:
            self.check()
            return []
        for path in paths:
            name = unquote(path.name.removesuffix(".json"))
            if prefix and not name.startswith(prefix):
                continue
            try:
                out.append(Environment.from_json(path.read_bytes()))
            except (OSError, ValueError, KeyError) as exc:
                log.warning("unreadable environment %s: %s", path, exc)
        return out

    # ------------------------------------------------------------ import cache

    def source_get(self, kind: str, key: str) -> str | None:
        """A layer digest remembered for an import source (e.g. a Docker diff id), if the layer
        is still in the store."""
        try:
            digest = (self.sources_dir / kind / key).read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return digest if self.has_layer(digest) else None

    def source_put(self, kind: str, key: str, digest: str) -> None:
        if "/" in kind or "/" in key or key.startswith("."):
            raise ValueError(f"bad source cache key {kind}/{key}")
        (self.sources_dir / kind).mkdir(parents=True, exist_ok=True)
        _atomic_write(self.sources_dir / kind / key, digest.encode())

    # ------------------------------------------------------------------ leases

    def set_leases(self, digests: Iterable[str]) -> None:
        """This node's leases become exactly `digests` (layers it has mounted or is building)."""
        mine = self.leases_dir / self.node_id
        mine.mkdir(parents=True, exist_ok=True)
        want = {hex_of(d) for d in digests}
        have = {p.name for p in mine.iterdir()}
        for h in want - have:
            (mine / h).touch()
        for h in have - want:
            (mine / h).unlink(missing_ok=True)

    def add_lease(self, digest: str) -> None:
        mine = self.leases_dir / self.node_id
        path = mine / hex_of(digest)
        if not path.exists():
            mine.mkdir(parents=True, exist_ok=True)
            path.touch()

    def leased(self) -> dict[str, list[str]]:
        """digest -> nodes holding a lease on it."""
        out: dict[str, list[str]] = {}
        with contextlib.suppress(FileNotFoundError):
            for node in self.leases_dir.iterdir():
                for p in node.iterdir():
                    out.setdefault("sha256:" + p.name, []).append(node.name)
        return out

    # ---------------------------------------------------------------------- gc

    def referenced(self) -> set[str]:
        return {ref.digest for env in self.list_environments() for ref in env.layers}

    def gc(
        self, grace_s: float, *, pinned: Iterable[str] = (), now: float | None = None
    ) -> GcReport:
        """Remove layers no environment references and no node leases, once they have been
        unreferenced for `grace_s`; and staging directories older than `grace_s`.

        The first pass that finds a layer unreferenced only marks it (unreferenced-since); a
        later pass past the grace period removes it. A layer referenced again in between loses
        its mark. Removal renames the layer out of layers/ first, so nobody sees half of one.
        """
        self.check()
        now = time.time() if now is None else now
        report = GcReport()
        keep = self.referenced() | set(pinned)
        leases = self.leased()
        for d in self._layer_dirs():
            digest = "sha256:" + d.name
            mark = d / UNREFERENCED_NAME
            if digest in keep or digest in leases:
                if digest in leases and digest not in keep:
                    report.kept_leased.append(digest)
                mark.unlink(missing_ok=True)
                continue
            try:
                since = float(mark.read_text())
            except (FileNotFoundError, ValueError):
                _atomic_write(mark, str(now).encode())
                report.marked.append(digest)
                continue
            if now - since < grace_s:
                continue
            size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
            doomed = self.tmp_dir / f"gc-{d.name}-{secrets.token_hex(4)}"
            try:
                os.rename(d, doomed)
            except FileNotFoundError:
                continue  # another node collected it
            shutil.rmtree(doomed, ignore_errors=True)
            report.removed_layers.append(digest)
            report.freed_bytes += size
            log.info("gc: removed layer %s (%d bytes)", digest, size)
        with contextlib.suppress(FileNotFoundError):
            for kind in self.sources_dir.iterdir():
                for entry in kind.iterdir():
                    with contextlib.suppress(OSError):
                        if not self.has_layer(entry.read_text().strip()):
                            entry.unlink()
        with contextlib.suppress(FileNotFoundError):
            for t in self.tmp_dir.iterdir():
                if t.name.startswith(".lock-"):
                    continue  # import locks (flock), tiny and reused
                with contextlib.suppress(FileNotFoundError):
                    if now - t.lstat().st_mtime >= grace_s:
                        _remove_any(t)
                        report.removed_tmp.append(t.name)
        return report

    def remove_own_staging(self) -> list[str]:
        """After a crash: this node's staging directories are garbage (nobody else uses them)."""
        removed = []
        with contextlib.suppress(FileNotFoundError):
            for t in self.tmp_dir.iterdir():
                if t.name.startswith(f"{self.node_id}-"):
                    _remove_any(t)
                    removed.append(t.name)
        return removed


def _remove_any(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON record, or None when it is missing or unreadable (written again, never trusted)."""
    try:
        rec: dict[str, Any] = json.loads(path.read_text())
        return rec
    except (OSError, ValueError):
        return None


def _flush_tree(d: Path) -> None:
    """Every file of a built layer on the store's disks before the layer is visible: on a
    shared file system a client's write-back cache would otherwise still be sending data (and
    the file's times still moving) while other nodes mount it and check its identity."""
    for f in d.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
