"""envd's REST endpoints: ``GET /files`` (download), ``POST /files`` (upload), ``/health``.

Both directions stream through libdsec and never hold a whole file: a download sends each
chunk of ``sb.files.iter_download`` as it arrives; an upload (``application/octet-stream``,
or ``multipart/form-data`` with one or more files, as ``write_files`` sends) feeds the
request body through a small bounded pipe into ``sb.files.upload``, which writes the file
atomically when it is complete. HTTP/1.1 flow control pushes back on a fast client.

A body with ``Content-Encoding: gzip`` (the SDK's ``files.write(..., gzip=True)``) is inflated
as it streams, a piece at a time, and counted decoded against ``DSEC_COMPAT_MAX_UPLOAD_BYTES``
(413 past it); malformed gzip is 400 and another coding 415 (before any of it is read). A body
refused before its first decoded byte (not gzip at all) writes nothing. Known gap: an upload that
fails once under way (gzip cut short or with a bad checksum, past the limit, or a plain body
that breaks off) is aborted (its gRPC call cancelled), and the bytes received so far were
seen written all the same: the cancellation seems to reach the edge as the end of the stream.
That is for the upload's path through the API server and edge to fix, not this module. In a multipart body each file appears when its part ends, so the files
before a failure stay.

File metadata arrives as envd takes it: each ``X-Metadata-<key>: <value>`` request header (the
key lowercased) is one entry, the same set for every file of the request, and becomes the
file's whole metadata (its ``user.e2b.<key>`` extended attributes, written by chronus with the
file); each written file's answer carries the metadata read back. A bad key or value is 400 and
writes nothing (chronus checks it before the first byte).
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any, cast

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.responses import JSONResponse, Response, StreamingResponse

from compat.e2b.envd.call import CALL, EnvdCall
from compat.e2b.errors import gone_message, http_status, sandbox_gone
from compat.e2b.http import HttpError, Request, bounded, decoded, error
from libdsec import FileInfo
from libdsec.errors import DSecError, FailedPrecondition, NotFound

#: Chunks queued between the HTTP body and the upload (each up to ~64 KiB from the server).
PIPE_CHUNKS = 16


class BodyPipe:
    """Request bytes from the event loop to libdsec's upload, which reads file objects in a
    worker thread (``read(n)``); bounded, so a fast client waits for the sandbox."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(PIPE_CHUNKS)
        self._buf = bytearray()
        self._eof = False
        self._aborted = False

    def offer(self, data: bytes | None) -> bool:
        """Queues without waiting if there is room (the common case)."""
        if self._queue.full():
            return False
        self._queue.put_nowait(data)
        return True

    async def put(self, data: bytes) -> None:
        await self._queue.put(data)

    async def close(self) -> None:
        await self._queue.put(None)

    def abort(self) -> None:
        """Unblocks a reader waiting for more (the upload then fails and leaves nothing)."""
        self._aborted = True
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(None)

    def read(self, n: int = -1) -> bytes:  # in a worker thread
        while not self._eof and (n < 0 or len(self._buf) < n):
            item = asyncio.run_coroutine_threadsafe(self._queue.get(), self._loop).result()
            if self._aborted:
                raise OSError("upload aborted")
            if item is None:
                self._eof = True
            else:
                self._buf += item
        size = len(self._buf) if n < 0 else min(n, len(self._buf))
        out = bytes(self._buf[:size])
        del self._buf[:size]
        return out


def _user_call(call: EnvdCall, request: Request) -> EnvdCall:
    user = request.query_params.get("username")
    return replace(call, user=user) if user else call


#: envd's request-header prefix of file metadata (lowercase: Starlette's header names).
METADATA_HEADER_PREFIX = "x-metadata-"


def _metadata(request: Request) -> dict[str, str]:
    """The request's ``X-Metadata-*`` headers, keys lowercased, the first value of each."""
    out: dict[str, str] = {}
    for name, value in request.headers.items():
        key = name[len(METADATA_HEADER_PREFIX) :]
        if name.startswith(METADATA_HEADER_PREFIX) and key and key not in out:
            out[key] = value
    return out


def _written(path: str, info: FileInfo | None) -> dict[str, Any]:
    out: dict[str, Any] = {"path": path, "name": posixpath.basename(path), "type": "file"}
    if info is not None and info.metadata:
        out["metadata"] = dict(info.metadata)
    return out


def _dsec_error(call: EnvdCall, path: str, exc: DSecError) -> Response:
    if sandbox_gone(exc):
        return error(502, gone_message(call.sandbox_id))
    if isinstance(exc, NotFound):
        return error(404, f"path '{path}' does not exist")
    if isinstance(exc, FailedPrecondition) and exc.reason == "IS_A_DIRECTORY":
        return error(400, f"path '{path}' is a directory")
    if exc.reason in ("NO_SPACE", "DISK_QUOTA_EXCEEDED"):
        return error(507, "not enough disk space available")
    if exc.reason == "INVALID_METADATA":
        return error(400, f"invalid metadata: {exc.message}")
    return error(http_status(exc), exc.message)


class FilesRest:
    """The two routes; each acts as the envd call of the request (``CALL``), as the user
    ``?username=`` names if it does."""

    async def download(self, request: Request) -> Response:
        call = _user_call(CALL.get(), request)
        raw = request.query_params.get("path")
        if not raw:
            return error(400, "path is required")
        path = call.resolve(raw)
        # an async generator (its annotation says AsyncIterator): closed when done with
        chunks = cast(AsyncGenerator[bytes, None], call.sandbox.files.iter_download(path))
        try:  # the first chunk (or the error) before the status line is sent
            first: bytes | None = await anext(chunks)
        except StopAsyncIteration:
            first = None
        except BaseException as exc:
            await chunks.aclose()
            if isinstance(exc, DSecError):
                return _dsec_error(call, path, exc)
            raise

        async def body() -> AsyncIterator[bytes]:
            try:
                if first is not None:
                    yield first
                    async for chunk in chunks:
                        yield chunk
            finally:
                await chunks.aclose()

        name = posixpath.basename(path).replace('"', "")
        return StreamingResponse(
            body(),
            media_type="application/octet-stream",
            headers={"content-disposition": f'attachment; filename="{name}"'},
        )

    async def upload(self, request: Request) -> Response:
        call = _user_call(CALL.get(), request)
        ctype, params = parse_options_header(request.headers.get("content-type", ""))
        metadata = _metadata(request)
        try:
            encoding = request.headers.get("content-encoding")
            body = bounded(
                decoded(request.stream(), encoding),
                call.config.max_upload_bytes,
                "upload (decoded)" if encoding else "upload",
            )
            if ctype == b"multipart/form-data":
                boundary = params.get(b"boundary")
                if not boundary:
                    raise HttpError(400, "multipart/form-data without a boundary")
                written = await self._multipart(call, body, request, boundary, metadata)
            else:
                raw = request.query_params.get("path")
                if not raw:
                    raise HttpError(400, "path is required for an application/octet-stream upload")
                path = call.resolve(raw)
                info = await self._upload_one(call, path, body, metadata)
                written = [_written(path, info)]
        except HttpError as exc:
            return error(exc.status, exc.message)
        except _UploadFailed as exc:
            return _dsec_error(call, exc.path, exc.error)
        return JSONResponse(written)

    async def _upload_one(
        self, call: EnvdCall, path: str, body: AsyncIterator[bytes], metadata: dict[str, str]
    ) -> FileInfo:
        # The upload starts with the body's first bytes: a body refused before any (not gzip
        # at all) never reaches the sandbox. One refused later (truncated gzip, a bad
        # checksum, past the limit) aborts an upload under way; see the module's docstring.
        body = aiter(body)
        first = await anext(body, b"")
        pipe = BodyPipe(asyncio.get_running_loop())
        pipe.offer(first)
        upload = call.sandbox.files.upload
        task = asyncio.create_task(
            upload(pipe, path, user=call.run_as, metadata=metadata)  # type: ignore[arg-type]
        )
        try:
            async for chunk in body:
                if task.done():
                    break
                await _put(pipe, chunk, task)
            if not task.done():
                await _put(pipe, None, task)
            return await task
        except DSecError as exc:
            raise _UploadFailed(path, exc) from None
        finally:
            if not task.done():
                pipe.abort()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await task

    async def _multipart(
        self,
        call: EnvdCall,
        body: AsyncIterator[bytes],
        request: Request,
        boundary: bytes,
        metadata: dict[str, str],
    ) -> list[dict[str, Any]]:
        """Each file part streamed into its own upload, in order (``write_files``)."""
        events: list[tuple[str, Any]] = []
        header: dict[str, bytearray] = {"field": bytearray(), "value": bytearray()}
        headers: dict[str, str] = {}

        def on_header_end() -> None:
            headers[header["field"].decode("latin-1").lower()] = header["value"].decode()
            header["field"].clear()
            header["value"].clear()

        parser = MultipartParser(
            boundary,
            {
                "on_part_begin": lambda: headers.clear(),
                "on_header_field": lambda d, s, e: header["field"].extend(d[s:e]),
                "on_header_value": lambda d, s, e: header["value"].extend(d[s:e]),
                "on_header_end": on_header_end,
                "on_headers_finished": lambda: events.append(("part", dict(headers))),
                "on_part_data": lambda d, s, e: events.append(("data", bytes(d[s:e]))),
                "on_part_end": lambda: events.append(("end", None)),
            },
        )
        query_path = request.query_params.get("path")
        written: list[dict[str, Any]] = []
        pipe: BodyPipe | None = None
        task: asyncio.Task[Any] | None = None
        path = ""
        try:
            async for chunk in body:
                parser.write(chunk)
                for kind, value in events:
                    if kind == "part":
                        _, disposition = parse_options_header(value.get("content-disposition", ""))
                        filename = disposition.get(b"filename", b"").decode()
                        # envd's rule: ?path= names every part's file (an upload URL's
                        # file lands there whatever the form calls it), else its filename
                        raw = query_path or filename
                        if not raw:
                            raise HttpError(400, "a file part without a filename (its path)")
                        path = call.resolve(raw)
                        if any(w["path"] == path for w in written):
                            raise HttpError(
                                400,
                                "you cannot upload multiple files to the same path"
                                f" '{path}' in one upload request, only the first specified"
                                " file was uploaded",
                            )
                        pipe = BodyPipe(asyncio.get_running_loop())
                        upload = call.sandbox.files.upload
                        task = asyncio.create_task(
                            upload(pipe, path, user=call.run_as, metadata=metadata)  # type: ignore[arg-type]
                        )
                    elif kind == "data" and pipe is not None and task is not None:
                        await _put(pipe, value, task)
                    elif kind == "end" and pipe is not None and task is not None:
                        await _put(pipe, None, task)
                        try:
                            info = await task
                        except DSecError as exc:
                            raise _UploadFailed(path, exc) from None
                        written.append(_written(path, info))
                        pipe, task = None, None
                events.clear()
            parser.finalize()
        finally:
            if pipe is not None and task is not None and not task.done():
                pipe.abort()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await task
        if not written:
            raise HttpError(400, "no file in the multipart body")
        return written


class _UploadFailed(Exception):
    def __init__(self, path: str, error: DSecError) -> None:
        super().__init__(path)
        self.path = path
        self.error = error


async def _put(pipe: BodyPipe, data: bytes | None, task: asyncio.Task[Any]) -> None:
    """Into the pipe unless the upload has already failed (then its error is raised)."""
    if not task.done() and pipe.offer(data):
        return
    put = asyncio.ensure_future(pipe.put(data) if data is not None else pipe.close())
    done, _ = await asyncio.wait({put, task}, return_when=asyncio.FIRST_COMPLETED)
    if put not in done:
        put.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await put
        task.result()  # raises the upload's error
        raise HttpError(400, "the upload ended before the request body")
