"""SWE-ReX's remote-runtime HTTP API as one ASGI application (``DSEC_COMPAT_SWEREX_LISTEN``).

Routes, each under ``/sandboxes/<sandbox id>`` (the ``host`` a RemoteRuntime is given)::

    GET  /is_alive
    POST /create_session  /run_in_session  /close_session  /execute
         /read_file  /write_file  /close                    JSON bodies: swe-rex's models
    POST /upload          multipart: file, target_path, unzip ("true": a zip of a directory)

Authentication is RemoteRuntime's ``X-API-Key`` header, which carries a dsec token: the
sandbox must be visible to that token's project (else 404, as a missing one). A missing or
refused token is 401. Answers follow swe-rex's server: 200 with the response model; an error
of the runtime is 511 with ``{"swerexception": {message, class_path, traceback, extra_info}}``,
which RemoteRuntime raises again as the same class (``SessionDoesNotExistError``,
``CommandTimeoutError``, ``FileNotFoundError``, ``NotImplementedError`` ..., with dsec's reason
in the message); a body that does not validate is 422 with FastAPI's ``{"detail": [...]}``.

Bodies are bounded as they stream in: a JSON call's by ``DSEC_COMPAT_SWEREX_MAX_BODY_BYTES``
(64 MiB), an upload's by ``DSEC_COMPAT_SWEREX_MAX_UPLOAD_BYTES`` (1 GiB). Past its limit a
request is 413 ``{"detail": "... larger than N bytes"}`` (RemoteRuntime raises aiohttp's
``ClientResponseError``, status 413), before its token or sandbox is looked at: a refused upload
reaches no sandbox, and its partial temporary file is closed (so deleted) at once.

The SWE-ReX session names of each sandbox (name -> chronus session id) are the only state kept
here, in a bounded LRU: a restart of this process forgets them (the shells stay in the sandbox).
"""

from __future__ import annotations

import logging
import posixpath
import zipfile
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.applications import Starlette
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from swerex.exceptions import SwerexException
from swerex.runtime.abstract import (
    Action,
    CloseSessionRequest,
    Command,
    CreateSessionRequest,
    ReadFileRequest,
    UploadResponse,
    WriteFileRequest,
)

from compat.clients import ClientPool
from compat.config import CompatConfig
from compat.http import (
    HttpError,
    Receive,
    Request,
    Scope,
    Send,
    bounded,
    detail,
    http_error,
    read_body,
    serve_http,
    status_detail,
    token_refused,
)
from libdsec.errors import NotFound, PermissionDenied, Unauthenticated
from libdsec.harness.swerex import DsecRuntime, swerex_errors

log = logging.getLogger(__name__)

#: The JSON calls: endpoint -> the request body's type (swe-rex's models).
CALLS: dict[str, TypeAdapter[Any]] = {
    "create_session": TypeAdapter(CreateSessionRequest),
    "run_in_session": TypeAdapter(Action),
    "close_session": TypeAdapter(CloseSessionRequest),
    "execute": TypeAdapter(Command),
    "read_file": TypeAdapter(ReadFileRequest),
    "write_file": TypeAdapter(WriteFileRequest),
}
#: Sandboxes whose session names are remembered (least recently used dropped first).
MAX_SANDBOXES = 10_000


def transferred(exc: Exception) -> JSONResponse:
    """An error of the runtime as swe-rex's server sends it (RemoteRuntime raises it again)."""
    cls = type(exc)
    return JSONResponse(
        {
            "swerexception": {
                "message": str(exc),
                "class_path": f"{cls.__module__}.{cls.__qualname__}",
                "traceback": "",
                "extra_info": getattr(exc, "extra_info", {}),
            }
        },
        511,
    )


class SweRexApp:
    def __init__(self, config: CompatConfig, pool: ClientPool) -> None:
        self.config = config
        self.pool = pool
        self._sessions: OrderedDict[str, dict[str, str]] = OrderedDict()
        prefix = "/sandboxes/{sandbox_id}"
        self.app = Starlette(
            routes=[
                Route(f"{prefix}/is_alive", self.is_alive, methods=["GET"]),
                Route(f"{prefix}/upload", self.upload, methods=["POST"]),
                Route(f"{prefix}/close", self.close, methods=["POST"]),
                Route(f"{prefix}/{{call}}", self.call, methods=["POST"]),
            ],
            exception_handlers={
                404: status_detail,
                405: status_detail,
                HttpError: http_error,
                Unauthenticated: token_refused,
                PermissionDenied: token_refused,
                500: _internal,
            },
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_http(self.app, scope, receive, send)

    def _names(self, sandbox_id: str) -> dict[str, str]:
        """The sandbox's session names (kept for the next request)."""
        names = self._sessions.setdefault(sandbox_id, {})
        self._sessions.move_to_end(sandbox_id)
        while len(self._sessions) > MAX_SANDBOXES:
            self._sessions.popitem(last=False)
        return names

    async def _with_runtime(
        self, request: Request, fn: Callable[[DsecRuntime], Awaitable[Any]]
    ) -> Response:
        """``fn`` on a DsecRuntime of the request's sandbox, as the request's token."""
        sandbox_id = request.path_params["sandbox_id"]
        token = request.headers.get("x-api-key", "")
        if not token:
            return detail(401, "no dsec token: send X-API-Key (RemoteRuntime's auth_token)")
        async with self.pool.lease(token) as client:
            try:
                sandbox = await client.get(sandbox_id)
            except NotFound as exc:
                return detail(404, str(exc))
            runtime = DsecRuntime(sandbox, sessions=self._names(sandbox_id), logger=log)
            try:
                result = await fn(runtime)
            except (Unauthenticated, PermissionDenied):
                raise
            except (SwerexException, OSError, NotImplementedError, ValueError) as exc:
                return transferred(exc)  # the runtime's errors travel to the caller's runtime
            except Exception as exc:  # a bug here: logged, and still swe-rex's answer
                log.exception("swe-rex front end: %s on %s failed", request.url.path, sandbox_id)
                return transferred(exc)
        return JSONResponse(result.model_dump())

    async def call(self, request: Request) -> Response:
        name = request.path_params["call"]
        adapter = CALLS.get(name)
        if adapter is None:
            return detail(404, "Not Found")
        try:
            raw = await read_body(request, self.config.swerex_max_body_bytes)
            body = adapter.validate_json(raw or b"{}")
        except ValidationError as exc:
            return detail(422, exc.errors(include_url=False, include_context=False))
        return await self._with_runtime(request, lambda rt: getattr(rt, name)(body))

    async def is_alive(self, request: Request) -> Response:
        return await self._with_runtime(request, lambda rt: rt.is_alive())

    async def close(self, request: Request) -> Response:
        """Closes the sandbox's sessions (the sandbox stays: it is the caller's)."""
        return await self._with_runtime(request, lambda rt: rt.close())

    async def upload(self, request: Request) -> Response:
        """A file (streamed into the sandbox) or, with ``unzip=true``, a zipped directory
        (RemoteRuntime zips a directory) unpacked under ``target_path``."""
        form = await self._form(request)
        file, target = form.get("file"), form.get("target_path")
        if not isinstance(file, UploadFile) or not isinstance(target, str) or not target:
            await form.close()
            return detail(422, "upload needs a file part and a target_path field")
        unzip = form.get("unzip") == "true"

        async def put(rt: DsecRuntime) -> UploadResponse:
            with swerex_errors(f"uploading to {target}"):
                if not unzip:
                    await rt.sandbox.files.upload(file.file, target)
                    return UploadResponse()
                with zipfile.ZipFile(file.file) as zf:
                    for info in zf.infolist():
                        path = _inside(target, info.filename)
                        if info.is_dir():
                            await rt.sandbox.files.mkdir(path)
                        else:
                            with zf.open(info) as member:
                                await rt.sandbox.files.upload(member, path)
            return UploadResponse()

        try:
            return await self._with_runtime(request, put)
        finally:
            await form.close()

    async def _form(self, request: Request) -> FormData:
        """The upload's multipart form, read up to ``swerex_max_upload_bytes`` (Starlette's
        ``request.form()``, with the bound): past it, 413, and the parser closes the temporary
        files it spooled the parts to."""
        if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
            raise HttpError(422, "upload needs a multipart/form-data body")
        limit = self.config.swerex_max_upload_bytes
        parser = MultiPartParser(request.headers, bounded(request.stream(), limit, "upload"))
        try:
            return await parser.parse()
        except MultiPartException as exc:
            raise HttpError(400, exc.message) from None


def _inside(target: str, name: str) -> str:
    """The path of zip entry ``name`` unpacked under ``target``; ValueError if it leaves it."""
    root = posixpath.normpath(target)
    path = posixpath.normpath(posixpath.join(root, name))
    if path != root and not path.startswith(root.rstrip("/") + "/"):
        raise ValueError(f"zip entry {name!r} leaves {target}")
    return path


async def _internal(request: Request, exc: Exception) -> Response:
    return detail(500, "internal error in dsec's SWE-ReX front end")
