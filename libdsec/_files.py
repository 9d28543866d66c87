"""Files inside a sandbox: :class:`AsyncFiles` (``sandbox.files``).

await sb.files.write("/work/a.txt", "hello")
assert await sb.files.read("/work/a.txt") == b"hello"
await sb.files.upload("dataset.tar", "/work/dataset.tar")   # streamed, one chunk in memory
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from dsec.types.v1 import types_pb2
from libdsec.errors import NotFound
from libdsec.types import FileInfo

if TYPE_CHECKING:
    from libdsec._sandbox import AsyncSandbox

#: Bytes per message of an upload or download.
CHUNK = 1024 * 1024


class AsyncFiles:
    """Filesystem operations inside a sandbox."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self.sandbox = sandbox

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        c = self.sandbox.client
        rpc = c._rpc
        return rpc.unary(getattr(rpc.files, method), request, timeout=c._t(timeout))

    async def read(self, path: str, *, offset: int = 0, length: int = 0) -> bytes:
        """A whole small file (or a slice); use :meth:`download` for big ones."""
        if length == 0 and offset == 0:
            chunks = [chunk async for chunk in self.iter_download(path)]
            return b"".join(chunks)
        resp = await self._call(
            "ReadFile",
            types_pb2.ReadFileRequest(
                sandbox_id=self.sandbox.id, path=path, offset=offset, length=length
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
    ) -> FileInfo:
        raw = data.encode() if isinstance(data, str) else data
        if len(raw) > 4 * 1024 * 1024:
            return await self.upload(raw, path, mode=mode, make_parents=make_parents)
        resp = await self._call(
            "WriteFile",
            types_pb2.WriteFileRequest(
                sandbox_id=self.sandbox.id,
                path=path,
                data=raw,
                mode=mode,
                append=append,
                make_parents=make_parents,
            ),
        )
        return FileInfo.from_pb(resp.info)

    async def list(self, path: str, *, max_entries: int = 0) -> list[FileInfo]:
        resp = await self._call(
            "ListDir",
            types_pb2.ListDirRequest(
                sandbox_id=self.sandbox.id, path=path, max_entries=max_entries
            ),
        )
        return [FileInfo.from_pb(e) for e in resp.entries]

    async def stat(self, path: str, *, follow_symlinks: bool = True) -> FileInfo:
        resp = await self._call(
            "StatPath",
            types_pb2.StatPathRequest(
                sandbox_id=self.sandbox.id, path=path, follow_symlinks=follow_symlinks
            ),
        )
        return FileInfo.from_pb(resp.info)

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path, follow_symlinks=False)
            return True
        except NotFound:
            return False

    async def mkdir(self, path: str, *, mode: int = 0, parents: bool = True) -> FileInfo:
        resp = await self._call(
            "MakeDir",
            types_pb2.MakeDirRequest(
                sandbox_id=self.sandbox.id, path=path, mode=mode, parents=parents
            ),
        )
        return FileInfo.from_pb(resp.info)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._call(
            "RemovePath",
            types_pb2.RemovePathRequest(sandbox_id=self.sandbox.id, path=path, recursive=recursive),
        )

    async def move(self, source: str, destination: str, *, overwrite: bool = False) -> FileInfo:
        resp = await self._call(
            "MovePath",
            types_pb2.MovePathRequest(
                sandbox_id=self.sandbox.id,
                source=source,
                destination=destination,
                overwrite=overwrite,
            ),
        )
        return FileInfo.from_pb(resp.info)

    async def chmod(self, path: str, mode: int) -> FileInfo:
        resp = await self._call(
            "ChmodPath",
            types_pb2.ChmodPathRequest(sandbox_id=self.sandbox.id, path=path, mode=mode),
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
    ) -> FileInfo:
        """Streams ``source`` (bytes, a local path, or a binary file object) into ``path``.

        The file appears atomically when the whole stream has arrived; a
        failed upload leaves nothing behind. Memory use is one chunk.
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
                    sandbox_id=self.sandbox.id,
                    path=path,
                    mode=mode,
                    make_parents=make_parents,
                    size_bytes=size,
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

        rpc = self.sandbox.client._rpc
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
        rpc = self.sandbox.client._rpc
        request = types_pb2.DownloadFileRequest(
            sandbox_id=self.sandbox.id, path=path, offset=offset, chunk_bytes=chunk_bytes
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
