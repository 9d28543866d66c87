"""Composition root of ``python -m compat``: config, the client pool, the ASGI apps, uvicorn.

One uvicorn server (HTTP/1.1, plain TCP on loopback by default, TLS with a cert and key)
listens on up to three sockets: ``DSEC_COMPAT_LISTEN`` serves the E2B front end
(``compat.e2b``), ``DSEC_COMPAT_SANDBOX_FUSION_LISTEN`` the SandboxFusion one
(``compat.sandboxfusion``), ``DSEC_COMPAT_SWEREX_LISTEN`` (off by default) SWE-ReX's
remote-runtime API (``compat.swe_rex``); a request goes to the app of the socket it came in
on. All share one pool of libdsec clients.
uvicorn ends on SIGTERM/SIGINT after in-flight requests (``shutdown_grace_s``); then the
pool's gRPC channels are closed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from common.config import ConfigError, load
from common.metrics import MetricsEndpoint, for_service
from common.telemetry import setup_logging, setup_tracing
from common.vip import RouteAgentHandle
from compat.clients import ClientPool
from compat.config import CompatConfig
from compat.e2b.app import E2bApp
from compat.e2b.envd.call import ConnectionDropped
from compat.http import CONNECTION, Receive, Scope, Send
from compat.metrics import HttpMetrics
from compat.sandboxfusion.app import SandboxFusionApp
from compat.tracing import traced

log = logging.getLogger(__name__)


class _HttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1, with each request's connection in its scope
    (:data:`compat.http.CONNECTION`) so that the app can reset it (:func:`compat.http.reset`):
    an ASGI app can otherwise only let the server close it gracefully, which a client reads
    as a malformed response rather than as a connection lost."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[CONNECTION] = self.transport  # type: ignore[literal-required]


class _NotAnError(logging.Filter):
    """uvicorn logs any exception out of the app with its traceback; a
    :class:`ConnectionDropped` is how the E2B front end asks it to drop a connection (a
    sandbox that ended under a stream, logged on one line by the front end)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], ConnectionDropped))


async def main() -> None:
    config = load(CompatConfig, "COMPAT")
    setup_logging("compat", config.log_level, config.log_format)
    logging.getLogger("uvicorn.error").addFilter(_NotAnError())
    # Before any libdsec client is made: with a provider set they carry trace context.
    setup_tracing(
        "compat",
        config.otlp_endpoint,
        starts_traces=True,
        sample_ratio=config.trace_sample_ratio,
    )
    pool = ClientPool(
        config.apiserver, max_clients=config.clients_max, ttl_s=config.token_check_ttl_s
    )
    metrics = for_service("compat", config)
    http_metrics = HttpMetrics(metrics)
    e2b = E2bApp(config, pool)
    sockets = [_listen(config.host, config.port)]
    by_port: dict[int, Callable[[Scope, Receive, Send], Awaitable[None]]] = {
        sockets[0].getsockname()[1]: http_metrics.wrap("e2b", traced(e2b, "e2b"))
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
        by_port[sockets[-1].getsockname()[1]] = http_metrics.wrap(
            "sandboxfusion", traced(fusion, "sandboxfusion")
        )
    if config.swerex_listen:
        # Imported only when served: it needs the `swerex` extra (swe-rex).
        from compat.swe_rex.app import SweRexApp

        sockets.append(_listen(config.swerex_host, config.swerex_port))
        by_port[sockets[-1].getsockname()[1]] = http_metrics.wrap(
            "swerex", traced(SweRexApp(config, pool), "swerex")
        )

    default = by_port[sockets[0].getsockname()[1]]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        # scope["server"] is the local address of the socket the connection came in on.
        target = by_port.get(scope.get("server", ("", 0))[1], default)
        await target(scope, receive, send)

    server = _Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            lifespan="off",
            log_config=None,
            access_log=False,
            http=_HttpProtocol,
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
    if config.swerex_listen:
        log.info(
            "compat: SWE-ReX remote-runtime API on %s://%s/sandboxes/<sandbox id>",
            scheme,
            config.swerex_listen,
        )
    agent: RouteAgentHandle | None = None
    agent_task: asyncio.Task[None] | None = None
    if config.vip:
        agent = _announce(config, e2b)
        agent_task = asyncio.create_task(agent.run())
        server.before_exit = agent.withdraw
    endpoint = MetricsEndpoint(metrics, config.metrics_addr) if config.metrics_addr else None
    if endpoint is not None:
        await endpoint.start()
    try:
        await server.serve(sockets=sockets)
    finally:
        if endpoint is not None:
            await endpoint.close()
        metrics.shutdown()
        if agent is not None and agent_task is not None:
            await agent.close()
            agent_task.cancel()
        for sock in sockets:
            sock.close()
        # E2B template builds under way end (their sandboxes end at their TTL)
        await e2b.control.templates.close()
        await pool.close()


class _Server(uvicorn.Server):
    """uvicorn's server, with a step before it stops taking connections on SIGTERM (behind a
    virtual IP: withdraw the route first, so that no new connection arrives)."""

    before_exit: Callable[[], Awaitable[None]] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        before = self.before_exit
        if before is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self.before_exit = None

        async def then_exit() -> None:
            try:
                await before()
            finally:
                super(_Server, self).handle_exit(sig, frame)

        # In a signal handler, between two steps of the loop: wake it to run the withdrawal.
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe(lambda: _keep(asyncio.ensure_future(then_exit())))


_pending: set[asyncio.Future[None]] = set()


def _keep(fut: asyncio.Future[None]) -> None:
    _pending.add(fut)
    fut.add_done_callback(_pending.discard)


def _announce(config: CompatConfig, e2b: E2bApp) -> RouteAgentHandle:
    """This instance behind the virtual IP ``config.vip`` (common/vip.py): its route agent
    checks ``/health?scope=instance`` through the virtual IP; ``/health`` answers 503 with
    the reason while the agent cannot run."""
    e2b.control.not_serving = f"the route agent of virtual IP {config.vip} is starting"

    async def on_change(ok: bool, reason: str) -> None:
        e2b.control.not_serving = "" if ok else reason

    return RouteAgentHandle(
        config,
        f"http://{config.vip}:{config.port}/health?scope=instance",
        on_change,
        name="compat",
    )


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)
