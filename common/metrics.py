"""Metrics every service exports: OpenTelemetry's metrics API, read by Prometheus.

Each service process owns one :class:`Metrics`: an OpenTelemetry ``MeterProvider`` whose
readers are a Prometheus reader (on a registry of its own, so that two in one process never
mix) and, when asked, an OTLP exporter pushing every ``otlp_interval_s``. Services create
their instruments from :attr:`Metrics.meter` in their composition root and pass them down.

:class:`MetricsEndpoint` serves ``GET /metrics`` (Prometheus text format 0.0.4) on a small
HTTP/1.1 listener of its own (``DSEC_<SVC>_METRICS_ADDR``; "" serves none). A scrape first
awaits the service's :meth:`Metrics.before_scrape` hooks (a snapshot read off the event loop,
e.g. IAM's usage table), then collects: observable instruments' callbacks run on the event
loop thread, where the state they read lives.

Labels are bounded: methods, codes, backends, states, reasons, pool names, never a sandbox
id. The one label that names a tenant is ``project`` (:data:`PROJECT_LABEL`): series that
carry it are left out of a scrape unless the request's ``Authorization: Bearer`` token is
an operator's (an admin token; only projects in its subtree are shown). Without a token a
scrape shows node-level series only; a bad token is 401, never a silent downgrade.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Meter, NoOpMeter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric

from common.version import DSEC_VERSION
from libdsec.errors import DSecError

log = logging.getLogger(__name__)

#: The label that names a project: its series need an operator's token.
PROJECT_LABEL = "project"

#: Latency buckets (seconds) for calls and operations: a unary call (ms) to a create under
#: load or a VM's resume (minutes).
LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)

#: Which projects' series a scrape may see: None = none; otherwise a subtree's root ("root"
#: sees them all).
ProjectScope = str | None

#: Checks a scrape's bearer token: the project subtree whose series it may see (None: none,
#: a member's token), or raises Unauthenticated for a bad token.
Authorize = Callable[[str], Awaitable[ProjectScope]]

#: A request's head (request line and headers) is at most this many bytes.
MAX_REQUEST_HEAD = 16 * 1024
#: A client has this long to send its request head.
REQUEST_TIMEOUT_S = 10.0


def in_scope(project_id: str, scope: ProjectScope) -> bool:
    """Whether ``project_id`` is ``scope`` or under it."""
    if scope is None:
        return False
    return project_id == scope or project_id.startswith(scope + "/")


class Metrics:
    """One service's meter provider and what reads it (see the module doc)."""

    def __init__(
        self,
        service: str,
        *,
        otlp_endpoint: str = "",
        otlp_interval_s: float = 0.0,
        enabled: bool = True,
    ) -> None:
        self.service = service
        self.registry = CollectorRegistry(auto_describe=False)
        self._prometheus = PrometheusMetricReader(registry=self.registry, scope_info_enabled=False)
        readers: list[MetricReader] = [self._prometheus]
        if otlp_endpoint and otlp_interval_s > 0:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            readers.append(
                PeriodicExportingMetricReader(
                    OTLPMetricExporter(endpoint=otlp_endpoint, insecure=True),
                    export_interval_millis=otlp_interval_s * 1000,
                )
            )
        self.provider = MeterProvider(
            metric_readers=readers,
            resource=Resource.create({"service.name": f"dsec-{service}"}),
        )
        #: Off, every instrument is a no-op (nothing recorded, nothing to read).
        self.meter: Meter = (
            self.provider.get_meter(f"dsec.{service}") if enabled else NoOpMeter(service)
        )
        self._before: list[Callable[[], Awaitable[None]]] = []
        # Always one series: a scrape of an idle service still names it (target_info) and
        # says which dsec it runs.
        self.meter.create_observable_gauge(
            "dsec_build_info",
            callbacks=[lambda _: [Observation(1, {"version": DSEC_VERSION})]],
            description="1, labelled with the dsec version the service runs",
        )

    def before_scrape(self, fn: Callable[[], Awaitable[None]]) -> None:
        """``fn`` is awaited before each scrape (e.g. reads a snapshot the callbacks use)."""
        self._before.append(fn)

    async def exposition(self, scope: ProjectScope = None) -> bytes:
        """The Prometheus text of every series, project series only within ``scope``."""
        for fn in self._before:
            try:
                await fn()
            except (DSecError, OSError) as exc:  # the rest is still worth a scrape
                log.warning("metrics: a pre-scrape read failed: %s", exc)
        return generate_latest(_Scoped(self.registry, scope))  # type: ignore[arg-type]

    def shutdown(self) -> None:
        self.provider.shutdown()


def for_service(service: str, cfg: Any) -> Metrics:
    """The metrics of a service configured by ``cfg`` (a common.config.ServiceConfig)."""
    return Metrics(
        service,
        otlp_endpoint=cfg.otlp_endpoint,
        otlp_interval_s=cfg.otlp_metrics_interval_s,
        enabled=cfg.metrics == "on",
    )


class _Scoped:
    """A registry's families, with the samples of projects outside ``scope`` left out."""

    def __init__(self, registry: CollectorRegistry, scope: ProjectScope) -> None:
        self.registry = registry
        self.scope = scope

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            kept = [
                s
                for s in family.samples
                if PROJECT_LABEL not in s.labels or in_scope(s.labels[PROJECT_LABEL], self.scope)
            ]
            if len(kept) != len(family.samples):
                if not kept:
                    continue
                family.samples = kept
            yield family


def counts_by(
    items: Iterable[Any], *keys: Callable[[Any], str], names: tuple[str, ...]
) -> list[tuple[dict[str, str], int]]:
    """(labels, count) per distinct key tuple of ``items``: an observable gauge's points."""
    counts: dict[tuple[str, ...], int] = {}
    for item in items:
        k = tuple(f(item) for f in keys)
        counts[k] = counts.get(k, 0) + 1
    return [(dict(zip(names, k, strict=True)), n) for k, n in sorted(counts.items())]


class MetricsEndpoint:
    """``GET /metrics`` over HTTP/1.1 on ``listen`` ("host:port"), on the service's loop."""

    def __init__(self, metrics: Metrics, listen: str, authorize: Authorize | None = None) -> None:
        self.metrics = metrics
        self.listen = listen
        self.authorize = authorize
        self._server: asyncio.Server | None = None
        self.address = ""

    async def start(self) -> None:
        host, _, port = self.listen.rpartition(":")
        host = host.strip("[]")
        self._server = await asyncio.start_server(
            self._serve, host or "127.0.0.1", int(port), limit=MAX_REQUEST_HEAD
        )
        bound = self._server.sockets[0].getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.address = f"{shown}:{bound[1]}"
        log.info("%s metrics on http://%s/metrics", self.metrics.service, self.address)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, headers, body = await self._answer(reader)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            status, headers, body = 400, {}, b"bad request\n"
        except ConnectionError:
            writer.close()
            return
        head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}"]
        headers.setdefault("content-type", "text/plain; charset=utf-8")
        headers["content-length"] = str(len(body))
        headers["connection"] = "close"
        head += [f"{k}: {v}" for k, v in headers.items()]
        with contextlib.suppress(ConnectionError):
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return 400, {}, b"bad request line\n"
        method, target, _ = parts
        path = target.split("?", 1)[0]
        if path != "/metrics":
            return 404, {}, b"not found: this listener serves /metrics only\n"
        if method != "GET":
            return 405, {"allow": "GET"}, b"method not allowed\n"
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        scope: ProjectScope = None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if token.strip():
            if scheme.lower() != "bearer":
                return 401, {}, b"Authorization must be 'Bearer <dsec token>'\n"
            if self.authorize is not None:
                try:
                    scope = await self.authorize(token.strip())
                except DSecError as err:
                    code = 401 if err.code.name == "UNAUTHENTICATED" else 503
                    return code, {}, f"{err}\n".encode()
        t0 = time.perf_counter()
        body = await self.metrics.exposition(scope)
        log.debug("metrics scrape in %.1f ms", (time.perf_counter() - t0) * 1000)
        return 200, {"content-type": CONTENT_TYPE_LATEST}, body


_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}
