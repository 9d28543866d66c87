"""Directory trees in overlayfs form: whiteout conversion, filtered copies, layer squashing.

overlayfs marks, in an upper (or lower) layer, a deleted path with a character device 0/0 of that
name (a *whiteout*) and a directory that hides everything below it with the xattr
`trusted.overlay.opaque=y`. Docker (OCI) layer tarballs say the same with files instead:
`.wh.<name>` and `.wh..wh..opq`. Every layer in the store is in overlayfs form, so a stack of them
mounted as overlay lowers behaves exactly like the Docker image.

Everything here preserves what a layer is made of: ownership, modes (setuid included), mtimes,
xattrs, hard links within the tree, symlinks, device nodes. Nothing follows a symlink.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"
OVERLAY_XATTR_PREFIX = "trusted.overlay."
#: overlayfs features that make an upper directory unusable as a plain layer: a redirected
#: directory's content lives under another path, a metacopy file's data in a lower layer.
_FOREIGN_OVERLAY_XATTRS = ("trusted.overlay.redirect", "trusted.overlay.metacopy")


class TreeError(Exception):
    """A tree cannot be turned into a layer (e.g. an overlayfs feature we cannot flatten)."""


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def is_opaque(path: str | os.PathLike[str]) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def make_whiteout(path: str | os.PathLike[str], like: os.stat_result | None = None) -> None:
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))
    if like is not None:
        os.chown(path, like.st_uid, like.st_gid, follow_symlinks=False)
        os.utime(path, ns=(like.st_atime_ns, like.st_mtime_ns), follow_symlinks=False)


def remove(path: str | os.PathLike[str]) -> None:
    """Remove a file or a whole directory tree (no symlink is followed); missing is fine."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def convert_whiteouts(root: Path) -> int:
    """Turn OCI whiteout files under `root` into overlayfs form, in place; returns how many.

    The mtimes of the directories touched are put back afterwards (the build must stay
    reproducible: the same tarball gives the same tree, hence the same layer).
    """
    converted = 0
    for dirpath, dirnames, filenames in os.walk(root):
        marks = [n for n in filenames if n.startswith(WHITEOUT_PREFIX)]
        if not marks:
            continue
        dst = os.lstat(dirpath)
        for name in sorted(marks):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            os.unlink(path)
            if name == OPAQUE_MARKER:
                os.setxattr(dirpath, OPAQUE_XATTR, b"y", follow_symlinks=False)
            else:
                target = os.path.join(dirpath, name.removeprefix(WHITEOUT_PREFIX))
                remove(target)
                dirnames[:] = [d for d in dirnames if d != os.path.basename(target)]
                make_whiteout(target, st)
            converted += 1
        os.utime(dirpath, ns=(dst.st_atime_ns, dst.st_mtime_ns), follow_symlinks=False)
    return converted


# --------------------------------------------------------------------------- copying


@dataclass
class CopyStats:
    files: int = 0
    dirs: int = 0
    bytes: int = 0
    whiteouts: int = 0
    excluded: list[str] = field(default_factory=list)


def keep_layer_xattr(name: str) -> bool:
    """Which xattrs a layer keeps: all but overlayfs bookkeeping (origin, impure, ...), which
    refers to the file handles of one particular mount; the opaque mark is kept."""
    return name == OPAQUE_XATTR or not name.startswith(OVERLAY_XATTR_PREFIX)


def copy_xattrs(
    src: str, dst: str, keep: Callable[[str], bool] = keep_layer_xattr, *, replace: bool = False
) -> None:
    try:
        names = os.listxattr(src, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EPERM):
            return
        raise
    for name in names:
        if name.startswith(_FOREIGN_OVERLAY_XATTRS):
            raise TreeError(
                f"{src} carries {name}: overlayfs redirect_dir/metacopy are not supported "
                "in a layer (mount overlays without them)"
            )
    if replace:
        for name in os.listxattr(dst, follow_symlinks=False):
            if not keep(name) or name not in names:
                os.removexattr(dst, name, follow_symlinks=False)
    for name in names:
        if keep(name):
            try:
                os.setxattr(
                    dst, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False
                )
            except OSError as exc:
                # symlinks cannot carry user.* xattrs on most filesystems
                if exc.errno not in (errno.ENOTSUP, errno.EPERM) or not os.path.islink(dst):
                    raise


def copy_metadata(
    src: str,
    dst: str,
    st: os.stat_result,
    keep: Callable[[str], bool] = keep_layer_xattr,
    *,
    replace: bool = False,
) -> None:
    """Owner, mode (after chown, which clears setuid), xattrs, then times (last: the others
    change ctime only, but xattr writes on some filesystems touch mtime). `replace`: `dst` was
    copied before, and xattrs `src` no longer has go too (copy_xattrs)."""
    link = stat.S_ISLNK(st.st_mode)
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not link:
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    copy_xattrs(src, dst, keep, replace=replace)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_data(src: str, dst: str) -> int:
    with open(src, "rb", buffering=0) as fi:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            total = 0
            while True:
                try:
                    n = os.copy_file_range(fi.fileno(), fd, 1 << 30)
                except OSError as exc:
                    if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                        raise
                    with os.fdopen(os.dup(fd), "wb") as fo:
                        shutil.copyfileobj(fi, fo, 1 << 20)
                        total += fo.tell()
                    break
                if n == 0:
                    break
                total += n
            return total
        finally:
            os.close(fd)


def copy_entry(
    src: str,
    dst: str,
    st: os.stat_result,
    links: dict[tuple[int, int], str],
    keep: Callable[[str], bool] = keep_layer_xattr,
) -> int:
    """Copy one non-directory entry (hard links within one copy stay links); returns bytes."""
    mode = st.st_mode
    if stat.S_ISREG(mode) and st.st_nlink > 1:
        first = links.get((st.st_dev, st.st_ino))
        if first is not None:
            os.link(first, dst)
            return 0
        links[(st.st_dev, st.st_ino)] = dst
    size = 0
    if stat.S_ISREG(mode):
        size = _copy_data(src, dst)
    elif stat.S_ISLNK(mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode):
        os.mknod(dst, mode, st.st_rdev)
    elif stat.S_ISSOCK(mode):
        return 0  # a socket is not content
    else:
        raise TreeError(f"{src}: unsupported file type {stat.S_IFMT(mode):o}")
    copy_metadata(src, dst, st, keep)
    return size


def copy_tree(
    src: Path,
    dst: Path,
    *,
    skip: Callable[[str], bool] | None = None,
    keep: Callable[[str], bool] = keep_layer_xattr,
) -> CopyStats:
    """Copy `src` into the (new or empty) directory `dst`.

    `skip(path)` gets sandbox-absolute paths ("/tmp/x") and excludes the entry with everything
    below it. A directory that had entries, all excluded, is left out too unless it is opaque
    (it existed in the upper only because of what was excluded, e.g. /root for /root/.cache).
    """
    stats = CopyStats()
    links: dict[tuple[int, int], str] = {}
    dst.mkdir(exist_ok=True)

    def walk(s: str, d: str, rel: str) -> bool:
        """Copies the children of s into d; False if s had children and all were skipped."""
        try:
            entries = sorted(os.scandir(s), key=lambda e: e.name)
        except FileNotFoundError:
            return True
        kept = not entries
        for entry in entries:
            path = f"{rel}/{entry.name}"
            if skip is not None and skip(path):
                stats.excluded.append(path)
                continue
            st = entry.stat(follow_symlinks=False)
            target = os.path.join(d, entry.name)
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(target, 0o700)
                if walk(entry.path, target, path) or is_opaque(entry.path):
                    copy_metadata(entry.path, target, st, keep)
                    stats.dirs += 1
                    kept = True
                else:
                    os.rmdir(target)
                    stats.excluded.append(path + "/")
            else:
                if is_whiteout(st):
                    stats.whiteouts += 1
                stats.bytes += copy_entry(entry.path, target, st, links, keep)
                stats.files += 1
                kept = True
        return kept

    walk(os.fspath(src), os.fspath(dst), "")
    copy_metadata(os.fspath(src), os.fspath(dst), os.lstat(src), keep)
    return stats


def apply_layer(src: Path, dst: Path, *, keep_whiteouts: bool) -> CopyStats:
    """Apply the layer tree `src` on top of the merged tree `dst` (overlayfs semantics), which
    is how consecutive layers are squashed into one.

    A whiteout removes what `dst` has at its path and, with `keep_whiteouts` (layers below the
    squashed group may have that path), stays as a whiteout. An opaque directory replaces the
    directory in `dst` and stays opaque; a directory that is opaque in `dst` stays opaque when
    a later layer merges into it. Anything else replaces what `dst` has at its path.
    """
    stats = CopyStats()
    links: dict[tuple[int, int], str] = {}

    def merge(s: str, d: str) -> None:
        for entry in sorted(os.scandir(s), key=lambda e: e.name):
            target = os.path.join(d, entry.name)
            st = entry.stat(follow_symlinks=False)
            if is_whiteout(st):
                remove(target)
                if keep_whiteouts:
                    make_whiteout(target, st)
                    stats.whiteouts += 1
                continue
            if stat.S_ISDIR(st.st_mode):
                opaque = is_opaque(entry.path)
                try:
                    dst_st: os.stat_result | None = os.lstat(target)
                except FileNotFoundError:
                    dst_st = None
                was_opaque = False
                if dst_st is not None and (not stat.S_ISDIR(dst_st.st_mode) or opaque):
                    remove(target)
                    dst_st = None
                elif dst_st is not None:
                    was_opaque = is_opaque(target)
                if dst_st is None:
                    os.mkdir(target, 0o700)
                merge(entry.path, target)
                os.chown(target, st.st_uid, st.st_gid, follow_symlinks=False)
                os.chmod(target, stat.S_IMODE(st.st_mode))
                copy_xattrs(entry.path, target, replace=True)
                if was_opaque and (keep_whiteouts or opaque):
                    os.setxattr(target, OPAQUE_XATTR, b"y", follow_symlinks=False)
                if not keep_whiteouts and not opaque and is_opaque(target):
                    # nothing below the group to hide: the mark has no meaning any more
                    os.removexattr(target, OPAQUE_XATTR, follow_symlinks=False)
                os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
                stats.dirs += 1
                continue
            remove(target)
            stats.bytes += copy_entry(entry.path, target, st, links)
            stats.files += 1

    merge(os.fspath(src), os.fspath(dst))
    st = os.lstat(src)
    os.chown(dst, st.st_uid, st.st_gid)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    return stats


# --------------------------------------------------------------------------- two-pass copy
#
# A fork copies a running sandbox's writable layer with the sandbox frozen. Frozen for the whole
# copy, the sandbox would stand still as long as copying its files takes (~2.6 ms per MiB and
# ~80 us per file here); instead the tree is copied once while the sandbox runs (`precopy`),
# then, frozen, brought up to date (`resync`): only what changed meanwhile is copied again.

#: What tells that an entry changed since the copy: its inode, type, size and ctime (every
#: write, truncate, chmod, chown, xattr change and link count change moves the ctime).
Signature = tuple[int, int, int, int]
#: ctime comes from a coarse clock (one tick, up to 10 ms): an entry changed less than this
#: before the pre-copy began may show a ctime the copy cannot tell from a later change.
CTIME_SLACK_NS = 50_000_000


def _signature(st: os.stat_result) -> Signature:
    return (st.st_ino, st.st_mode, st.st_size, st.st_ctime_ns)


def precopy(src: Path, dst: Path) -> dict[str, Signature]:
    """Copy `src` into the new directory `dst` while something still writes to it: entries
    that vanish under the copy are left out. Returns the signature (as stat saw it before the
    copy) of each entry copied, by path relative to `src`, for `resync`."""
    seen: dict[str, Signature] = {}
    links: dict[tuple[int, int], str] = {}
    dst.mkdir()

    def walk(s: str, d: str, rel: str) -> None:
        try:
            entries = list(os.scandir(s))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            path = f"{rel}/{entry.name}"
            target = os.path.join(d, entry.name)
            try:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    os.mkdir(target, 0o700)
                    walk(entry.path, target, path)
                    copy_metadata(entry.path, target, st)
                elif stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                    continue  # hard links: copied frozen, together (see resync)
                else:
                    copy_entry(entry.path, target, st, links)
            except (FileNotFoundError, NotADirectoryError):  # gone, or replaced, meanwhile
                with contextlib.suppress(OSError):
                    remove(target)
                continue
            seen[path] = _signature(st)

    walk(os.fspath(src), os.fspath(dst), "")
    return seen


def resync(src: Path, dst: Path, seen: dict[str, Signature], since_ns: int) -> CopyStats:
    """Make `dst`, a `precopy` of `src`, equal to `src` again (call it with `src` frozen).
    An entry is kept when its signature is what the pre-copy saw and its ctime is older than
    `since_ns` (CLOCK_REALTIME when the pre-copy began) minus CTIME_SLACK_NS; anything else
    is copied again, anything `src` no longer has is removed. Regular files with several links
    are always copied here, so that their links are made among themselves."""
    stats = CopyStats()
    links: dict[tuple[int, int], str] = {}
    before = since_ns - CTIME_SLACK_NS

    def walk(s: str, d: str, rel: str) -> None:
        entries = {e.name: e for e in os.scandir(s)}
        for name in os.listdir(d):
            if name not in entries:
                remove(os.path.join(d, name))
        for name in sorted(entries):
            entry = entries[name]
            path = f"{rel}/{name}"
            target = os.path.join(d, name)
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                try:
                    was_dir = stat.S_ISDIR(os.lstat(target).st_mode)
                except FileNotFoundError:
                    was_dir = False
                if not was_dir:
                    remove(target)
                    os.mkdir(target, 0o700)
                walk(entry.path, target, path)
                copy_metadata(entry.path, target, st, replace=True)
                stats.dirs += 1
                continue
            if is_whiteout(st):
                stats.whiteouts += 1
            stats.files += 1
            unchanged = (
                seen.get(path) == _signature(st)
                and st.st_ctime_ns < before
                and not (stat.S_ISREG(st.st_mode) and st.st_nlink > 1)
                and os.path.lexists(target)
            )
            if unchanged:
                stats.bytes += st.st_size if stat.S_ISREG(st.st_mode) else 0
                continue
            remove(target)
            stats.bytes += copy_entry(entry.path, target, st, links)

    walk(os.fspath(src), os.fspath(dst), "")
    copy_metadata(os.fspath(src), os.fspath(dst), os.lstat(src), replace=True)
    return stats
