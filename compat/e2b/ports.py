"""HTTP into a port of a sandbox: ``{port}-{sandboxID}.{domain}`` (or the routing headers
with a port other than envd's), forwarded with libdsec's ``sb.http`` (SendHttp).

E2B can make sandbox URLs public; dsec always asks for the traffic access token (the
caller's key, returned as ``trafficAccessToken``), in ``e2b-traffic-access-token`` or
``X-Access-Token``, also for a sandbox created with ``allowPublicTraffic: true`` (accepted
as E2B's default, see ``mapping.network_for``). Bodies are buffered (``DSEC_COMPAT_MAX_PORT_BODY_BYTES``); WebSockets
and streamed responses are not forwarded.
"""

from __future__ import annotations

from starlette.responses import Response

from compat.clients import ClientPool
from compat.config import CompatConfig
from compat.e2b import dsec
from compat.e2b.errors import gone_message, http_status, sandbox_gone
from compat.e2b.http import Request, error, read_body
from compat.e2b.routing import Target, traffic_token
from libdsec.errors import DSecError, Unavailable

#: Not forwarded either way: hop-by-hop, routing and our own credentials.
_DROP = {
    "host",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "proxy-connection",
    "content-length",
    "x-access-token",
    "e2b-traffic-access-token",
    "e2b-sandbox-id",
    "e2b-sandbox-port",
}


class PortProxy:
    def __init__(self, config: CompatConfig, pool: ClientPool) -> None:
        self.config = config
        self.pool = pool

    async def handle(self, route: Target, request: Request) -> Response:
        if not 1 <= route.port <= 65535:
            return error(400, f"port {route.port} is not a port")
        body = await read_body(request, self.config.max_port_body_bytes)
        query = request.scope.get("query_string", b"").decode("latin-1")
        path = request.scope["path"] + (f"?{query}" if query else "")
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in request.headers.raw
            if k.decode("latin-1").lower() not in _DROP
        }
        try:
            async with self.pool.lease(traffic_token(request)) as client:
                resp = await dsec.sandbox(client, route.sandbox_id).http(
                    route.port, path, method=request.method, headers=headers, body=body
                )
        except DSecError as exc:
            if sandbox_gone(exc):
                return error(502, gone_message(route.sandbox_id))
            if isinstance(exc, Unavailable):
                return error(
                    502, f"The sandbox is running but port {route.port} is not open: {exc.message}"
                )
            if http_status(exc) == 401:
                return error(401, "a traffic access token (the API key) is required")
            return error(http_status(exc), exc.message)
        response = Response(resp.body, resp.status)
        # The sandbox's headers as it sent them (repeated ones too), before content-length.
        response.raw_headers[:0] = [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in resp.headers
            if k.lower() not in _DROP
        ]
        return response
