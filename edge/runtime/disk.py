"""Disk quota of a sandbox's writable layer: a size-limited ext4 filesystem for the upper.

Why a filesystem of its own rather than watching the upper directory grow:

- the limit is hard: a write past it fails with ENOSPC at once, whatever the write rate
  (a `yes > file` writes ~1 GB/s; a usage check every second would overshoot by that much);
- usage is O(1) to read (statvfs), where walking an upper costs O(files) per check (measured in
  bench/bench_security.py);
- the host's filesystem needs no project quotas (this machine kind's root is ext4 without them)
  and no per-sandbox setup beyond one sparse file.

Cost: a sparse copy of a template formatted once per size, a loop device and a mount at
creation (`create`: 4.4 ms p50 for the default 10 GiB, against 15.5 ms for mkfs.ext4 + `mount -o
loop` per sandbox); writes go through a loop device (their pages are cached for the image file
too). The image is sparse: a sandbox that writes little takes little. The loop device is set up
with autoclear, so the last unmount (destroy, or orphan cleanup after a crash) also frees it.

Layout under the sandbox directory: `disk.img` (the image), `disk/` (its mount point) with
`disk/upper` and `disk/work` (overlayfs needs both on one mount); `upper` is a symlink to
`disk/upper`, so whoever reads a sandbox's writable layer (pack_diff, GetModifiedFiles) finds it at
the usual place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from edge.runtime.errors import SandboxRuntimeError
from edge.runtime.mounts import MNT_DETACH, MS_NODEV, attach_loop, mount, umount, umount_quiet

MS_NOATIME = 1 << 10
log = logging.getLogger(__name__)

_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
#: One inode per 8 KiB: package trees are many small files.
BYTES_PER_INODE = 8192
#: Full means less than this much room is left (ext4 keeps a little for itself).
FULL_SLACK_BYTES = 1 << 20


@dataclass(frozen=True)
class DiskUsage:
    used_bytes: int
    total_bytes: int
    free_bytes: int
    free_inodes: int

    @property
    def full(self) -> bool:
        return self.free_bytes < FULL_SLACK_BYTES or self.free_inodes == 0


def create(sandbox_dir: Path, size_mb: int, templates: Path | None = None) -> tuple[Path, Path]:
    """Make and mount the quota filesystem; returns (upper, work) on it. Blocking.

    The image is a sparse copy of a template formatted once per size (`_template`: mkfs.ext4
    would cost a process and ~15 ms per create, the copy moves ~200 KB of metadata), attached to
    a loop device with LOOP_CONFIGURE and mounted with mount(2) (no losetup/mount processes):
    4.4 vs 15.5 ms p50 measured for the default 10 GiB. Every image shares the template's UUID,
    which the kernel does not require to be unique."""
    image = sandbox_dir / "disk.img"
    mnt = sandbox_dir / "disk"
    mnt.mkdir()
    sparse_copy(_template(templates or sandbox_dir.parent / TEMPLATES, size_mb), image)
    try:
        loop_fd, device = attach_loop(image)
    except OSError as exc:
        raise SandboxRuntimeError(f"loop device for {image}: {exc.strerror or exc}") from exc
    try:
        mount(device, mnt, "ext4", MS_NODEV | MS_NOATIME)
    finally:
        os.close(loop_fd)  # the mount holds the device now; autoclear frees it at the unmount
    upper, work = mnt / "upper", mnt / "work"
    upper.mkdir()
    work.mkdir()
    os.rmdir(mnt / "lost+found")
    return upper, work


#: Formatted template images, one per size, beside the sandboxes' writable layers (the name
#: never matches a sandbox id, so orphan cleanup leaves them alone).
TEMPLATES = ".templates"
#: Quota filesystems made ahead of the creates that take them (`Pool`), beside the templates.
POOL = ".pool"
#: The pool makes a filesystem only after this long without a create taking one.
POOL_QUIET_S = 0.1


class Pool:
    """Quota filesystems of one size made ahead of the creates that take them: a create takes a
    ready writable-layer directory (`disk.img`, and `disk/` mounted with `upper` and `work` in
    it) and renames it to its own, instead of copying, attaching and mounting on its path
    (issue 43: off the create path). A thread keeps `count` ready, making them only when no
    create has taken one for POOL_QUIET_S; a create that finds none, or asks for another size,
    makes its own as before (`create`).

    The ready ones are on the host's mount table (`count` entries, whatever the sandbox count);
    a taken one leaves it with its sandbox's `hold`. Leftovers of an earlier edge (under
    `<rw>/.pool`) are unmounted and deleted when a pool starts, and by `close`."""

    def __init__(self, rw_dir: Path, size_mb: int, count: int) -> None:
        self.dir = rw_dir / POOL
        self.templates = rw_dir / TEMPLATES
        self.size_mb = size_mb
        self.count = count
        self._ready: list[Path] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._last_take = 0.0
        self.made = 0
        self.taken = 0
        self.failures = 0
        _clear(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._fill, name="disk-pool", daemon=True)
        self._thread.start()

    def take(self, size_mb: int) -> Path | None:
        """A ready writable-layer directory of `size_mb`, now the caller's (rename it into
        place), or None."""
        if size_mb != self.size_mb:
            return None
        with self._lock:
            entry = self._ready.pop() if self._ready else None
        self._last_take = time.monotonic()
        self._wake.set()
        if entry is not None:
            self.taken += 1
        return entry

    def ready(self) -> int:
        with self._lock:
            return len(self._ready)

    def _fill(self) -> None:
        backoff = 0.0
        while not self._closed:
            if self.ready() >= self.count:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            # Only in a quiet moment: made while creates run, a filesystem competes with them
            # for the edge's interpreter and the kernel's loop and mount locks, and the creates
            # it was meant to speed up got no faster (bench/bench_containers.py, same run).
            quiet_for = time.monotonic() - self._last_take
            if quiet_for < POOL_QUIET_S:
                self._wake.wait(timeout=POOL_QUIET_S - quiet_for)
                self._wake.clear()
                continue
            entry = self.dir / os.urandom(8).hex()
            try:
                entry.mkdir()
                create(entry, self.size_mb, self.templates)
            except (OSError, SandboxRuntimeError) as exc:
                self.failures += 1
                _clear_entry(entry)
                backoff = min(max(backoff * 2, 0.1), 30.0)
                log.warning("disk pool: could not make a %d MiB filesystem: %s", self.size_mb, exc)
                self._wake.wait(timeout=backoff)
                continue
            backoff = 0.0
            with self._lock:
                if self._closed:
                    _clear_entry(entry)
                    return
                self._ready.append(entry)
                self.made += 1

    def close(self) -> None:
        """Stops the thread, unmounts and deletes every ready filesystem. Blocking."""
        with self._lock:
            self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)
        _clear(self.dir)
        with contextlib.suppress(OSError):
            self.dir.rmdir()


def _clear_entry(entry: Path) -> None:
    umount_quiet(entry / "disk")
    shutil.rmtree(entry, ignore_errors=True)


def _clear(pool_dir: Path) -> None:
    if pool_dir.is_dir():
        for entry in pool_dir.iterdir():
            _clear_entry(entry)


_template_lock = threading.Lock()


def _template(directory: Path, size_mb: int) -> Path:
    path = directory / f"{size_mb}m.img"
    if path.exists():
        return path
    with _template_lock:
        if path.exists():
            return path
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{size_mb}m.img.tmp"
        with open(tmp, "wb") as fh:
            fh.truncate(size_mb * 1024 * 1024)
        _run(
            [
                "mkfs.ext4",
                "-q",
                "-F",
                "-O",
                "^has_journal,^resize_inode",
                "-E",
                "lazy_itable_init=1,nodiscard",
                "-m",
                "0",
                "-b",
                "4096",
                "-i",
                str(BYTES_PER_INODE),
                os.fspath(tmp),
            ],
            "mkfs.ext4",
        )
        os.replace(tmp, path)
    return path


def blank_image(dst: Path, size_mb: int, templates: Path) -> None:
    """A sparse, empty ext4 image of `size_mb` at `dst`, not mounted (a VM's writable disk):
    a copy of the size's template in `templates`."""
    sparse_copy(_template(templates, size_mb), dst)


def sparse_copy(src: Path, dst: Path) -> None:
    """Copy only the data extents of `src` (SEEK_DATA/SEEK_HOLE + copy_file_range)."""
    with open(src, "rb") as s, open(dst, "wb") as d:
        size = os.fstat(s.fileno()).st_size
        d.truncate(size)
        offset = 0
        while offset < size:
            try:
                data = os.lseek(s.fileno(), offset, os.SEEK_DATA)
            except OSError:  # ENXIO: no data past offset
                break
            hole = os.lseek(s.fileno(), data, os.SEEK_HOLE)
            at, left = data, hole - data
            while left > 0:
                n = os.copy_file_range(s.fileno(), d.fileno(), left, at, at)
                if n <= 0:
                    raise OSError(f"copy_file_range {src} -> {dst} made no progress")
                at, left = at + n, left - n
            offset = hole


def mount_image(image: Path, target: Path, flags: int) -> None:
    """Mount the ext4 filesystem in `image` at `target` through a loop device of its own
    (autoclear: the unmount frees it). Blocking."""
    loop_fd, device = attach_loop(image)
    try:
        mount(device, target, "ext4", flags)
    finally:
        os.close(loop_fd)


def repair(image: Path, timeout_s: float = 300.0) -> str:
    """Check the ext4 filesystem in `image`, not mounted, and repair what is wrong (e2fsck -fy);
    returns e2fsck's report when it changed something, "" when the filesystem was clean.
    Blocking. Raises SandboxRuntimeError when errors remain (exit status 4 and up).

    For a filesystem that someone else wrote (a VM guest's disk, copied while the guest was
    stopped in the middle of its work) before the host's kernel mounts it: the copy is made
    consistent, as a journal replay would (the writable disks have no journal), and metadata
    that e2fsck finds malformed is fixed or dropped before the kernel parses it."""
    r = subprocess.run(
        ["e2fsck", "-f", "-y", os.fspath(image)],
        capture_output=True,
        text=True,
        env=_ENV,
        timeout=timeout_s,
    )
    if r.returncode >= 4:
        tail = (r.stdout + r.stderr).strip()[-2000:]
        raise SandboxRuntimeError(f"e2fsck could not repair {image} ({r.returncode}): {tail}")
    return (r.stdout + r.stderr).strip() if r.returncode else ""


def usage(root: int | Path) -> DiskUsage | None:
    """Usage of the quota filesystem whose root is `root` (a descriptor, or a mounted path), or
    None when it cannot be read."""
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    total = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    return DiskUsage(total - st.f_bfree * st.f_frsize, total, free, st.f_favail)


def hold(sandbox_dir: Path) -> int:
    """Take the mounted quota filesystem at `sandbox_dir`/disk off the mount table, keeping it
    reachable: returns an O_PATH descriptor of its root, through which the edge reads it
    (`/proc/<edge>/fd/N/upper`; statvfs). The sandbox's overlay holds its own reference, so
    the sandbox runs on; the filesystem (and its loop device, autoclear) goes when both the
    overlay and the descriptor are gone.

    Why: a mount per sandbox in the edge's namespace is a mount in every mount table runc
    reads and copies at each start (it reads mountinfo several times, and the new sandbox's
    namespace begins as a copy of the whole table): creates slowed with the sandbox count
    (issue 43). With this, the table holds no per-sandbox mount once a sandbox runs."""
    fd = os.open(sandbox_dir / "disk", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        umount(sandbox_dir / "disk", MNT_DETACH)
    except BaseException:
        os.close(fd)
        raise
    return fd


def reattach(sandbox_dir: Path) -> int:
    """`hold` again for a sandbox whose descriptor is gone (the edge restarted): mounts the
    loop device that still backs `sandbox_dir`/disk.img (the kernel gives the filesystem
    already mounted by the sandbox's overlay: the same superblock), or, when none does (the
    sandbox's processes are gone, and with them the filesystem), the image through a new one;
    then takes it off the table."""
    image = sandbox_dir / "disk.img"
    mnt = sandbox_dir / "disk"
    device = loop_devices().get(os.fspath(image))
    if device is None:
        mount_image(image, mnt, MS_NODEV | MS_NOATIME)
    else:
        mount(device, mnt, "ext4", MS_NODEV | MS_NOATIME)
    return hold(sandbox_dir)


def loop_devices() -> dict[str, str]:
    """Backing file -> loop device, of every loop device in use (/sys/block/loop*/loop)."""
    found: dict[str, str] = {}
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            path = backing.read_text().rstrip("\n")
        except OSError:
            continue
        found[path.removesuffix(" (deleted)")] = "/dev/" + backing.parent.parent.name
    return found


def _run(argv: list[str], what: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, env=_ENV, timeout=60)
    if r.returncode != 0:
        raise SandboxRuntimeError(f"{what} failed ({r.returncode}): {r.stderr.strip()}")
