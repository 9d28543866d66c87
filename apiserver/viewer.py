"""The live view: a person watches or takes over a sandbox's screen in the browser.

The API server serves, on its own HTTP listener (``DSEC_APISERVER_VIEWER_ADDR``, loopback by
default; ``off`` serves none), three things:

- ``GET /view/{sandbox_id}?token=T``: checks the token and the sandbox as any call would, then
  redirects to noVNC's page configured to connect to the websocket below (``autoconnect``,
  ``resize=scale``, ``path``: noVNC 1.3 reads them from the query string and joins ``path`` to
  the page's host, so it carries the whole websocket path with the token, URL-encoded).
- ``/view/novnc/...``: Debian's noVNC (package ``novnc``) as static files. Without it on the
  host these answer 503 naming the package, and the page redirect does too: the viewer fails
  closed instead of serving half a page, while the gRPC API and the websocket (which does not
  need noVNC: any VNC-over-websocket client can use it) go on working.
- ``WS /view/{sandbox_id}/websockify?token=T`` (or ``Authorization: Bearer``, for clients
  that can set headers): binary frames bridged both ways to the sandbox edge's ``VncStream``
  (raw RFB bytes). The token is checked and the sandbox's owner compared through the
  :class:`~apiserver.gateway.Gateway`, the path every gRPC call takes: no token or a bad one
  is HTTP 401 before the upgrade, another project's sandbox (or none) 404 exactly like a
  missing one; nothing reaches the edge before both checks pass. Once upgraded, an error of
  the stream closes the websocket with code ``4000 + <the HTTP status of the error>`` and
  the reason ``<REASON>: <message>`` (e.g. 4501 ``BACKEND_CAPABILITY: ...`` for a sandbox
  without a display); the VNC server's end of the stream closes it with 1000.

The same listener serves the dashboard (``/dashboard``, apiserver/dashboard.py).

A token lives in the URL because a browser cannot put headers on a page load or a websocket;
uvicorn's access log stays off so it is not written to logs. The token is checked when the
page is loaded and when the websocket opens, as a gRPC stream is checked when it opens.

Timers: the websocket is pinged every 20 s and closed when a ping goes unanswered for 20 s
(uvicorn's ws_ping_*): a browser that went away ends its edge stream too. A paused sandbox's
VNC server does not answer; the browser shows a still screen and the websocket stays open
(pings are answered by the API server, not the VM) until the sandbox resumes or ends. A lost
node: the edge stream fails (gRPC keepalive of the edge channel) and the websocket closes with
the reason the API server gives for a lost edge (``SANDBOX_TERMINATED ... EDGE_LOST``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from urllib.parse import quote, urlencode

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from apiserver.config import ApiServerConfig
from apiserver.creation import Caller
from apiserver.gateway import Gateway
from dsec.edge.v1 import edge_pb2_grpc
from dsec.types.v1 import types_pb2
from libdsec.errors import DSecError, SandboxNotFound, Unauthenticated, Unavailable, from_rpc_error

log = logging.getLogger(__name__)

#: The Debian package that ships the page, named in the 503 when it is missing.
NOVNC_PACKAGE = "novnc"

#: A websocket close reason is at most 123 bytes (RFC 6455, 5.5: a control frame's payload
#: is <= 125 bytes, 2 of them the code).
MAX_CLOSE_REASON_BYTES = 123

#: HTTP status of an error, before the upgrade (and, + 4000, the websocket close code after).
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def http_status(err: DSecError) -> int:
    return _HTTP_STATUS.get(err.code, 500)


def close_reason(err: DSecError) -> str:
    """``REASON: message``, cut to what a close frame carries (on a character boundary)."""
    text = f"{err.reason}: {err.message}" if err.reason not in err.message else err.message
    raw = text.encode()
    if len(raw) <= MAX_CLOSE_REASON_BYTES:
        return text
    return raw[: MAX_CLOSE_REASON_BYTES - 3].decode(errors="ignore") + "..."


def viewer_base_url(cfg: ApiServerConfig) -> str:
    """The external base URL of the viewer ("" when none is served): DSEC_APISERVER_VIEWER_URL,
    else http:// and the listen address (this host's name for a wildcard address)."""
    if cfg.viewer_addr == "off":
        return ""
    if cfg.viewer_url:
        return cfg.viewer_url.rstrip("/")
    host, port = cfg.viewer_host, cfg.viewer_port
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_unspecified:
            host = socket.getfqdn()
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def viewer_url(cfg: ApiServerConfig, sandbox_id: str) -> str:
    """DisplayInfoResponse.viewer_url: the page of ``sandbox_id``, without the token (the
    caller appends ``?token=<its token>``); "" when this API server serves no viewer."""
    base = viewer_base_url(cfg)
    return f"{base}/view/{quote(sandbox_id, safe='')}" if base else ""


def request_token(conn: Request | WebSocket) -> str:
    """The token of ``?token=`` or of ``Authorization: Bearer``; "" when neither."""
    token = conn.query_params.get("token", "")
    if token:
        return token
    scheme, _, value = conn.headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


class _DenialNotAnError(logging.Filter):
    """uvicorn 0.54's websocket protocol (websockets-sansio) logs "ASGI callable returned
    without completing handshake." at ERROR after a refusal it sent itself (the HTTP denial
    response: its flag is not set on that path); a refused viewer is not a server error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing handshake."


class _Unavailable:
    """The ASGI app answering for noVNC's files when the package is not installed."""

    def __init__(self, message: str) -> None:
        self.message = message

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await PlainTextResponse(self.message, status_code=503)(scope, receive, send)


class Viewer:
    """The viewer's ASGI application and its server (see the module doc)."""

    def __init__(self, cfg: ApiServerConfig, gw: Gateway, routes: Sequence[BaseRoute] = ()) -> None:
        """``routes``: more pages on the same listener (the dashboard, apiserver/dashboard.py)."""
        self.cfg = cfg
        self.gw = gw
        self.novnc_dir = Path(cfg.novnc_dir)
        #: Why the page cannot be served ("" when it can), decided once at start.
        self.missing = (
            ""
            if (self.novnc_dir / "vnc.html").is_file()
            else (
                f"the live view needs noVNC: {self.novnc_dir / 'vnc.html'} is missing "
                f"(install the Debian package {NOVNC_PACKAGE!r})"
            )
        )
        novnc: StaticFiles | _Unavailable = (
            _Unavailable(self.missing) if self.missing else StaticFiles(directory=self.novnc_dir)
        )
        self.app = Starlette(
            routes=[
                Mount("/view/novnc", app=novnc),
                Route("/view/{sandbox_id}", self.page, methods=["GET"]),
                WebSocketRoute("/view/{sandbox_id}/websockify", self.websockify),
                *routes,
            ]
        )

    # ------------------------------------------------------------------ HTTP

    async def _authorize(
        self, token: str, sandbox_id: str
    ) -> tuple[Caller, edge_pb2_grpc.EdgeServiceStub]:
        """The caller and the sandbox's edge, checked as a gRPC call on the sandbox is: a
        missing or bad token is UNAUTHENTICATED, another project's sandbox NOT_FOUND."""
        if not token:
            # The gRPC API's reason (apiserver/routing.py), with the viewer's way to send one.
            raise Unauthenticated(
                "no token: open the viewer with ?token=<your dsec token>", reason="NO_TOKEN"
            )
        who = await self.gw.caller(token)
        try:
            stub = await self.gw.edge_for(who, sandbox_id)
        except (SandboxNotFound, Unavailable) as err:
            explained = await self.gw.explain(who, sandbox_id, err)
            raise explained from err
        return who, stub

    async def page(self, request: Request) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        if self.missing:
            return PlainTextResponse(self.missing, status_code=503)
        token = request_token(request)
        try:
            await self._authorize(token, sandbox_id)
        except DSecError as err:
            return PlainTextResponse(str(err), status_code=http_status(err))
        # noVNC joins `path` to "ws(s)://<host:port>/"; keep any prefix a proxy put in front.
        prefix = request.url.path[: -len(f"view/{sandbox_id}")].lstrip("/")
        ws_path = f"{prefix}view/{quote(sandbox_id, safe='')}/websockify?" + urlencode(
            {"token": token}
        )
        query = urlencode({"autoconnect": "1", "resize": "scale", "path": ws_path})
        # Relative to /view/{id}: the page is /view/novnc/vnc.html behind any prefix.
        response = RedirectResponse(f"novnc/vnc.html?{query}", status_code=303)
        response.headers["cache-control"] = "no-store"
        response.headers["referrer-policy"] = "no-referrer"
        return response

    # ------------------------------------------------------------- websocket

    async def websockify(self, ws: WebSocket) -> None:
        sandbox_id = ws.path_params["sandbox_id"]
        try:
            who, stub = await self._authorize(request_token(ws), sandbox_id)
        except DSecError as err:
            await self._refuse(ws, err)
            return
        protocols = ws.scope.get("subprotocols") or []
        await ws.accept(subprotocol="binary" if "binary" in protocols else None)
        log.info("viewer of %s opened (project %s)", sandbox_id, who.project_id)
        try:
            code, reason = await self._bridge(ws, stub, who, sandbox_id)
        except WebSocketDisconnect:
            code, reason = 1000, ""
        log.info("viewer of %s closed: %s %s", sandbox_id, code, reason)
        if ws.application_state is WebSocketState.CONNECTED:
            with contextlib.suppress(RuntimeError, WebSocketDisconnect):
                await ws.close(code, reason)

    async def _refuse(self, ws: WebSocket, err: DSecError) -> None:
        """An HTTP error answer instead of the upgrade (a close before accept where the server
        does not offer the denial-response extension: uvicorn's websockets does)."""
        try:
            await ws.send_denial_response(PlainTextResponse(str(err), http_status(err)))
        except RuntimeError:
            await ws.close(4000 + http_status(err), close_reason(err))

    async def _bridge(
        self, ws: WebSocket, stub: edge_pb2_grpc.EdgeServiceStub, who: Caller, sandbox_id: str
    ) -> tuple[int, str]:
        """Bytes both ways until one side ends; the close code and reason to send."""
        viewer_left = asyncio.Event()

        async def upstream() -> AsyncIterator[types_pb2.VncData]:
            yield types_pb2.VncData(open=types_pb2.VncOpen(sandbox_id=sandbox_id))
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    # The edge stream ends with the viewer, whatever the VNC server does.
                    viewer_left.set()
                    call.cancel()
                    return
                data = message.get("bytes")
                if data is None:  # a text frame: RFB is binary; take its bytes as sent
                    data = str(message.get("text") or "").encode()
                if data:
                    yield types_pb2.VncData(data=data)

        call = stub.VncStream(upstream())
        try:
            async for item in call:
                if item.WhichOneof("kind") == "data" and item.data:
                    await ws.send_bytes(item.data)
        except asyncio.CancelledError:
            # grpc.aio raises this for a call cancelled here: the viewer left (a cancellation
            # of this task itself, the server's shutdown, goes on).
            task = asyncio.current_task()
            if viewer_left.is_set() and task is not None and not task.cancelling():
                return 1000, ""
            raise
        except grpc.aio.AioRpcError as exc:
            if viewer_left.is_set():
                return 1000, ""
            failure = from_rpc_error(exc)
            failure = await self.gw.explain(who, sandbox_id, failure)
            return 4000 + http_status(failure), close_reason(failure)
        finally:
            call.cancel()
        if viewer_left.is_set():
            return 1000, ""
        return 1000, "the sandbox's VNC server closed the stream"

    # ---------------------------------------------------------------- server

    def bind(self) -> socket.socket:
        """The listening socket, bound now so a taken port stops the API server at start."""
        host = self.cfg.viewer_host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, self.cfg.viewer_port), family=family, backlog=512)

    async def serve(self, sock: socket.socket) -> None:
        """Serves until cancelled (the API server's shutdown), then closes its connections
        within the shutdown grace. uvicorn's own ``serve`` is not used: it takes over
        SIGTERM/SIGINT, which belong to the API server's gRPC server."""
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,
            access_log=False,  # the URLs carry tokens
            http="httptools",
            ws="websockets-sansio",
            ws_ping_interval=20.0,
            ws_ping_timeout=20.0,
            timeout_graceful_shutdown=max(1, int(self.cfg.shutdown_grace_s)),
        )
        config.load()
        logging.getLogger("uvicorn.error").addFilter(_DenialNotAnError())
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        if self.missing:
            log.warning("viewer: %s; /view answers 503", self.missing)
        log.info("viewer on %s (pages at %s/view/<sandbox id>, dashboard at %s/dashboard)",
                 self.cfg.viewer_addr, viewer_base_url(self.cfg), viewer_base_url(self.cfg))  # fmt: skip
        try:
            await server.main_loop()
        finally:
            server.should_exit = True
            await server.shutdown(sockets=[sock])
