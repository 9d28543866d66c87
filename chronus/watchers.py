"""Directory watchers: inotify through ctypes, read by the reactor thread.

One inotify instance serves every watcher of the sandbox (instances are counted per user on
the host, watches are cheap). A watcher is a directory (and, recursive, its subdirectories,
including ones created later) and a bounded buffer of events; the polled API drains the
buffer, a WatchDir stream is a watcher whose buffer it empties as events arrive. Two
watchers of one directory share its inotify watch descriptor (the kernel returns the same
one): a descriptor is removed when its last watcher goes.

Event types follow Go's fsnotify (what E2B's envd reports): CREATE for IN_CREATE and
IN_MOVED_TO, WRITE for IN_MODIFY, REMOVE for IN_DELETE, RENAME for IN_MOVED_FROM, CHMOD for
IN_ATTRIB. A directory created in a recursive watcher's tree is watched at once; what was
created in it before that is reported as CREATE from a scan (so `mkdir -p a/b && touch
a/b/f` is seen whole), which may rarely report an entry twice.

The temporary files of chronus's own atomic writes (chronus.files) are never reported, and
the rename of one into place is reported as what envd's in-place write of the same file
shows (envd opens the target O_CREAT|O_TRUNC, chowns it, writes): a new file CREATE, CHMOD,
WRITE; a new empty one CREATE, CHMOD (nothing is written); a file that was there CHMOD,
WRITE (chown, then the truncation and the writes, which the kernel merges while unread). So
a client sees the same events from dsec's and from E2B's API, and a write over a file is a
WRITE, not the CREATE its rename would otherwise be. envd may report a long write's WRITE
more than once (the kernel merges repeated IN_MODIFY only while it is unread); here it is
always once. The temporary's name carries which case it is; its IN_MOVED_FROM and the
target's IN_MOVED_TO are paired by their cookie.

A watcher asked to ``include_entry`` gives each CREATE, WRITE and CHMOD event the entry at its
path (chronus.files' FileInfo, metadata included) as it is when the event is delivered (a
stream's at once, a polled watcher's at the poll), none once the path is gone: envd stats
when it handles the event, equally best effort. A directory on a network filesystem (NFS,
CIFS/SMB, FUSE: envd's list) is refused unless ``allow_network_mounts``, as envd refuses it.
"""

from __future__ import annotations

import errno
import os
import stat
from _collections import deque  # not `collections`: see chronus.threads

from chronus.errors import (
    INVALID_ARGUMENT,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    ChronusError,
    from_os_error,
)
from chronus.files import TEMP_NEW, TEMP_NEW_EMPTY, TEMP_REPLACES, Files, temp_kind
from chronus.threads import Condition
from chronus.users import AccountNames
from insandbox.log import get_logger

TYPE_CHECKING = False  # typing costs ~2 MB at run time: annotations are strings
if TYPE_CHECKING:
    from typing import Any

    from chronus.reactor import Reactor

log = get_logger("chronus.watchers")

MAX_WATCHERS = 64
MAX_EVENTS = 4096

# <sys/inotify.h>
IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
    | IN_EXCL_UNLINK
)

# dsec.types.v1.FileEventType
CREATE, WRITE, REMOVE, RENAME, CHMOD = 1, 2, 3, 4, 5


#: statfs f_type of network filesystems (<linux/magic.h>): NFS, CIFS, SMB, SMB2, FUSE.
NETWORK_FS_TYPES = frozenset((0x6969, 0xFF534D42, 0x517B, 0xFE534D42, 0x65735546))
#: Events whose path names an entry that is still expected there.
_ENTRY_EVENTS = frozenset((CREATE, WRITE, CHMOD))


def fs_type(path: str) -> int:
    """statfs(2)'s f_type of the filesystem holding `path` (0 if statfs fails)."""
    import ctypes

    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(os.fsencode(path), buf) != 0:
        return 0
    # f_type is the first member, a long (__fsword_t)
    return int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], "little", signed=False)


def event_dicts(w: Watcher, events: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """dsec.types.v1.FileEvent dicts of `events`, with entries if `w` asks for them."""
    if not w.include_entry:
        return [{"name": name, "type": kind} for name, kind in events]
    names = AccountNames()
    out = []
    for name, kind in events:
        event: dict[str, Any] = {"name": name, "type": kind}
        if kind in _ENTRY_EVENTS:
            path = os.path.join(w.root, name)
            try:
                event["entry"] = Files.info(path, os.lstat(path), names)
            except OSError:
                pass  # gone since: no entry, as envd
        out.append(event)
    return out


def _event_type(mask: int) -> int:
    if mask & (IN_CREATE | IN_MOVED_TO):
        return CREATE
    if mask & IN_DELETE:
        return REMOVE
    if mask & IN_MOVED_FROM:
        return RENAME
    if mask & IN_MODIFY:
        return WRITE
    if mask & IN_ATTRIB:
        return CHMOD
    return 0


#: What the rename of an atomic write's temporary into place is reported as, by the
#: temporary's kind (chronus.files.temp_kind): envd's events for the same write.
_ATOMIC_WRITE_EVENTS = {
    TEMP_NEW: (CREATE, CHMOD, WRITE),
    TEMP_NEW_EMPTY: (CREATE, CHMOD),
    TEMP_REPLACES: (CHMOD, WRITE),
}
#: Renames of temporaries seen (IN_MOVED_FROM) whose IN_MOVED_TO has not come, at most.
MAX_PENDING_MOVES = 256


class Watcher:
    """One watched directory tree and its buffered events."""

    def __init__(
        self, watcher_id: str, root: str, recursive: bool, include_entry: bool = False
    ) -> None:
        self.watcher_id = watcher_id
        self.root = root
        self.recursive = recursive
        self.include_entry = include_entry
        self.cond = Condition()  # guards events/overflowed/gone; notified on each change
        self.events: deque[tuple[str, int]] = deque()
        self.overflowed = False
        self.dropped = 0
        self.gone = False  # the root was removed (or moved away): nothing more can come
        #: wd -> the directory's path relative to root ("" for root)
        self.dirs: dict[int, str] = {}

    def push(self, name: str, *kinds: int) -> None:
        """Buffers an event for `name` of each of `kinds`, together: a drain sees all or none."""
        with self.cond:
            for kind in kinds:
                if len(self.events) >= MAX_EVENTS:
                    self.overflowed = True
                    self.dropped += 1
                else:
                    self.events.append((name, kind))
            self.cond.notify_all()

    def drain(self) -> tuple[list[tuple[str, int]], bool]:
        with self.cond:
            events = list(self.events)
            self.events.clear()
            overflowed, self.overflowed = self.overflowed, False
            return events, overflowed


class Watchers:
    """The sandbox's watcher table."""

    def __init__(self, files_resolve: Any, reactor: Reactor) -> None:
        self._resolve = files_resolve
        self._reactor = reactor
        self._libc: Any = None
        self._fd = -1
        self._lock = Condition()  # guards the tables below
        self._watchers: dict[str, Watcher] = {}
        self._wds: dict[int, set[Watcher]] = {}
        #: inotify cookie -> the kind of the temporary moved away (reactor thread only)
        self._temp_moves: dict[int, str] = {}

    # ----------------------------------------------------------- inotify
    def _open(self) -> None:
        if self._fd >= 0:
            return
        import ctypes  # at the first watcher: most sandboxes never watch

        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_add_watch.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            if err == errno.EMFILE:
                raise ChronusError(
                    RESOURCE_EXHAUSTED, "INOTIFY_LIMIT", "no inotify instance left for the sandbox"
                )
            raise from_os_error(OSError(err, os.strerror(err)))
        self._libc, self._fd = libc, fd
        self._reactor.call_soon(lambda: self._reactor.add_reader(fd, self._on_readable))

    def _add_watch(self, path: str, follow: bool) -> int:
        mask = MASK if follow else MASK | IN_DONT_FOLLOW
        wd = int(self._libc.inotify_add_watch(self._fd, os.fsencode(path), mask))
        if wd < 0:
            import ctypes

            err = ctypes.get_errno()
            if err == errno.ENOSPC:
                raise ChronusError(
                    RESOURCE_EXHAUSTED,
                    "INOTIFY_WATCH_LIMIT",
                    f"{path}: the sandbox's inotify watch limit is reached",
                )
            if err == errno.ENOTDIR:
                raise ChronusError(INVALID_ARGUMENT, "NOT_A_DIRECTORY", f"{path}: not a directory")
            raise from_os_error(OSError(err, os.strerror(err)), path)
        return wd

    def _watch_dir(self, w: Watcher, path: str, rel: str, follow: bool = False) -> None:
        """Adds `path` (relative `rel`) to `w` (the lock held)."""
        wd = self._add_watch(path, follow)
        w.dirs[wd] = rel
        self._wds.setdefault(wd, set()).add(w)

    def _watch_tree(self, w: Watcher, path: str, rel: str, report: bool) -> None:
        """Watches every directory under `path` (the lock held); with `report`, each entry
        found is pushed as CREATE (it was created before its directory was watched)."""
        try:
            entries = list(os.scandir(path))
        except OSError:
            return  # removed meanwhile
        for entry in entries:
            sub_rel = f"{rel}/{entry.name}" if rel else entry.name
            if report:
                w.push(sub_rel, CREATE)
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_dir:
                try:
                    self._watch_dir(w, entry.path, sub_rel)
                except ChronusError as exc:
                    if exc.reason == "INOTIFY_WATCH_LIMIT":
                        raise
                    continue  # removed or replaced meanwhile
                self._watch_tree(w, entry.path, sub_rel, report)

    def _unwatch(self, w: Watcher, wd: int) -> None:
        """Drops `wd` from `w` (the lock held); the kernel's watch goes with its last user."""
        w.dirs.pop(wd, None)
        users = self._wds.get(wd)
        if users is None:
            return
        users.discard(w)
        if not users:
            del self._wds[wd]
            self._libc.inotify_rm_watch(self._fd, wd)  # EINVAL if already gone: fine

    # -------------------------------------------------------- table (any thread)
    def create(self, req: dict[str, Any]) -> Watcher:
        path = self._resolve(req.get("path", ""))
        try:
            st = os.stat(path)
        except OSError as exc:
            raise from_os_error(exc, path) from None
        if not stat.S_ISDIR(st.st_mode):
            raise ChronusError(INVALID_ARGUMENT, "NOT_A_DIRECTORY", f"{path}: not a directory")
        if not req.get("allow_network_mounts") and fs_type(path) in NETWORK_FS_TYPES:
            raise ChronusError(
                INVALID_ARGUMENT,
                "NETWORK_MOUNT",
                f"{path} is on a network filesystem, whose events may never come;"
                " set allow_network_mounts to watch it anyway",
            )
        with self._lock:
            if len(self._watchers) >= MAX_WATCHERS:
                raise ChronusError(
                    RESOURCE_EXHAUSTED,
                    "TOO_MANY_WATCHERS",
                    f"a sandbox holds at most {MAX_WATCHERS} watchers; remove one first",
                )
            self._open()
            w = Watcher(
                "w-" + os.urandom(8).hex(),
                path,
                bool(req.get("recursive")),
                bool(req.get("include_entry")),
            )
            try:
                self._watch_dir(w, path, "", follow=True)
                if w.recursive:
                    self._watch_tree(w, path, "", report=False)
            except BaseException:
                for wd in list(w.dirs):
                    self._unwatch(w, wd)
                raise
            self._watchers[w.watcher_id] = w
        return w

    def get(self, watcher_id: str) -> Watcher:
        with self._lock:
            w = self._watchers.get(watcher_id)
        if w is None:
            raise ChronusError(NOT_FOUND, "WATCHER_NOT_FOUND", f"no watcher {watcher_id!r}")
        return w

    def remove(self, watcher_id: str) -> None:
        with self._lock:
            w = self._watchers.pop(watcher_id, None)
            if w is None:
                raise ChronusError(NOT_FOUND, "WATCHER_NOT_FOUND", f"no watcher {watcher_id!r}")
            for wd in list(w.dirs):
                self._unwatch(w, wd)
        with w.cond:
            w.gone = True
            w.cond.notify_all()

    def count(self) -> int:
        with self._lock:
            return len(self._watchers)

    # ---------------------------------------------------------- reactor thread
    def _on_readable(self) -> None:
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            log.exception("inotify read failed")
            return
        with self._lock:
            offset = 0
            while offset + 16 <= len(data):
                wd = int.from_bytes(data[offset : offset + 4], "little", signed=True)
                mask = int.from_bytes(data[offset + 4 : offset + 8], "little")
                cookie = int.from_bytes(data[offset + 8 : offset + 12], "little")
                size = int.from_bytes(data[offset + 12 : offset + 16], "little")
                raw = data[offset + 16 : offset + 16 + size].split(b"\0", 1)[0]
                offset += 16 + size
                self._dispatch(wd, mask, os.fsdecode(raw), cookie)

    def _atomic_write_events(self, mask: int, name: str, cookie: int) -> tuple[int, ...] | None:
        """For the moves of atomic writes' temporaries: () for an event not to report (the
        temporary's own), the events to report instead of a rename into place's CREATE; None
        for any other event."""
        kind = temp_kind(name) if name else None
        if mask & IN_MOVED_FROM and kind is not None:
            if len(self._temp_moves) >= MAX_PENDING_MOVES:  # their IN_MOVED_TO was lost
                self._temp_moves.clear()
            self._temp_moves[cookie] = kind
            return ()
        if mask & IN_MOVED_TO and cookie in self._temp_moves:
            moved = self._temp_moves.pop(cookie)
            if kind is not None:
                return ()  # renamed to another temporary (chronus.files marks an empty one)
            return _ATOMIC_WRITE_EVENTS.get(moved)  # unmarked: CREATE, as any rename
        if kind is not None:
            return ()
        return None

    def _dispatch(self, wd: int, mask: int, name: str, cookie: int = 0) -> None:
        if mask & IN_Q_OVERFLOW:
            self._temp_moves.clear()
            for w in self._watchers.values():
                with w.cond:
                    w.overflowed = True
                    w.cond.notify_all()
            return
        instead = self._atomic_write_events(mask, name, cookie)
        for w in list(self._wds.get(wd, ())):
            rel = w.dirs.get(wd)
            if rel is None:
                continue
            if mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF):
                if rel == "" and not mask & IN_IGNORED:
                    with w.cond:  # the watched directory itself is gone
                        w.gone = True
                        w.cond.notify_all()
                if mask & IN_IGNORED:
                    w.dirs.pop(wd, None)
                    users = self._wds.get(wd)
                    if users is not None:
                        users.discard(w)
                        if not users:
                            del self._wds[wd]
                continue
            kind = _event_type(mask)
            if not kind or not name or instead == ():
                continue
            full_rel = f"{rel}/{name}" if rel else name
            w.push(full_rel, *(instead or (kind,)))
            if w.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
                path = os.path.join(w.root, full_rel)
                try:
                    self._watch_dir(w, path, full_rel)
                    self._watch_tree(w, path, full_rel, report=True)
                except ChronusError:
                    continue  # removed meanwhile, or the watch limit: it goes unwatched
            elif w.recursive and mask & IN_ISDIR and mask & IN_MOVED_FROM:
                prefix = full_rel + "/"
                for sub_wd, sub_rel in list(w.dirs.items()):
                    if sub_rel == full_rel or sub_rel.startswith(prefix):
                        self._unwatch(w, sub_wd)
