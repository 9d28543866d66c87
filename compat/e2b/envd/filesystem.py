"""envd's ``filesystem.Filesystem`` service on libdsec's file operations and watchers.

Paths follow envd's rule (relative = under the user's home, see ``EnvdCall.resolve``); each
call is one or a few libdsec calls. ``ListDir`` with a depth walks the tree with one listing
per directory; ``WatchDir`` and the polled watchers (``CreateWatcher`` /
``GetWatcherEvents`` / ``RemoveWatcher``) are dsec's watchers inside the sandbox, whose
events map one to one: chronus already reports its atomic writes as envd's in-place writes
(CREATE, CHMOD, WRITE; CHMOD, WRITE over a file), which only it can tell from a plain rename.
Entries follow envd's for symlinks and owners (see ``entry``), and carry the file's metadata
(its ``user.e2b.*`` extended attributes, read by chronus). Watches pass ``include_entry``
(events carry the entry) and ``allow_network_mounts`` (without it a directory on NFS, SMB or
FUSE is refused, as envd refuses it) to dsec's watchers.
"""

from __future__ import annotations

import posixpath
import stat as stat_bits
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from compat.e2b.envd.call import EnvdCall, current, invalid, mapped
from compat.e2b.envd.gen.filesystem import filesystem_pb as pb
from compat.e2b.envd.gen.filesystem.filesystem_connect import Filesystem
from compat.e2b.envd.streams import with_keepalives
from libdsec import FileInfo
from libdsec.errors import AlreadyExists, DSecError, NotFound, PathNotFound
from libdsec.types import FileEvent

_TYPES = {
    "REGULAR": pb.FileType.FILE,
    "DIRECTORY": pb.FileType.DIRECTORY,
    "SYMLINK": pb.FileType.SYMLINK,
}
_EVENTS = {
    "create": pb.EventType.CREATE,
    "write": pb.EventType.WRITE,
    "remove": pb.EventType.REMOVE,
    "rename": pb.EventType.RENAME,
    "chmod": pb.EventType.CHMOD,
}

#: Go's FileMode letters for the special bits, in its order ("dalTLDpSugct?").
_SPECIAL_BITS = ((stat_bits.S_ISUID, "u"), (stat_bits.S_ISGID, "g"), (stat_bits.S_ISVTX, "t"))


def permissions(info: FileInfo) -> str:
    """Go's ``FileMode.String()`` of an lstat, as envd reports it: the type and special-bit
    letters in Go's order, or "-" when there are none, then rwx ("drwxr-xr-x", "Lrwxrwxrwx",
    "dtrwxrwxrwx" for /tmp, "urwxr-xr-x" for a setuid file)."""
    letters = {"DIRECTORY": "d", "SYMLINK": "L"}.get(info.type, "")
    for bit, letter in _SPECIAL_BITS:
        if info.mode & bit:
            letters += letter
    rwx = "".join(c if info.mode & (0o400 >> i) else "-" for i, c in enumerate("rwxrwxrwx"))
    return (letters or "-") + rwx


def entry(info: FileInfo) -> pb.EntryInfo:
    """envd's entry of an lstat (``GetEntryInfo`` in e2b-dev/infra's
    packages/shared/pkg/filesystem/entry.go): size, owner, group, time and permissions are the
    link's own, but a symlink's type and mode are its target's and ``symlink_target`` is the
    fully resolved path; a link that does not resolve has no type, mode 0 and its own path
    as target. ``mode`` is the permission bits only (Go's ``Perm()``)."""
    kind, mode = info.type, info.mode
    if info.type == "SYMLINK":
        kind, mode = (info.target.type, info.target.mode) if info.target else ("", 0)
    out = pb.EntryInfo(
        name=posixpath.basename(info.path) or info.path,
        type=_TYPES.get(kind, pb.FileType.UNSPECIFIED),
        path=info.path,
        size=info.size,
        mode=mode & 0o777,
        permissions=permissions(info),
        owner=info.owner,
        group=info.group,
        metadata=dict(info.metadata),
    )
    if info.modified_at is not None:
        ts = info.modified_at.timestamp()
        out.modified_time = Timestamp(seconds=int(ts), nanos=int((ts % 1) * 1e9))
    if info.type == "SYMLINK":
        out.symlink_target = info.target.path if info.target else info.path
    return out


def fs_event(ev: FileEvent) -> pb.FilesystemEvent:
    out = pb.FilesystemEvent(
        name=ev.name, type=_EVENTS.get(str(ev.type).lower(), pb.EventType.UNSPECIFIED)
    )
    if ev.entry is not None:
        out.entry = entry(ev.entry)
    return out


async def _directory(call: EnvdCall, path: str) -> str:
    """``path`` resolved, checked to be a directory (envd's answers for a missing one or a
    file)."""
    resolved = call.resolve(path)
    try:
        info = await call.sandbox.files.stat(resolved)
    except NotFound:
        raise ConnectError(Code.NOT_FOUND, f"directory not found: {resolved}") from None
    if not info.is_dir:
        raise invalid(f"path is not a directory: {resolved}")
    return resolved


class FilesystemService(Filesystem):
    async def stat(
        self, request: pb.StatRequest, ctx: RequestContext[pb.StatRequest, pb.StatResponse]
    ) -> pb.StatResponse:
        call = current()
        try:
            info = await call.sandbox.files.stat(call.resolve(request.path), follow_symlinks=False)
        except DSecError as exc:
            raise call.error(exc) from None
        return pb.StatResponse(entry=entry(info))

    async def make_dir(
        self, request: pb.MakeDirRequest, ctx: RequestContext[pb.MakeDirRequest, pb.MakeDirResponse]
    ) -> pb.MakeDirResponse:
        call = current()
        path = call.resolve(request.path)
        files = call.sandbox.files
        try:
            try:
                info = await files.mkdir(path, parents=False, user=call.run_as)
            except NotFound:  # a parent is missing: envd makes them all
                info = await files.mkdir(path, parents=True, user=call.run_as)
        except AlreadyExists:
            existing = await files.stat(path)
            if existing.is_dir:
                raise ConnectError(
                    Code.ALREADY_EXISTS, f"directory already exists: {path}"
                ) from None
            raise invalid(f"path already exists but it is not a directory: {path}") from None
        except DSecError as exc:
            raise call.error(exc) from None
        return pb.MakeDirResponse(entry=entry(info))

    async def move(
        self, request: pb.MoveRequest, ctx: RequestContext[pb.MoveRequest, pb.MoveResponse]
    ) -> pb.MoveResponse:
        call = current()
        src, dst = call.resolve(request.source), call.resolve(request.destination)
        files = call.sandbox.files
        try:
            parent = posixpath.dirname(dst)
            try:
                # envd makes the destination's parents (the user's)
                await files.mkdir(parent, parents=True, user=call.run_as)
            except AlreadyExists:
                pass
            info = await files.move(src, dst, overwrite=True)  # rename(2) replaces, as in envd
        except NotFound:
            raise ConnectError(Code.NOT_FOUND, f"source file not found: {src}") from None
        except DSecError as exc:
            raise call.error(exc) from None
        return pb.MoveResponse(entry=entry(info))

    async def list_dir(
        self, request: pb.ListDirRequest, ctx: RequestContext[pb.ListDirRequest, pb.ListDirResponse]
    ) -> pb.ListDirResponse:
        call = current()
        depth = request.depth or 1
        out: list[pb.EntryInfo] = []

        async def walk(path: str, level: int) -> None:
            for info in await call.sandbox.files.list(path):
                out.append(entry(info))
                if info.type == "DIRECTORY" and level < depth:
                    await walk(info.path, level + 1)

        try:
            await walk(await _directory(call, request.path), 1)
        except DSecError as exc:
            raise call.error(exc) from None
        return pb.ListDirResponse(entries=out)

    async def remove(
        self, request: pb.RemoveRequest, ctx: RequestContext[pb.RemoveRequest, pb.RemoveResponse]
    ) -> pb.RemoveResponse:
        call = current()
        try:
            await call.sandbox.files.remove(call.resolve(request.path), recursive=True)
        except PathNotFound:
            pass  # envd removes as os.RemoveAll does: a path that is not there is removed
        except DSecError as exc:
            raise call.error(exc) from None
        return pb.RemoveResponse()

    def watch_dir(
        self,
        request: pb.WatchDirRequest,
        ctx: RequestContext[pb.WatchDirRequest, pb.WatchDirResponse],
    ) -> AsyncIterator[pb.WatchDirResponse]:
        async def run() -> AsyncIterator[pb.WatchDirResponse]:
            call = current()
            path = await _directory(call, request.path)
            watch = await call.sandbox.files.watch(
                path,
                recursive=request.recursive,
                include_entry=request.include_entry,
                allow_network_mounts=request.allow_network_mounts,
            )
            arm: Any = Oneof("start", pb.WatchDirResponse.StartEvent())
            yield pb.WatchDirResponse(event=arm)
            async for ev in with_keepalives(aiter(watch), call.keepalive_s):  # closes the watch
                if isinstance(ev, FileEvent):
                    arm = Oneof("filesystem", fs_event(ev))
                else:
                    arm = Oneof("keepalive", pb.WatchDirResponse.KeepAlive())
                yield pb.WatchDirResponse(event=arm)

        return mapped(run)

    async def create_watcher(
        self,
        request: pb.CreateWatcherRequest,
        ctx: RequestContext[pb.CreateWatcherRequest, pb.CreateWatcherResponse],
    ) -> pb.CreateWatcherResponse:
        call = current()
        try:
            path = await _directory(call, request.path)
            watcher_id = await call.sandbox.files.create_watcher(
                path,
                recursive=request.recursive,
                include_entry=request.include_entry,
                allow_network_mounts=request.allow_network_mounts,
            )
        except DSecError as exc:
            raise call.error(exc) from None
        return pb.CreateWatcherResponse(watcher_id=watcher_id)

    async def get_watcher_events(
        self,
        request: pb.GetWatcherEventsRequest,
        ctx: RequestContext[pb.GetWatcherEventsRequest, pb.GetWatcherEventsResponse],
    ) -> pb.GetWatcherEventsResponse:
        call = current()
        try:
            events = await call.sandbox.files.watcher_events(request.watcher_id)
        except DSecError as exc:
            raise call.error(exc) from None
        return pb.GetWatcherEventsResponse(events=[fs_event(e) for e in events])

    async def remove_watcher(
        self,
        request: pb.RemoveWatcherRequest,
        ctx: RequestContext[pb.RemoveWatcherRequest, pb.RemoveWatcherResponse],
    ) -> pb.RemoveWatcherResponse:
        call = current()
        try:
            await call.sandbox.files.remove_watcher(request.watcher_id)
        except DSecError as exc:
            raise call.error(exc) from None
        return pb.RemoveWatcherResponse()
