"""Composition root of ``python -m compat``: config, the client pool, the ASGI apps, uvicorn.

One uvicorn server (HTTP/1.1, plain TCP on loopback by default, TLS with a cert and key)
listens on two sockets: ``DSEC_COMPAT_LISTEN`` serves the E2B front end (``compat.e2b``),
``DSEC_COMPAT_SANDBOX_FUSION_LISTEN`` the SandboxFusion one (``compat.sandboxfusion``); a
request goes to the app of the socket it came in on. Both share one pool of libdsec clients.
uvicorn ends on SIGTERM/SIGINT after in-flight requests (``shutdown_grace_s``); then the
pool's gRPC channels are closed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvicorn

from common.config import ConfigError, load
from common.telemetry import setup_logging
from compat.clients import ClientPool
from compat.config import CompatConfig
from compat.e2b.app import E2bApp
from compat.http import Receive, Scope, Send
from compat.sandboxfusion.app import SandboxFusionApp

log = logging.getLogger(__name__)


async def main() -> None:
    config = load(CompatConfig, "COMPAT")
    setup_logging("compat", config.log_level, config.log_format)
    pool = ClientPool(
        config.apiserver, max_clients=config.clients_max, ttl_s=config.token_check_ttl_s
    )
    e2b = E2bApp(config, pool)
    sockets = [_listen(config.host, config.port)]
    by_port: dict[int, Callable[[Scope, Receive, Send], Awaitable[None]]] = {
        sockets[0].getsockname()[1]: e2b
    }
    fusion: SandboxFusionApp | None = None
    if config.sandbox_fusion_listen:
        token = ""
        if config.sandbox_fusion_token_file:
            token = (
                await asyncio.to_thread(Path(config.sandbox_fusion_token_file).read_text)
            ).strip()
            if not token:
                raise ConfigError(f"{config.sandbox_fusion_token_file} holds no token")
        fusion = SandboxFusionApp(config, pool, default_token=token)
        sockets.append(_listen(config.sandbox_fusion_host, config.sandbox_fusion_port))
        by_port[sockets[1].getsockname()[1]] = fusion

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        # scope["server"] is the local address of the socket the connection came in on.
        target = by_port.get(scope.get("server", ("", 0))[1], e2b)
        await target(scope, receive, send)

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            lifespan="off",
            log_config=None,
            access_log=False,
            http="httptools",
            ssl_certfile=config.tls_cert or None,
            ssl_keyfile=config.tls_key or None,
            timeout_graceful_shutdown=int(config.shutdown_grace_s) or None,
            timeout_keep_alive=75,
        )
    )
    scheme = "https" if config.tls_cert else "http"
    log.info("compat: E2B API on %s://%s (API server %s)", scheme, config.listen, config.apiserver)
    if fusion is not None:
        log.info(
            "compat: SandboxFusion API on %s://%s/t/<token>/run_code%s",
            scheme,
            config.sandbox_fusion_listen,
            " (requests without a token act as the token file's)" if fusion.default_token else "",
        )
    try:
        await server.serve(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
        await pool.close()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)
