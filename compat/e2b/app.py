"""The E2B front end as one ASGI application: control API, envd and port traffic.

    request ──route()──► control  (compat.e2b.control: REST, X-API-Key)
                   ├───► envd     /process.Process/*, /filesystem.Filesystem/* (Connect,
                   │              connectrpc), /files, /health (REST); X-Access-Token
                   └───► port     HTTP into a sandbox port (compat.e2b.ports)

Every request acts with the caller's dsec token through a leased libdsec client
(``compat.clients``). A Connect message that does not decode is ``invalid_argument`` and
the service goes on serving; an exception of ours is logged and answered 500/``internal``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from connectrpc.code import Code
from connectrpc.codec import Codec, proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from compat.clients import ClientPool
from compat.config import CompatConfig
from compat.e2b import mapping
from compat.e2b.control import ControlApi
from compat.e2b.envd.call import (
    CALL,
    DEFAULT_KEEPALIVE_S,
    ConnectionDropped,
    DefaultUsers,
    EnvdCall,
)
from compat.e2b.envd.files import FilesRest
from compat.e2b.envd.filesystem import FilesystemService
from compat.e2b.envd.gen.filesystem.filesystem_connect import FilesystemASGIApplication
from compat.e2b.envd.gen.process.process_connect import ProcessASGIApplication
from compat.e2b.envd.process import ProcessService
from compat.e2b.errors import gone_message, http_status
from compat.e2b.http import INTERNAL, Request, error, internal_error
from compat.e2b.ports import PortProxy
from compat.e2b.routing import Target, access_token, envd_user, key_of, route
from compat.e2b.signing import (
    SandboxTokens,
    SignatureAmbiguous,
    SignatureRefused,
    signed_request,
)
from compat.http import (
    ClientDisconnect,
    Message,
    Receive,
    Scope,
    Send,
    reset,
    without_trailing_slash,
)
from libdsec.errors import DSecError, NotFound, Unauthenticated

log = logging.getLogger(__name__)

PROCESS_PREFIX = "/process.Process/"
FILESYSTEM_PREFIX = "/filesystem.Filesystem/"


class _StrictCodec:
    """connectrpc's codec, but a message that does not decode is ``invalid_argument``
    (connectrpc would call it ``unknown``)."""

    def __init__(self, inner: Codec) -> None:
        self._inner = inner

    def name(self) -> str:
        return str(self._inner.name())

    def encode(self, message: Any) -> bytes:
        return bytes(self._inner.encode(message))

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._inner.decode(data, message_class)
        except ConnectError:
            raise
        except Exception as exc:
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"malformed {message_class.__name__}: {exc}"
            ) from None


def codecs() -> Iterable[Codec]:
    return [_StrictCodec(proto_json_codec()), _StrictCodec(proto_binary_codec())]


class E2bApp:
    def __init__(self, config: CompatConfig, pool: ClientPool) -> None:
        self.config = config
        self.pool = pool
        self.users = DefaultUsers(config)
        #: each sandbox's envd access tokens, for signed file URLs (compat.e2b.signing)
        self.tokens = SandboxTokens()
        self.control = ControlApi(config, pool, self.tokens)
        self.files = FilesRest()
        self.ports = PortProxy(config, pool)
        self.process = ProcessASGIApplication(
            ProcessService(config.max_output_bytes), codecs=codecs()
        )
        self.filesystem = FilesystemASGIApplication(FilesystemService(), codecs=codecs())
        #: envd's routes, served with the call's client leased (`envd`).
        self.envd_app = Starlette(
            routes=[
                Route(PROCESS_PREFIX + "{method}", self.process),
                Route(FILESYSTEM_PREFIX + "{method}", self.filesystem),
                Route("/health", self.health, methods=ANY_METHOD),
                Route("/files", self.files.download, methods=["GET"]),
                Route("/files", self.files.upload, methods=["POST"]),
                *(Route(p, _not_supported, methods=ANY_METHOD) for p in FILES_UNSUPPORTED),
            ],
            exception_handlers={404: _no_route, 405: _no_route, 500: internal_error},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        request = Request(scope, receive)
        r = route(request)
        if r.kind == "control" and _signed_files(request):
            # a signed URL under a shared E2B_SANDBOX_URL: its sandbox is found by signature
            r = Target("envd")
        try:
            if r.kind == "control":
                await self.control.handle(scope, receive, tracked)
            elif r.kind == "port":
                response = await self.ports.handle(r, request)
                await response(scope, receive, tracked)
            else:
                await self.envd(r, request, tracked)
        except ClientDisconnect:
            return
        except ConnectionDropped as exc:
            log.info("e2b: %s %s: %s", request.method, request.url.path, exc)
            # a reset, as E2B's proxy drops it; else the HTTP server closes it mid-response
            reset(scope)
            raise
        except Exception:
            log.exception("e2b: %s %s failed", request.method, request.url.path)
            if not started:
                await error(500, INTERNAL)(scope, receive, tracked)

    async def envd(self, r: Target, request: Request, send: Send) -> None:
        path = request.url.path
        is_rpc = path.startswith((PROCESS_PREFIX, FILESYSTEM_PREFIX))
        try:
            interval = float(
                request.headers.get("keepalive-ping-interval", "") or DEFAULT_KEEPALIVE_S
            )
        except ValueError:
            interval = DEFAULT_KEEPALIVE_S
        token = access_token(request)
        if not token and _files(request):
            # envd's signed URL: the signature stands for the token (compat.e2b.signing)
            try:
                query = dict(request.query_params)
                sandbox_id, token = self.tokens.verify(
                    r.sandbox_id, signed_request(request.method, query)
                )
            except (SignatureRefused, SignatureAmbiguous) as exc:
                status = 401 if isinstance(exc, SignatureRefused) else 409
                await error(status, str(exc))(request.scope, request.receive, send)
                return
            r = Target("envd", sandbox_id, r.port)
        try:
            key = key_of(token, r.sandbox_id)
            if key is None:
                raise Unauthenticated("it is another sandbox's envd access token")
            async with self.pool.lease(key) as client:
                self.tokens.seen(r.sandbox_id, token)
                user, workdir = await self.users.of(client, r.sandbox_id)
                call = EnvdCall(
                    client,
                    r.sandbox_id,
                    envd_user(request),
                    self.config,
                    max(interval, 1.0),
                    user,
                    workdir,
                )
                current = CALL.set(call)

                async def drop_when_ended(message: Message) -> None:
                    if call.dropped and message["type"] == "http.response.body":
                        if not message.get("more_body", False):
                            raise ConnectionDropped(call.sandbox_id)
                    await send(message)

                try:
                    scope = without_trailing_slash(request.scope)
                    await self.envd_app(scope, request.receive, drop_when_ended)
                finally:
                    CALL.reset(current)
        except DSecError as exc:  # the lease: a missing or bad token
            status = http_status(exc)
            message = f"invalid access token (the API key, a dsec token): {exc.message}"
            if is_rpc:
                code = "unauthenticated" if status == 401 else "unavailable"
                response: Response = JSONResponse({"code": code, "message": message}, status)
            else:
                response = error(status, message)
            await response(request.scope, request.receive, send)

    async def health(self, request: Request) -> Response:
        """envd's 204, or what E2B's proxy says for a sandbox that is not running (502)."""
        call = CALL.get()
        try:
            info = (await call.client.get(call.sandbox_id)).info
        except NotFound:
            return error(502, gone_message(call.sandbox_id))
        if info.state in ("RUNNING", "STARTING", "PENDING"):
            return Response(status_code=204)
        return error(502, gone_message(call.sandbox_id))


def _files(request: Request) -> bool:
    return request.url.path.rstrip("/") == "/files" and request.method in ("GET", "POST")


def _signed_files(request: Request) -> bool:
    """A signed ``/files`` URL without a token (the control API has no /files)."""
    return (
        _files(request)
        and "signature" in request.query_params
        and not access_token(request)
        and not request.headers.get("x-api-key")
    )


#: envd's REST paths dsec does not serve: 501.
FILES_UNSUPPORTED = ("/files/compose", "/metrics", "/envs")
#: Every method (routes that answer whatever they are asked with).
ANY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


async def _not_supported(request: Request) -> Response:
    return error(501, f"{request.url.path} is not supported by dsec")


async def _no_route(request: Request, exc: Exception) -> Response:
    return error(404, f"{request.method} {request.url.path}: no such route")


__all__ = ["E2bApp", "mapping"]
