"""Composition root of ``python -m compat``: config, the client pool, the ASGI app, uvicorn.

One HTTP/1.1 listener (plain TCP on loopback by default, TLS with a cert and key) serves
the E2B front end (``compat.e2b``); a SandboxFusion front end would be a second one here.
uvicorn ends on SIGTERM/SIGINT after in-flight requests (``shutdown_grace_s``); then the
pool's gRPC channels are closed.
"""

from __future__ import annotations

import logging

import uvicorn

from common.config import load
from common.telemetry import setup_logging
from compat.clients import ClientPool
from compat.config import CompatConfig
from compat.e2b.app import E2bApp

log = logging.getLogger(__name__)


async def main() -> None:
    config = load(CompatConfig, "COMPAT")
    setup_logging("compat", config.log_level, config.log_format)
    pool = ClientPool(
        config.apiserver, max_clients=config.clients_max, ttl_s=config.token_check_ttl_s
    )
    app = E2bApp(config, pool)
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
    log.info(
        "compat: E2B API on %s://%s (API server %s)",
        "https" if config.tls_cert else "http",
        config.listen,
        config.apiserver,
    )
    try:
        await server.serve()
    finally:
        await pool.close()
