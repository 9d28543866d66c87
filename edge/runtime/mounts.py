"""Mounts of the layered rootfs: shared read-only EROFS layers and per-sandbox overlays.

Everything goes through mount(2)/umount2(2) via ctypes rather than util-linux `mount`:
- util-linux puts an EROFS image on a loop device; mount(2) with a regular file as the source
  uses the kernel's file-backed EROFS mode (no loop device to allocate, leak or exhaust), and the
  chunked-blob form (`device=<blob file>`) only works this way (machine probe, item 2);
- it is ~0.2 ms per mount instead of a fork+exec of a setuid binary.

`LayerMounts` shares one mount per image between all sandboxes of the node, which is what makes
page-cache sharing (and therefore density) work: the same inodes behind every sandbox's overlay.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from edge import hostfacts
from edge.runtime.errors import LayerError, MountError, OverlayOptionsTooLongError

log = logging.getLogger(__name__)

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_BIND = 0x1000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8

# mount(2) copies at most one page of option data; the kernel truncates beyond it (and overlayfs
# then fails with a confusing EINVAL or, worse, silently drops the tail lowers).
MOUNT_DATA_MAX = os.sysconf("SC_PAGESIZE") - 1
# overlayfs refuses more lower layers than this (OVL_MAX_STACK).
OVERLAY_MAX_LOWERS = 500

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.mount.restype = ctypes.c_int
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.umount2.restype = ctypes.c_int


def _b(value: str | os.PathLike[str] | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def mount(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    fstype: str | None,
    flags: int = 0,
    data: str | None = None,
) -> None:
    """mount(2); raises `MountError` with the errno and all arguments."""
    rc = _libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data))
    if rc != 0:
        err = ctypes.get_errno()
        raise MountError(
            err,
            "mount",
            os.fspath(target),
            source=os.fspath(source),
            fstype=fstype or "",
            flags=flags,
            data=data or "",
        )


def umount(target: str | os.PathLike[str], flags: int = 0) -> None:
    """umount2(2); raises `MountError` (EINVAL: not a mount point, EBUSY: in use)."""
    rc = _libc.umount2(_b(target), flags | UMOUNT_NOFOLLOW)
    if rc != 0:
        raise MountError(ctypes.get_errno(), "umount", os.fspath(target))


_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LO_FLAGS_READ_ONLY = 1
_LO_FLAGS_AUTOCLEAR = 4
_LO_FLAGS_OFFSET = 52  # of lo_flags in struct loop_info64


def attach_loop(image: Path, *, read_only: bool = False) -> tuple[int, str]:
    """A free loop device bound to `image` with autoclear (the last close or unmount frees
    it): (its open fd, its path). LOOP_CONFIGURE (5.8): one ioctl, no losetup process."""
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    mode = os.O_RDONLY if read_only else os.O_RDWR
    flags = _LO_FLAGS_AUTOCLEAR | (_LO_FLAGS_READ_ONLY if read_only else 0)
    try:
        for _ in range(64):  # another thread may take the free device first (EBUSY)
            n = fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)
            device = f"/dev/loop{n}"
            loop_fd = os.open(device, mode | os.O_CLOEXEC)
            file_fd = os.open(image, mode | os.O_CLOEXEC)
            info = bytearray(232)  # struct loop_info64
            struct.pack_into("=I", info, _LO_FLAGS_OFFSET, flags)
            config = struct.pack("=II", file_fd, 0) + bytes(info) + bytes(64)  # loop_config
            try:
                fcntl.ioctl(loop_fd, _LOOP_CONFIGURE, config)
                return loop_fd, device
            except OSError as exc:
                os.close(loop_fd)
                if exc.errno != errno.EBUSY:
                    raise
            finally:
                os.close(file_fd)
        raise OSError(errno.EBUSY, "no free loop device after 64 tries")
    finally:
        os.close(ctl)


#: How EROFS images are mounted (`DSEC_EDGE_EROFS_MOUNT`, hostfacts.EROFS_MODES): "file",
#: mount(2) with the image file as the source (the kernel's file-backed mode,
#: CONFIG_EROFS_FS_BACKED_BY_FILE, 6.12); "loop", a read-only loop device per image and per
#: chunk blob (autoclear: the unmount frees them), for older kernels; "auto", file where the
#: kernel has it.
_erofs_mode = "auto"


def set_erofs_mode(mode: str) -> str:
    """Sets how EROFS images are mounted; returns the mode in force ("file" or "loop")."""
    global _erofs_mode
    _erofs_mode = hostfacts.resolve_erofs_mode(mode)
    return _erofs_mode


def erofs_mode() -> str:
    return _erofs_mode if _erofs_mode != "auto" else set_erofs_mode("auto")


def mount_erofs(image: Path, target: Path, flags: int, blob: Path | None = None) -> None:
    """Mounts the EROFS `image` (and its chunk `blob`) read-only at `target`, as the mode says."""
    if erofs_mode() == "file":
        data = f"device={os.fspath(blob)}" if blob is not None else None
        mount(image, target, "erofs", flags | MS_RDONLY, data)
        return
    fds: list[int] = []
    try:
        fd, device = attach_loop(image, read_only=True)
        fds.append(fd)
        data = None
        if blob is not None:
            fd, blob_device = attach_loop(blob, read_only=True)
            fds.append(fd)
            data = f"device={blob_device}"
        mount(device, target, "erofs", flags | MS_RDONLY, data)
    finally:
        for fd in fds:  # the mount holds the devices now (or, failed, nothing does: freed)
            os.close(fd)


def erofs_backing(source: str) -> str:
    """The image file behind an EROFS mount's source: the source itself (file-backed), or the
    file a loop device is bound to ("" when that device is no longer bound)."""
    if not source.startswith("/dev/loop"):
        return source
    try:
        backing = Path(f"/sys/block/{source[5:]}/loop/backing_file").read_text().strip()
    except OSError:
        return ""
    return backing


def mount_volatile(d: Path, size: str) -> None:
    """A tmpfs at `d` unless one is there (a restarted edge finds its sandboxes' state in it).

    For small per-sandbox files created and deleted with every sandbox (bundle, record, /etc
    files, runc's state and fifo, channel sockets): on this machine kind's journal-less ext4 each
    new inode skips every recently deleted one (ext4 `recently_deleted`), which after a burst of
    deletes cost ~1 ms per file created (measured; 40 us on a quiet directory). runc's own
    default root is a tmpfs (/run/runc) for the same kind of reason. Everything there dies with
    the machine, as the sandboxes do."""
    if is_mountpoint(d):
        return
    mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,size={size}")


def detach(target: str | os.PathLike[str]) -> None:
    """Take a mount off this namespace's tree now (umount2 MNT_DETACH); copies in other mount
    namespaces (a started sandbox's own root) keep the filesystem alive."""
    umount(target, MNT_DETACH)


_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_SETNS_FLAGS_NEWNS = 0x00020000  # CLONE_NEWNS
_CLONE_FS = 0x00000200
OPEN_TREE_CLONE = 1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_AT_EMPTY_PATH = 0x1000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_libc.syscall.restype = ctypes.c_long


def _check(rc: int, what: str, target: str) -> int:
    if rc < 0:
        raise MountError(ctypes.get_errno(), what, target)
    return rc


_CLONE_NEWUTS = 0x04000000
T = TypeVar("T")


def in_namespace_of(pid: int, ns: str, fn: Callable[[], T]) -> T:
    """Run `fn` in a short-lived thread that entered process `pid`'s namespace `ns` ("mnt" or
    "uts"; setns is per thread, so the process's other threads are not affected, and the thread
    ends with its switch). For "mnt" the thread first leaves the process's filesystem context
    (unshare CLONE_FS), which setns into a mount namespace requires."""
    flag = {"mnt": _SYS_SETNS_FLAGS_NEWNS, "uts": _CLONE_NEWUTS}[ns]
    result: list[T] = []
    failure: list[BaseException] = []

    def inside() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if ns == "mnt":
                    _check(_libc.unshare(_CLONE_FS), "unshare(CLONE_FS)", str(pid))
                _check(_libc.setns(fd, flag), f"setns({ns})", str(pid))
            finally:
                os.close(fd)
            result.append(fn())
        except BaseException as exc:  # re-raised in the caller's thread
            failure.append(exc)

    t = threading.Thread(target=inside, name=f"{ns}ns-{pid}")
    t.start()
    t.join()
    if failure:
        raise failure[0]
    return result[0]


def clone_in_namespace_of(pid: int, dirfd: int) -> int:
    """A detached copy (open_tree OPEN_TREE_CLONE) of the directory `dirfd` opened through
    `/proc/<pid>/root`: a mount of another mount namespace, which the kernel clones only for a
    caller inside that namespace (`in_namespace_of`). The returned descriptor (close-on-exec) can
    be attached here with `attach_detached`."""
    flags = OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | _AT_EMPTY_PATH
    return in_namespace_of(
        pid,
        "mnt",
        lambda: _check(_libc.syscall(_SYS_OPEN_TREE, dirfd, b"", flags), "open_tree", ""),
    )


def set_hostname_of(pid: int, hostname: str) -> None:
    """sethostname(2) in process `pid`'s UTS namespace (a started sandbox's)."""
    name = hostname.encode()
    in_namespace_of(
        pid,
        "uts",
        lambda: _check(
            _libc.sethostname(name, ctypes.c_size_t(len(name))), "sethostname", hostname
        ),
    )


def attach_detached(tree_fd: int, target: str | os.PathLike[str]) -> None:
    """move_mount(2) a detached tree (from `clone_in_namespace_of`) onto `target`."""
    _check(
        _libc.syscall(_SYS_MOVE_MOUNT, tree_fd, b"", -100, _b(target), _MOVE_MOUNT_F_EMPTY_PATH),
        "move_mount",
        os.fspath(target),
    )


_SYS_MOUNT_SETATTR = 442
_AT_FDCWD = -100
_MOUNT_ATTR_RDONLY = 0x1
_MOUNT_ATTR_NOSUID = 0x2
_MOUNT_ATTR_NODEV = 0x4
_MOUNT_ATTR_NOEXEC = 0x8


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _readonly_clone(source: str | os.PathLike[str]) -> int:
    """A detached, read-only (nosuid, nodev, noexec) bind of `source`: open_tree
    OPEN_TREE_CLONE, then mount_setattr on the detached tree, so it is never writable anywhere.
    Returns its descriptor (close-on-exec); closing it unmounts it if it was not attached."""
    fd = _check(
        _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, _b(source), OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC),
        "open_tree",
        os.fspath(source),
    )
    attr = _MountAttr(
        attr_set=_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV | _MOUNT_ATTR_NOEXEC
    )
    rc = _libc.syscall(
        _SYS_MOUNT_SETATTR,
        fd,
        b"",
        _AT_EMPTY_PATH,
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    if rc < 0:
        err = ctypes.get_errno()
        os.close(fd)
        raise MountError(err, "mount_setattr", os.fspath(source))
    return int(fd)


def has_mount_api(probe: str | os.PathLike[str]) -> bool:
    """Whether the kernel has the new mount API `bind_readonly_into` needs (open_tree and
    move_mount: Linux 5.2; mount_setattr: 5.12): False on ENOSYS; any other failure raises.
    Probes it on the directory `probe` (a detached clone, dropped at once)."""
    try:
        os.close(_readonly_clone(probe))
    except MountError as exc:
        if exc.errno == errno.ENOSYS:
            return False
        raise
    return True


def bind_readonly_into(pid: int, source: str | os.PathLike[str], target: str) -> None:
    """Bind the host file `source`, read-only, over `target` as process `pid`'s mount namespace
    resolves it (a started sandbox's; `target` may be inside its /proc, where runc refuses
    config mounts). No process is started: the detached mount is made here and attached by a
    thread that entered the namespace (`in_namespace_of`). Root in the sandbox, without
    CAP_SYS_ADMIN, can neither unmount nor write it."""
    fd = _readonly_clone(source)
    try:
        in_namespace_of(
            pid,
            "mnt",
            lambda: _check(
                _libc.syscall(
                    _SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, _b(target), _MOVE_MOUNT_F_EMPTY_PATH
                ),
                "move_mount",
                target,
            ),
        )
    finally:
        os.close(fd)


def umount_quiet(target: str | os.PathLike[str]) -> bool:
    """Unmount if mounted; a busy mount is detached lazily. Returns whether a mount went away.

    Lazy detach is the right fallback for our mounts: the only users of a layer or overlay mount
    at teardown are dying processes or another mount namespace's copy, and detaching makes the
    path reusable immediately while the kernel frees the superblock when the last user goes.
    """
    try:
        umount(target)
        return True
    except MountError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOENT):
            return False
        if exc.errno == errno.EBUSY:
            log.warning("mount %s busy, detaching lazily", target)
            umount(target, MNT_DETACH)
            return True
        raise


@dataclass(frozen=True)
class MountInfo:
    """One line of /proc/self/mountinfo (the fields we use)."""

    mount_id: int
    mountpoint: str
    fstype: str
    source: str
    super_options: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    if "\\" not in field:
        return field
    out = bytearray()
    i = 0
    raw = os.fsencode(field)
    while i < len(raw):
        if raw[i] == 0x5C and raw[i + 1 : i + 4].isdigit() and len(raw[i + 1 : i + 4]) == 3:
            out.append(int(raw[i + 1 : i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return os.fsdecode(bytes(out))


def read_mountinfo(path: str = "/proc/self/mountinfo") -> list[MountInfo]:
    """Parse mountinfo. The source of truth for what is mounted after a process restart."""
    result = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            lf = left.split()
            rf = right.split()
            if len(lf) < 5 or len(rf) < 3:
                continue
            result.append(
                MountInfo(
                    mount_id=int(lf[0]),
                    mountpoint=_unescape(lf[4]),
                    fstype=rf[0],
                    source=_unescape(rf[1]),
                    super_options=rf[2],
                )
            )
    return result


def mounts_under(root: Path, infos: Iterable[MountInfo] | None = None) -> list[MountInfo]:
    """Mounts at or below `root`, deepest first (the order to unmount them in)."""
    prefix = os.fspath(root).rstrip("/") + "/"
    items = [
        m
        for m in (infos if infos is not None else read_mountinfo())
        if m.mountpoint == prefix[:-1] or m.mountpoint.startswith(prefix)
    ]
    return sorted(items, key=lambda m: (m.mountpoint.count("/"), m.mount_id), reverse=True)


def is_mountpoint(path: Path, infos: Iterable[MountInfo] | None = None) -> bool:
    target = os.fspath(path).rstrip("/")
    return any(m.mountpoint == target for m in (infos if infos is not None else read_mountinfo()))


# --------------------------------------------------------------------------- overlay


def _check_overlay_path(p: Path) -> str:
    s = os.fspath(p)
    # ':' separates lowers and ',' separates options; overlayfs has an escape syntax for them
    # but our own paths never need it, so refuse instead of half-supporting it.
    if any(c in s for c in ":,\\\n"):
        raise LayerError(f"overlay path {s!r} contains one of ':' ',' '\\' or a newline")
    if not os.path.isabs(s):
        raise LayerError(f"overlay path {s!r} is not absolute")
    return s


def overlay_options(lowers: list[Path], upper: Path, work: Path) -> str:
    """The overlay mount data for `lowers` (top-most first); raises if it cannot fit in mount(2)."""
    if not lowers:
        raise LayerError("an overlay needs at least one lower layer")
    if len(lowers) > OVERLAY_MAX_LOWERS:
        raise LayerError(
            f"{len(lowers)} lower layers; overlayfs stacks at most {OVERLAY_MAX_LOWERS}"
        )
    data = (
        "lowerdir="
        + ":".join(_check_overlay_path(p) for p in lowers)
        + f",upperdir={_check_overlay_path(upper)},workdir={_check_overlay_path(work)}"
    )
    if len(data.encode()) > MOUNT_DATA_MAX:
        raise OverlayOptionsTooLongError(len(data.encode()), MOUNT_DATA_MAX, len(lowers))
    return data


def mount_overlay(lowers: list[Path], upper: Path, work: Path, target: Path) -> None:
    """Mount an overlay of `lowers` (top-most first) with a writable `upper` at `target`.

    `upper` and `work` must be empty or from a previous overlay of the same layers, on the same
    (non-overlay) filesystem. The mount is not shared with other namespaces beyond what the parent
    mount's propagation dictates; callers keep the state directory on a private mount.
    """
    mount("overlay", target, "overlay", 0, overlay_options(lowers, upper, work))


def unmount_overlay(target: Path) -> bool:
    """Unmount an overlay; returns False if nothing was mounted there."""
    return umount_quiet(target)


# --------------------------------------------------------------------------- layers


@dataclass(frozen=True)
class LayerImage:
    """An EROFS image, optionally chunked with its data in a separate blob file.

    A chunked image (`mkfs.erofs --chunksize --blobdev`) holds metadata only; mounting it without
    its blob succeeds but every read gives EIO (probe, item 2), so the blob is part of the identity.
    """

    image: Path
    blob: Path | None = None

    def key(self) -> str:
        """Stable short name of the mount: derived from the (resolved) paths, not the content,
        because hashing a multi-GB image on every acquire would dominate create latency."""
        ident = (
            os.fspath(self.image.resolve())
            + "\0"
            + (os.fspath(self.blob.resolve()) if self.blob else "")
        )
        return hashlib.sha256(ident.encode()).hexdigest()[:16]


Layer = Path | LayerImage


def as_layer(layer: Layer) -> Path | LayerImage:
    """A directory stays a Path (used as-is); a file becomes a LayerImage."""
    if isinstance(layer, LayerImage):
        return layer
    p = Path(layer)
    if p.is_dir():
        return p
    if p.is_file():
        return LayerImage(p)
    raise LayerError(f"layer {os.fspath(p)!r} is neither a directory nor an image file")


def layer_identity(layer: Layer) -> dict[str, str | None]:
    """JSON form of a layer for on-disk records (see RuncRuntime)."""
    lay = as_layer(layer)
    if isinstance(lay, LayerImage):
        return {"image": os.fspath(lay.image), "blob": os.fspath(lay.blob) if lay.blob else None}
    return {"dir": os.fspath(lay)}


def layer_from_identity(d: Mapping[str, str | None]) -> Path | LayerImage:
    if d.get("dir"):
        return Path(str(d["dir"]))
    blob = d.get("blob")
    return LayerImage(Path(str(d["image"])), Path(blob) if blob else None)


class LayerMounts:
    """Node-wide, reference-counted read-only EROFS mounts under `root/<key>`.

    Refcounts are sets of holders (sandbox ids), not integers: releasing twice for the same holder
    is a no-op, which keeps destroy() idempotent and makes recovery exact.

    Recovery after an edge restart is *derived*, not persisted: what is mounted comes from
    /proc/self/mountinfo (the kernel's truth, which survives our process), who holds what comes
    from the sandboxes' own on-disk records (written before a layer is acquired). A persisted
    counter could disagree with both after a crash between mount and write; a derived one cannot.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._holders: dict[str, set[str]] = {}

    def mountpoint(self, image: LayerImage) -> Path:
        return self.root / image.key()

    def acquire(self, layer: Layer, holder: str) -> Path:
        """Return the directory to use as a lower for `layer`, mounting the image on first use."""
        lay = as_layer(layer)
        if isinstance(lay, Path):
            return lay
        key = lay.key()
        target = self.root / key
        with self._lock:
            holders = self._holders.get(key)
            if holders is None:
                if not lay.image.is_file():
                    raise LayerError(f"layer image {os.fspath(lay.image)!r} does not exist")
                if lay.blob is not None and not lay.blob.is_file():
                    raise LayerError(f"layer blob {os.fspath(lay.blob)!r} does not exist")
                target.mkdir(parents=True, exist_ok=True)
                if not is_mountpoint(target):
                    blob = lay.blob.resolve() if lay.blob else None
                    try:
                        mount_erofs(lay.image.resolve(), target, MS_NODEV, blob)
                    except MountError:
                        _rmdir_quiet(target)
                        raise
                holders = self._holders[key] = set()
            holders.add(holder)
            return target

    def release(self, layer: Layer, holder: str) -> bool:
        """Drop `holder`'s reference; unmount when nobody holds the image. True if unmounted."""
        lay = as_layer_lenient(layer)
        if isinstance(lay, Path):
            return False
        key = lay.key()
        with self._lock:
            holders = self._holders.get(key)
            if holders is None or holder not in holders:
                return False
            holders.discard(holder)
            if holders:
                return False
            del self._holders[key]
            return self._unmount(self.root / key)

    def holders(self) -> dict[str, set[str]]:
        """Snapshot: mount key -> holders."""
        with self._lock:
            return {k: set(v) for k, v in self._holders.items()}

    def recover(self, claims: Mapping[str, Iterable[Layer]]) -> dict[str, set[str]]:
        """Rebuild holders from mountinfo and `claims` (holder -> layers it says it uses).

        A claim on an image that is not mounted is ignored (the sandbox crashed before mounting
        it, so it must not release anybody else's reference later). Mounted images nobody claims
        are kept with no holders; `unmount_unused()` removes them.
        """
        mounted = {Path(m.mountpoint).name for m in mounts_under(self.root) if m.fstype == "erofs"}
        holders: dict[str, set[str]] = {k: set() for k in mounted}
        for holder, layers in claims.items():
            for layer in layers:
                lay = as_layer_lenient(layer)
                if isinstance(lay, LayerImage) and lay.key() in holders:
                    holders[lay.key()].add(holder)
        with self._lock:
            self._holders = holders
        return {k: set(v) for k, v in holders.items()}

    def unmount_unused(self) -> list[Path]:
        """Unmount every mount (and stray directory) under root that has no holder."""
        removed: list[Path] = []
        with self._lock:
            for m in mounts_under(self.root):
                key = Path(m.mountpoint).name
                if Path(m.mountpoint).parent != self.root or self._holders.get(key):
                    continue
                self._holders.pop(key, None)
                if self._unmount(Path(m.mountpoint)):
                    removed.append(Path(m.mountpoint))
            if self.root.is_dir():
                for entry in self.root.iterdir():
                    if (
                        entry.name not in self._holders
                        and entry.is_dir()
                        and not is_mountpoint(entry)
                    ):
                        _rmdir_quiet(entry)
        return removed

    def _unmount(self, target: Path) -> bool:
        try:
            gone = umount_quiet(target)
        except MountError:
            log.exception("cannot unmount layer %s", target)
            return False
        _rmdir_quiet(target)
        return gone


def as_layer_lenient(layer: Layer) -> Path | LayerImage:
    """Like as_layer, but for release/recovery: the image file may be gone by now, and a
    path that is not a directory any more must still map to the same mount key."""
    if isinstance(layer, LayerImage):
        return layer
    p = Path(layer)
    return p if p.is_dir() else LayerImage(p)


def _rmdir_quiet(p: Path) -> None:
    try:
        p.rmdir()
    except OSError:
        pass
