"""Reproducible chunked EROFS builds and their descriptors.

    mkfs.erofs -Enosbcrc,force-inode-extended --preserve-mtime -U<fixed> \
        --chunksize=<N> --blobdev=<out>/data.blob <out>/meta.erofs <tree>

- chunked (`--chunksize --blobdev`): file data goes to `data.blob`, everything else (inodes,
  directories, xattrs, small inline files) to `meta.erofs`, a few KiB per thousand files. A node
  copies only the metadata image and mounts it with `device=<blob in the store>` (mount(2) only;
  see edge.runtime.mounts), so data is read from the store when a file is read. Identical chunks
  are stored once (mkfs.erofs deduplicates chunks within an image). Chunked files cannot be
  compressed in erofs-utils 1.5, so blobs are uncompressed.
- reproducible: the same tree gives byte-identical output, so the same content is one layer.
  mkfs.erofs 1.5 stamps the build time into the superblock and offers only `-T` (or
  SOURCE_DATE_EPOCH), which also overwrites every file's mtime; mtimes matter (Python's .pyc
  files are validated against their source's mtime; make compares them). So mtimes are kept
  (`--preserve-mtime`), every inode is extended (each carries its own mtime rather than
  inheriting the build time, `force-inode-extended`), the superblock has no checksum
  (`nosbcrc`), and the build time is zeroed after the build. The UUID is fixed (`-U`).
  Directory order is mkfs's own (sorted), not the source's readdir order.
- mkfs.erofs keeps `trusted.*` xattrs and character devices, which is how overlayfs whiteouts
  (char 0/0) and opaque directories (trusted.overlay.opaque=y) survive in a lower layer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
from pathlib import Path

from edge.layers.model import Descriptor
from libdsec.errors import Internal

log = logging.getLogger(__name__)

META_NAME = "meta.erofs"
BLOB_NAME = "data.blob"
DESCRIPTOR_NAME = "descriptor.json"
#: EROFS chunk size: the granularity of the blob's block map and of deduplication. 1 MiB keeps
#: the block map at 8 bytes per MiB of data (a 1 GB layer has ~8 KiB of chunk indexes).
DEFAULT_EROFS_CHUNK = 1 << 20
#: Verification granularity of blobs (one sha256 per 4 MiB in the descriptor).
DEFAULT_VERIFY_CHUNK = 4 << 20
FIXED_UUID = "6473656c-6179-6572-0000-000000000001"
MKFS_TIMEOUT_S = 3600

_SB_OFFSET = 1024
_SB_MAGIC = 0xE0F5E1E2
_SB_BUILD_TIME = _SB_OFFSET + 24  # __le64 build_time, then __le32 build_time_nsec
_SB_FEATURE_COMPAT = _SB_OFFSET + 8
_SB_CHKSUM = 0x1
_READ = 1 << 20


def mkfs(tree: Path, out_dir: Path, *, erofs_chunk_size: int, all_root: bool = False) -> None:
    """Build `out_dir/meta.erofs` + `out_dir/data.blob` from `tree` (blocking)."""
    if erofs_chunk_size < 4096 or erofs_chunk_size & (erofs_chunk_size - 1):
        raise ValueError(f"EROFS chunk size {erofs_chunk_size} must be a power of two >= 4096")
    meta, blob = out_dir / META_NAME, out_dir / BLOB_NAME
    argv = [
        "mkfs.erofs",
        "--quiet",
        "-Enosbcrc,force-inode-extended",
        "--preserve-mtime",
        f"-U{FIXED_UUID}",
        f"--chunksize={erofs_chunk_size}",
        f"--blobdev={os.fspath(blob)}",
    ]
    if all_root:
        argv.append("--all-root")
    argv += [os.fspath(meta), os.fspath(tree)]
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=MKFS_TIMEOUT_S, env=env)
    if r.returncode != 0:
        # The "EXPERIMENTAL chunked file feature" warning is noise; keep the rest.
        msg = "\n".join(
            line for line in r.stderr.splitlines() if "EXPERIMENTAL" not in line
        ).strip()
        raise Internal(
            f"mkfs.erofs failed (exit {r.returncode}) on {tree}: {msg[-800:]}",
            reason="LAYER_BUILD_FAILED",
        )
    _zero_build_time(meta)


def _zero_build_time(meta: Path) -> None:
    with open(meta, "r+b") as f:
        f.seek(_SB_OFFSET)
        sb = f.read(64)
        if len(sb) < 64 or int.from_bytes(sb[:4], "little") != _SB_MAGIC:
            raise Internal(f"{meta} is not an EROFS image", reason="LAYER_BUILD_FAILED")
        if int.from_bytes(sb[8:12], "little") & _SB_CHKSUM:
            raise Internal(
                f"{meta} has a superblock checksum (mkfs.erofs ignored nosbcrc)",
                reason="LAYER_BUILD_FAILED",
            )
        f.seek(_SB_BUILD_TIME)
        f.write(bytes(12))


def sha256_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    buf = bytearray(_READ)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return h.hexdigest(), size


def chunk_hashes(path: Path, chunk_size: int) -> tuple[list[str], int]:
    """sha256 of every `chunk_size` piece of `path` (the last may be short), and the size."""
    out: list[str] = []
    size = 0
    buf = bytearray(_READ)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            h = hashlib.sha256()
            got = 0
            while got < chunk_size:
                n = f.readinto(view[: min(_READ, chunk_size - got)])
                if not n:
                    break
                h.update(view[:n])
                got += n
            if not got:
                break
            out.append(h.hexdigest())
            size += got
            if got < chunk_size:
                break
    return out, size


def describe(
    out_dir: Path, *, erofs_chunk_size: int, verify_chunk_size: int = DEFAULT_VERIFY_CHUNK
) -> Descriptor:
    """Hash a built image pair into its descriptor (reads both files once)."""
    meta_sha, meta_size = sha256_file(out_dir / META_NAME)
    chunks, blob_size = chunk_hashes(out_dir / BLOB_NAME, verify_chunk_size)
    return Descriptor(
        meta_sha256=meta_sha,
        meta_size=meta_size,
        blob_size=blob_size,
        blob_chunk_size=verify_chunk_size,
        blob_chunks=tuple(chunks),
        erofs_chunk_size=erofs_chunk_size,
    )


def build(
    tree: Path,
    out_dir: Path,
    *,
    erofs_chunk_size: int = DEFAULT_EROFS_CHUNK,
    verify_chunk_size: int = DEFAULT_VERIFY_CHUNK,
    all_root: bool = False,
) -> Descriptor:
    """mkfs + describe; also writes `out_dir/descriptor.json`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    mkfs(tree, out_dir, erofs_chunk_size=erofs_chunk_size, all_root=all_root)
    desc = describe(out_dir, erofs_chunk_size=erofs_chunk_size, verify_chunk_size=verify_chunk_size)
    (out_dir / DESCRIPTOR_NAME).write_bytes(desc.to_bytes())
    return desc
