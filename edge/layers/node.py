"""The node's side of the layer store: local metadata copies, verification, leases, recovery.

For each layer a sandbox on this node uses, the node keeps

    <cache>/meta/<hex>.erofs        the layer's metadata image, copied from the store
    <cache>/verified/<hex>.json     what was verified, against which version of the blob

and mounts `meta/<hex>.erofs` with `device=<store>/layers/<hex>/data.blob` (through
edge.runtime.mounts.LayerMounts: one shared, reference-counted mount per layer per node). So the
only bytes a layer writes to local disk are its metadata; data is read from the store when a
sandbox reads a file.

Verification happens on the first use of a layer on the node, and again whenever the blob in
the store changes (its inode, size, mtime or ctime): the metadata image is hashed while it is
copied; the blob is checked against the per-chunk sha256s of the descriptor, either completely
(`verify="full"`, the default: a corrupt or truncated blob is never mounted) or by its size
plus a sample of chunks (`verify="sampled"`: start time stays independent of the image size on
a shared filesystem; the rest is hashed in the background by `verify_pending()` and a layer that
fails is quarantined on the node), or once for the whole cluster (`verify="store"`: a node that
hashed the blob completely, the importing node included, records the blob's inode, size, mtime
and ctime in the store (`layers/<hex>/verified.json`); a node that finds that record matching the
blob as it sees it mounts the layer without reading its data, so a burst onto a new node reads
only what its sandboxes touch; otherwise it hashes the blob and records it). The node that
imports a layer records it as verified, since it has just hashed it. `store` suits a store that
checksums its own data (MooseFS, CephFS, 3FS do), where a rewritten blob changes its identity and
a decayed one fails its read instead of returning other bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import secrets
import shutil
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.layers.model import Descriptor
from edge.layers.store import LayerStore, hex_of, read_json
from edge.runtime import mounts
from edge.runtime.mounts import LayerImage
from libdsec.errors import LayerCorrupt

log = logging.getLogger(__name__)

VERIFY_MODES = ("full", "sampled", "store")
_READ = 1 << 20


@dataclass(frozen=True)
class BlobIdentity:
    """Which version of a blob file was verified: any rewrite changes one of these."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> BlobIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def shared(self) -> dict[str, int]:
        """What every node of a shared store sees alike (not the device: each client mount
        has its own)."""
        return {
            "ino": self.ino,
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "ctime_ns": self.ctime_ns,
        }

    def to_dict(self) -> dict[str, int]:
        return {
            "dev": self.dev,
            "ino": self.ino,
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "ctime_ns": self.ctime_ns,
        }


def settled_stat(path: Path) -> os.stat_result:
    """The attributes of a file this node just wrote, as every node of a shared store sees
    them. A network filesystem's writer may see times its server never stored (MooseFS keeps
    whole seconds; measured: the writer saw mtime one second later than the other nodes), so
    the times are set explicitly to whole seconds: a setattr answered by the server, whose
    reply (and ctime) every client then shares."""
    st = os.stat(path)
    whole = st.st_mtime_ns // 1_000_000_000 * 1_000_000_000
    os.utime(path, ns=(whole, whole))
    return os.stat(path)


class NodeLayers:
    """Blocking; thread-safe. One per edge (its cache directory is its own)."""

    def __init__(
        self,
        store: LayerStore,
        cache_dir: Path,
        *,
        verify: str = "full",
        sample_chunks: int = 8,
    ) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify mode {verify!r}: expected one of {VERIFY_MODES}")
        self.store = store
        self.cache_dir = Path(cache_dir)
        self.meta_dir = self.cache_dir / "meta"
        self.verified_dir = self.cache_dir / "verified"
        self.tmp_dir = self.cache_dir / "tmp"
        self.mnt_dir = self.cache_dir / "mnt"
        for d in (self.meta_dir, self.verified_dir, self.tmp_dir, self.mnt_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.verify = verify
        self.sample_chunks = sample_chunks
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self._pins: Counter[str] = Counter()
        self._pins_lock = threading.Lock()

    # ----------------------------------------------------------------- prepare

    def _lock(self, digest: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(digest, threading.Lock())

    def local_meta(self, digest: str) -> Path:
        return self.meta_dir / f"{hex_of(digest)}.erofs"

    def _record_path(self, digest: str) -> Path:
        return self.verified_dir / f"{hex_of(digest)}.json"

    def _read_record(self, digest: str) -> dict[str, Any] | None:
        return read_json(self._record_path(digest))

    def _write_record(self, digest: str, rec: dict[str, Any]) -> None:
        path = self._record_path(digest)
        tmp = path.with_suffix(f".{secrets.token_hex(4)}.tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, path)

    def prepare(self, digest: str) -> LayerImage:
        """Make `digest` mountable on this node: its metadata image local and verified, its
        blob verified. Raises LayerNotFound, LayerCorrupt, or Unavailable (store gone)."""
        with self._lock(digest):
            desc = self.store.descriptor(digest)
            blob = self.store.blob_path(digest)
            try:
                st = os.stat(blob)
            except FileNotFoundError:
                self.store.check()
                raise LayerCorrupt(
                    f"layer {digest}: data blob {blob} is missing",
                    metadata={"layer": digest, "file": os.fspath(blob)},
                ) from None
            ident = BlobIdentity.of(st)
            rec = self._read_record(digest)
            meta = self.local_meta(digest)
            if rec is not None and rec.get("blob") == ident.to_dict() and meta.is_file():
                if rec.get("corrupt"):
                    raise LayerCorrupt(
                        f"layer {digest} is quarantined on this node: {rec['corrupt']}",
                        metadata={"layer": digest, "file": os.fspath(blob)},
                    )
                if self.verify == "sampled" or rec.get("level") in ("full", "store"):
                    self.store.add_lease(digest)
                    return LayerImage(meta, blob)
            if st.st_size != desc.blob_size:
                raise LayerCorrupt(
                    f"layer {digest}: data blob {blob} is {st.st_size} bytes, the descriptor "
                    f"says {desc.blob_size} (truncated or replaced); not mounting it",
                    metadata={"layer": digest, "file": os.fspath(blob)},
                )
            self._copy_meta(digest, desc, meta)
            if self.verify == "store" and self._verified_in_store(digest, ident):
                level = "store"
            elif self.verify in ("full", "store"):
                check_blob(digest, blob, desc)
                level = "full"
                self._record_in_store(digest, ident)
            else:
                check_blob(digest, blob, desc, sample=self.sample_chunks)
                level = "sampled"
            self._write_record(
                digest, {"digest": digest, "level": level, "blob": ident.to_dict(), "corrupt": ""}
            )
            self.store.add_lease(digest)
            log.info("layer %s verified (%s) on this node", digest, level)
            return LayerImage(meta, blob)

    def _copy_meta(self, digest: str, desc: Descriptor, meta: Path) -> None:
        src = self.store.meta_path(digest)
        tmp = self.tmp_dir / f"{hex_of(digest)}.{secrets.token_hex(4)}.erofs"
        h = hashlib.sha256()
        size = 0
        try:
            with open(src, "rb") as fi, open(tmp, "wb") as fo:
                while chunk := fi.read(_READ):
                    h.update(chunk)
                    size += len(chunk)
                    fo.write(chunk)
            if h.hexdigest() != desc.meta_sha256 or size != desc.meta_size:
                raise LayerCorrupt(
                    f"layer {digest}: metadata image {src} does not match its digest "
                    f"({size} bytes, sha256 {h.hexdigest()[:16]}...; expected {desc.meta_size} "
                    f"bytes, {desc.meta_sha256[:16]}...); not mounting it",
                    metadata={"layer": digest, "file": os.fspath(src)},
                )
            os.replace(tmp, meta)
        except FileNotFoundError:
            self.store.check()
            raise LayerCorrupt(
                f"layer {digest}: metadata image {src} is missing",
                metadata={"layer": digest, "file": os.fspath(src)},
            ) from None
        finally:
            tmp.unlink(missing_ok=True)

    def _verified_in_store(self, digest: str, ident: BlobIdentity) -> bool:
        """A node hashed this very blob file completely (the store's record names its inode,
        size, mtime and ctime as every node sees them)."""
        rec = self.store.read_verified(digest)
        return rec is not None and rec.get("blob") == ident.shared()

    def _record_in_store(self, digest: str, ident: BlobIdentity) -> None:
        try:
            self.store.write_verified(
                digest, {"digest": digest, "blob": ident.shared(), "node": self.store.node_id}
            )
        except OSError as exc:  # the next node hashes it again: slower, never wrong
            log.warning("layer %s: cannot record its verification in the store: %s", digest, exc)

    def record_built(self, digest: str, *, written: bool = True) -> None:
        """The layer was just built and hashed on this node: count that as its verification.
        ``written``: this node wrote its blob into the store (not found it there)."""
        with self._lock(digest):
            desc = self.store.descriptor(digest)
            with contextlib.suppress(FileNotFoundError):
                self._copy_meta(digest, desc, self.local_meta(digest))
                blob = self.store.blob_path(digest)
                st = settled_stat(blob) if written else os.stat(blob)
                self._record_in_store(digest, BlobIdentity.of(st))
                self._write_record(
                    digest,
                    {
                        "digest": digest,
                        "level": "full",
                        "blob": BlobIdentity.of(st).to_dict(),
                        "corrupt": "",
                    },
                )

    def verify_pending(self, limit: int = 4) -> list[str]:
        """Fully verify up to `limit` layers only sampled so far; quarantine any that fails.
        Returns the digests found corrupt."""
        bad = []
        done = 0
        for path in sorted(self.verified_dir.glob("*.json")):
            if done >= limit:
                break
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if rec.get("level") != "sampled" or rec.get("corrupt"):
                continue
            digest = rec["digest"]
            done += 1
            with self._lock(digest):
                try:
                    desc = self.store.descriptor(digest)
                    blob = self.store.blob_path(digest)
                    if BlobIdentity.of(os.stat(blob)).to_dict() != rec.get("blob"):
                        continue  # changed since: the next prepare re-verifies it
                    check_blob(digest, blob, desc)
                    rec["level"] = "full"
                except LayerCorrupt as exc:
                    rec["corrupt"] = exc.message
                    bad.append(digest)
                    log.error("layer %s failed background verification: %s", digest, exc.message)
                except OSError as exc:
                    log.warning("background verification of %s skipped: %s", digest, exc)
                    continue
                self._write_record(digest, rec)
        return bad

    # -------------------------------------------------------------------- pins

    @contextlib.contextmanager
    def pinned(self, digests: Iterable[str] = ()) -> Iterator[set[str]]:
        """Keep layers safe from GC while an import or pack_diff builds an environment that
        references them (yielded set: add digests as they are built)."""
        held: set[str] = set(digests)
        with self._pins_lock:
            self._pins.update(held)
        for d in held:
            self.store.add_lease(d)
        tracker = _PinSet(self, held)
        try:
            yield tracker
        finally:
            with self._pins_lock:
                self._pins.subtract(tracker)
                self._pins += Counter()  # drop zero counts

    def pins(self) -> set[str]:
        with self._pins_lock:
            return set(self._pins)

    def _pin_more(self, digest: str) -> None:
        with self._pins_lock:
            self._pins[digest] += 1
        self.store.add_lease(digest)

    # ------------------------------------------------------- mounts and leases

    def mounted_digests(self) -> set[str]:
        """Layers this node has mounted (from the kernel's mount table, so exact after a
        restart): EROFS mounts whose source is one of our metadata copies."""
        prefix = os.fspath(self.meta_dir) + "/"
        out = set()
        for m in mounts.read_mountinfo():
            source = mounts.erofs_backing(m.source) if m.fstype == "erofs" else ""
            if source.startswith(prefix):
                name = source[len(prefix) :].removesuffix(".erofs")
                if len(name) == 64:
                    out.add("sha256:" + name)
        return out

    def refresh_leases(self) -> set[str]:
        """Publish which layers this node uses (mounted or pinned) for GC on every node."""
        using = self.mounted_digests() | self.pins()
        self.store.set_leases(using)
        return using

    @contextlib.contextmanager
    def mounted(self, image: LayerImage) -> Iterator[Path]:
        """A private, temporary read-only mount of a layer (to read its tree: collapse)."""
        target = self.mnt_dir / secrets.token_hex(6)
        target.mkdir()
        try:
            mounts.mount_erofs(image.image, target, mounts.MS_NODEV, image.blob)
            try:
                yield target
            finally:
                mounts.umount_quiet(target)
        finally:
            with contextlib.suppress(OSError):
                target.rmdir()

    def scratch(self, what: str) -> Path:
        """A node-local scratch directory (unpacked trees before mkfs)."""
        path = self.tmp_dir / f"{what}-{secrets.token_hex(6)}"
        path.mkdir()
        return path

    # -------------------------------------------------------- recovery and gc

    def recover(self) -> list[str]:
        """At start (nothing of ours runs yet): temporary mounts, scratch directories and this
        node's staging in the store are leftovers of a crash."""
        removed = []
        for m in mounts.mounts_under(self.mnt_dir):
            mounts.umount_quiet(m.mountpoint)
            removed.append(f"mount:{m.mountpoint}")
        for d in (self.mnt_dir, self.tmp_dir):
            for entry in d.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed.append(f"tmp:{entry}")
        for p in self.verified_dir.glob("*.tmp"):
            p.unlink(missing_ok=True)
        if self.store.reachable():
            removed += [f"staging:{n}" for n in self.store.remove_own_staging()]
            self.refresh_leases()
        return removed

    def gc_local(self) -> list[str]:
        """Drop metadata copies and records of layers that are neither mounted here nor in the
        store any more."""
        if not self.store.reachable():
            return []
        mounted = self.mounted_digests()
        removed = []
        for meta in self.meta_dir.glob("*.erofs"):
            digest = "sha256:" + meta.name.removesuffix(".erofs")
            if digest in mounted or self.store.has_layer(digest):
                continue
            with self._lock(digest):
                meta.unlink(missing_ok=True)
                self._record_path(digest).unlink(missing_ok=True)
            removed.append(digest)
        return removed


class _PinSet(set[str]):
    def __init__(self, owner: NodeLayers, initial: set[str]) -> None:
        super().__init__(initial)
        self._owner = owner

    def add(self, digest: str) -> None:
        if digest not in self:
            super().add(digest)
            self._owner._pin_more(digest)


def check_blob(digest: str, blob: Path, desc: Descriptor, *, sample: int | None = None) -> None:
    """Compare the blob with the descriptor's chunk hashes: all of them, or `sample` of them
    (the first, the last and random ones). Raises LayerCorrupt naming the first bad chunk."""
    n = len(desc.blob_chunks)
    if sample is None or n <= sample + 2:
        indexes = list(range(n))
    else:
        indexes = sorted({0, n - 1, *random.sample(range(1, n - 1), sample)})
    size = desc.blob_chunk_size
    buf = bytearray(_READ)
    view = memoryview(buf)
    with open(blob, "rb", buffering=0) as f:
        for i in indexes:
            f.seek(i * size)
            h = hashlib.sha256()
            want = min(size, desc.blob_size - i * size)
            got = 0
            while got < want:
                k = f.readinto(view[: min(_READ, want - got)])
                if not k:
                    break
                h.update(view[:k])
                got += k
            if got != want or h.hexdigest() != desc.blob_chunks[i]:
                raise LayerCorrupt(
                    f"layer {digest}: data blob {blob} is corrupt (chunk {i} at offset "
                    f"{i * size} does not match its sha256); not mounting it",
                    metadata={"layer": digest, "file": os.fspath(blob), "offset": str(i * size)},
                )
