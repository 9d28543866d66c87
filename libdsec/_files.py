"""Files inside a sandbox: :class:`AsyncFiles` (``sandbox.files``).

await sb.files.write("/work/a.txt", "hello")
assert await sb.files.read("/work/a.txt") == b"hello"
await sb.files.upload("dataset.tar", "/work/dataset.tar")   # streamed, one chunk in memory

async with await sb.files.watch("/work", recursive=True) as changes:   # established here
    async for ev in changes:                                           # FileEvent
        print(ev.type, ev.name)
"""

from __future__ import annotations

import asyncio
import builtins
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any

import grpc

from dsec.types.v1 import types_pb2
from libdsec._transport import (
    STREAM_IDLE_TIMEOUT_S,
    STREAM_KEEPALIVE_INTERVAL_S,
    Link,
    Transport,
    new_operation_id,
    stalled,
    stream_error,
)
from libdsec.errors import NotFound, Unavailable
from libdsec.types import FileEvent, FileInfo

#: Bytes per message of an upload or download.
CHUNK = 1024 * 1024
#: The largest write sent in one call; a larger one is an upload (or, appending, several).
INLINE_WRITE_BYTES = 4 * 1024 * 1024


class AsyncFiles:
    """Filesystem operations inside a sandbox."""

    def __init__(self, client: Link, sandbox_id: str) -> None:
        self.client = client
        self.sandbox_id = sandbox_id

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        rpc = self.client.transport
        return rpc.unary(
            getattr(rpc.files, method),
            request,
            timeout=self.client.timeout if timeout is None else timeout,
        )

    async def read(self, path: str, *, offset: int = 0, length: int = 0) -> bytes:
        """A whole small file (or a slice); use :meth:`download` for big ones."""
        if length == 0 and offset == 0:
            chunks = [chunk async for chunk in self.iter_download(path)]
            return b"".join(chunks)
        resp = await self._call(
            "ReadFile",
            types_pb2.ReadFileRequest(
                sandbox_id=self.sandbox_id, path=path, offset=offset, length=length
            ),
        )
        return bytes(resp.data)

    async def write(
        self,
        path: str,
        data: bytes | str,
        *,
        mode: int = 0,
        append: bool = False,
        make_parents: bool = True,
        operation_id: str | None = None,
        user: str = "",
        metadata: dict[str, str] | None = None,
    ) -> FileInfo:
        """Writes ``data`` to ``path`` (over 4 MiB: an upload; an append over 4 MiB: appends of
        4 MiB, each an operation of its own, so a failure leaves those done). ``operation_id`` names the
        write in the sandbox's operation log: a repeat of a logged id writes nothing again
        (see :meth:`AsyncSandbox.run`); the SDK makes one when none is given. ``user``: the
        file, and the parent directories the write creates, are this user's (a user of the
        sandbox's /etc/passwd; default root).

        ``metadata`` becomes the file's whole user metadata, kept as its ``user.e2b.<key>``
        extended attributes (E2B's envd's namespace; ``setfattr`` inside sets them too) and
        returned in :attr:`FileInfo.metadata` by stat, list and move. A write replaces the
        file, so one without metadata leaves none; an append keeps it unless given. Keys and
        values printable ASCII, keys non-empty up to 246 bytes, 4 KiB in all, else
        ``InvalidArgument`` ``INVALID_METADATA``; on a filesystem without user extended
        attributes ``FailedPrecondition`` ``XATTR_UNSUPPORTED`` (nothing is written)::

            info = await sb.files.write("/work/a.txt", "x", metadata={"author": "ann"})
            info.metadata  # {"author": "ann"}
        """
        raw = data.encode() if isinstance(data, str) else data
        if len(raw) > INLINE_WRITE_BYTES and append:
            # An upload replaces the file: a long append goes as appends of at most 4 MiB,
            # each one operation (``<operation_id>.<n>``), so a retry of the whole call
            # repeats none of those already done.
            op = operation_id or new_operation_id()
            for n, at in enumerate(range(0, len(raw), INLINE_WRITE_BYTES)):
                info = await self.write(
                    path,
                    raw[at : at + INLINE_WRITE_BYTES],
                    mode=mode,
                    append=True,
                    make_parents=make_parents,
                    operation_id=f"{op}.{n}",
                    user=user,
                    metadata=metadata,
                )
            return info
        if len(raw) > INLINE_WRITE_BYTES:
            return await self.upload(
                raw,
                path,
                mode=mode,
                make_parents=make_parents,
                operation_id=operation_id,
                user=user,
                metadata=metadata,
            )
        resp = await self._call(
            "WriteFile",
            types_pb2.WriteFileRequest(
                sandbox_id=self.sandbox_id,
                path=path,
                data=raw,
                mode=mode,
                append=append,
                make_parents=make_parents,
                operation_id=operation_id or new_operation_id(),
                user=user,
                metadata=metadata or {},
            ),
        )
        return FileInfo.from_pb(resp.info)

    async def list(self, path: str, *, max_entries: int = 0) -> list[FileInfo]:
        resp = await self._call(
            "ListDir",
            types_pb2.ListDirRequest(
                sandbox_id=self.sandbox_id, path=path, max_entries=max_entries
            ),
        )
        return [FileInfo.from_pb(e) for e in resp.entries]

    async def stat(self, path: str, *, follow_symlinks: bool = True) -> FileInfo:
        resp = await self._call(
            "StatPath",
            types_pb2.StatPathRequest(
                sandbox_id=self.sandbox_id, path=path, follow_symlinks=follow_symlinks
            ),
        )
        return FileInfo.from_pb(resp.info)

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path, follow_symlinks=False)
            return True
        except NotFound:
            return False

    async def mkdir(
        self,
        path: str,
        *,
        mode: int = 0,
        parents: bool = True,
        operation_id: str | None = None,
        user: str = "",
    ) -> FileInfo:
        """Makes the directory ``path``; ``user``: it and the parents it makes are this
        user's (as :meth:`write`'s)."""
        resp = await self._call(
            "MakeDir",
            types_pb2.MakeDirRequest(
                sandbox_id=self.sandbox_id,
                path=path,
                mode=mode,
                parents=parents,
                operation_id=operation_id or new_operation_id(),
                user=user,
            ),
        )
        return FileInfo.from_pb(resp.info)

    async def remove(
        self, path: str, *, recursive: bool = False, operation_id: str | None = None
    ) -> None:
        await self._call(
            "RemovePath",
            types_pb2.RemovePathRequest(
                sandbox_id=self.sandbox_id,
                path=path,
                recursive=recursive,
                operation_id=operation_id or new_operation_id(),
            ),
        )

    async def move(
        self,
        source: str,
        destination: str,
        *,
        overwrite: bool = False,
        operation_id: str | None = None,
    ) -> FileInfo:
        resp = await self._call(
            "MovePath",
            types_pb2.MovePathRequest(
                sandbox_id=self.sandbox_id,
                source=source,
                destination=destination,
                overwrite=overwrite,
                operation_id=operation_id or new_operation_id(),
            ),
        )
        return FileInfo.from_pb(resp.info)

    async def chmod(self, path: str, mode: int, *, operation_id: str | None = None) -> FileInfo:
        resp = await self._call(
            "ChmodPath",
            types_pb2.ChmodPathRequest(
                sandbox_id=self.sandbox_id,
                path=path,
                mode=mode,
                operation_id=operation_id or new_operation_id(),
            ),
        )
        return FileInfo.from_pb(resp.info)

    async def upload(
        self,
        source: bytes | str | os.PathLike[str] | IO[bytes],
        path: str,
        *,
        mode: int = 0,
        make_parents: bool = True,
        chunk_bytes: int = CHUNK,
        operation_id: str | None = None,
        user: str = "",
        metadata: dict[str, str] | None = None,
    ) -> FileInfo:
        """Streams ``source`` (bytes, a local path, or a binary file object) into ``path``.

        The file appears atomically when the whole stream has arrived; a
        failed upload leaves nothing behind. Memory use is one chunk. ``operation_id``: as
        :meth:`write`'s (a repeat must send the same bytes; nothing is written again);
        ``metadata``: as :meth:`write`'s.
        """
        size = 0
        fh: IO[bytes] | None = None
        data: bytes | None = None
        if isinstance(source, bytes):
            data, size = source, len(source)
        elif isinstance(source, (str, os.PathLike)):
            fh = open(source, "rb")
            size = os.fstat(fh.fileno()).st_size
        else:
            fh = source

        async def parts() -> AsyncIterator[types_pb2.UploadFileRequest]:
            yield types_pb2.UploadFileRequest(
                header=types_pb2.UploadHeader(
                    sandbox_id=self.sandbox_id,
                    path=path,
                    mode=mode,
                    make_parents=make_parents,
                    size_bytes=size,
                    operation_id=operation_id or new_operation_id(),
                    user=user,
                    metadata=metadata or {},
                )
            )
            if data is not None:
                for i in range(0, len(data), chunk_bytes):
                    yield types_pb2.UploadFileRequest(chunk=data[i : i + chunk_bytes])
            else:
                assert fh is not None
                while True:
                    block = await asyncio.to_thread(fh.read, chunk_bytes)
                    if not block:
                        break
                    yield types_pb2.UploadFileRequest(chunk=block)

        rpc = self.client.transport
        try:
            resp = await rpc.unary(rpc.files.UploadFile, parts(), timeout=3600)
        finally:
            if (
                fh is not None
                and not isinstance(source, (bytes,))
                and isinstance(source, (str, os.PathLike))
            ):
                fh.close()
        return FileInfo.from_pb(resp.info)

    async def iter_download(
        self, path: str, *, offset: int = 0, chunk_bytes: int = CHUNK
    ) -> AsyncIterator[bytes]:
        """The file's bytes in chunks, streamed (never whole in memory)."""
        rpc = self.client.transport
        request = types_pb2.DownloadFileRequest(
            sandbox_id=self.sandbox_id, path=path, offset=offset, chunk_bytes=chunk_bytes
        )
        async for msg in rpc.stream(rpc.files.DownloadFile, request):
            if msg.chunk:
                yield bytes(msg.chunk)

    async def download(self, path: str, destination: str | os.PathLike[str] | IO[bytes]) -> int:
        """Streams ``path`` into a local file (path or binary file object); returns bytes written."""
        total = 0
        if isinstance(destination, (str, os.PathLike)):
            dest = Path(destination)
            tmp = dest.with_name(dest.name + ".part")
            with open(tmp, "wb") as fh:
                async for chunk in self.iter_download(path):
                    await asyncio.to_thread(fh.write, chunk)
                    total += len(chunk)
            os.replace(tmp, dest)
            return total
        async for chunk in self.iter_download(path):
            destination.write(chunk)
            total += len(chunk)
        return total

    # ------------------------------------------------------------ watchers

    async def create_watcher(
        self,
        path: str,
        recursive: bool = False,
        *,
        include_entry: bool = False,
        allow_network_mounts: bool = False,
        timeout: float | None = None,
    ) -> str:
        """Starts watching the directory ``path`` (and, ``recursive``, its subdirectories,
        including ones created later) inside the sandbox; returns the watcher's id for
        :meth:`watcher_events`. The watcher lives until :meth:`remove_watcher` or the
        sandbox's end; a sandbox holds at most 64 (``ResourceExhausted``
        ``TOO_MANY_WATCHERS``). A missing path: ``PathNotFound``; not a directory:
        ``InvalidArgument`` ``NOT_A_DIRECTORY``. ``include_entry``: each create, write and
        chmod event carries :attr:`FileEvent.entry` (the entry when the event is polled,
        None once it is gone). A directory on a network filesystem (NFS, CIFS/SMB, FUSE) is
        ``InvalidArgument`` ``NETWORK_MOUNT`` unless ``allow_network_mounts`` (its events
        may never come), as E2B's envd does."""
        resp = await self._call(
            "CreateWatcher",
            types_pb2.CreateWatcherRequest(
                sandbox_id=self.sandbox_id,
                path=path,
                recursive=recursive,
                include_entry=include_entry,
                allow_network_mounts=allow_network_mounts,
            ),
            timeout,
        )
        return str(resp.watcher_id)

    async def watcher_events(
        self, watcher_id: str, *, timeout: float | None = None
    ) -> builtins.list[FileEvent]:
        """What happened since the previous call, oldest first (at most 4096 events are
        held between calls; the oldest are kept). An unknown id: ``NotFound``
        ``WATCHER_NOT_FOUND``::

            wid = await sb.files.create_watcher("/work")
            await sb.files.write("/work/a.txt", "x")
            events = await sb.files.watcher_events(wid)   # [FileEvent("a.txt", "create"), ...]

        A :meth:`write` or :meth:`upload` (atomic: its temporary file is never reported) is
        ``create``, ``chmod``, ``write`` for a new file (``create``, ``chmod`` if empty) and
        ``chmod``, ``write`` over one that was there, as E2B's envd reports its writes.
        """
        resp = await self._call(
            "GetWatcherEvents",
            types_pb2.GetWatcherEventsRequest(sandbox_id=self.sandbox_id, watcher_id=watcher_id),
            timeout,
        )
        return [FileEvent.from_pb(e) for e in resp.events]

    async def remove_watcher(self, watcher_id: str, *, timeout: float | None = None) -> None:
        """Stops a watcher and forgets its events. An unknown id: ``NotFound``."""
        await self._call(
            "RemoveWatcher",
            types_pb2.RemoveWatcherRequest(sandbox_id=self.sandbox_id, watcher_id=watcher_id),
            timeout,
        )

    async def watch(
        self,
        path: str,
        recursive: bool = False,
        *,
        include_entry: bool = False,
        allow_network_mounts: bool = False,
    ) -> AsyncDirWatch:
        """Streams changes of the directory ``path``: returns once the watch is established
        (every later change is reported), an async iterator of :class:`FileEvent`, closed
        with ``aclose()`` or by leaving its ``async with``. When the sandbox ends the
        iteration raises ``SandboxTerminated`` (``metadata["termination_reason"]``), when
        the directory itself is removed ``PathNotFound``; a stream silent past its
        keepalives raises ``DeadlineExceeded`` ``STREAM_STALLED``. ``include_entry`` and
        ``allow_network_mounts``: as :meth:`create_watcher`'s::

            async with await sb.files.watch("/work", recursive=True) as changes:
                async for ev in changes:
                    print(ev.type, ev.name)
        """
        w = AsyncDirWatch(
            self.client.transport,
            types_pb2.WatchDirRequest(
                sandbox_id=self.sandbox_id,
                path=path,
                recursive=recursive,
                keepalive_interval_ms=round(STREAM_KEEPALIVE_INTERVAL_S * 1000),
                include_entry=include_entry,
                allow_network_mounts=allow_network_mounts,
            ),
        )
        try:
            await w.start()
        except BaseException:
            await w.aclose()
            raise
        return w


class AsyncDirWatch:
    """A directory watch (see :meth:`AsyncFiles.watch`): an async iterator of
    :class:`FileEvent` and an async context manager. ``dropped`` counts events the server
    could not deliver because this reader fell behind."""

    def __init__(
        self, rpc: Transport, request: types_pb2.WatchDirRequest, *, idle_timeout_s: float = 0.0
    ) -> None:
        self._rpc = rpc
        self._request = request
        self.idle_timeout_s = idle_timeout_s or STREAM_IDLE_TIMEOUT_S
        self._call: Any = None
        self._closed = False
        #: The watched directory as the sandbox resolved it (once started).
        self.path = ""
        self.dropped = 0

    @property
    def closed(self) -> bool:
        return self._closed

    async def start(self) -> None:
        """Opens the stream and waits until the sandbox says the watch is established."""
        self._rpc.check_open()
        self._call = self._rpc.files.WatchDir(self._request, metadata=self._rpc.metadata)
        msg = await self._read()
        if msg is None or msg.WhichOneof("kind") != "started":
            raise Unavailable("the watch ended before it started", reason="STREAM_ENDED_EARLY")
        self.path = msg.started.path

    async def _read(self) -> Any:
        """The next message, or None once closed."""
        if self._closed:
            return None
        try:
            async with asyncio.timeout(self.idle_timeout_s):
                msg = await self._call.read()
        except TimeoutError:
            self._finish()
            raise stalled(self.idle_timeout_s) from None
        except grpc.aio.AioRpcError as exc:
            if self._closed:
                return None
            self._finish()
            raise stream_error(exc) from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and (task is None or task.cancelling() == 0):
                return None  # cancelled by a close, not this task
            raise
        if self._closed:
            return None
        if msg is grpc.aio.EOF:
            self._finish()
            raise Unavailable("the watch ended without a reason", reason="STREAM_ENDED_EARLY")
        return msg

    def __aiter__(self) -> AsyncDirWatch:
        return self

    async def __anext__(self) -> FileEvent:
        while True:
            msg = await self._read()
            if msg is None:
                raise StopAsyncIteration
            kind = msg.WhichOneof("kind")
            if kind == "event":
                return FileEvent.from_pb(msg.event)
            if kind == "overflow":
                self.dropped += msg.overflow.dropped
            # keepalive: the stream is alive; nothing to yield

    def _finish(self) -> None:
        self._closed = True
        if self._call is not None:
            self._call.cancel()  # the sandbox removes its watch

    async def aclose(self) -> None:
        """Ends the watch (idempotent); an iteration in another task ends without an error."""
        self._finish()

    close = aclose

    async def __aenter__(self) -> AsyncDirWatch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
