"""Composition root of the watcher."""

from __future__ import annotations

from common.config import load
from common.grpc_server import GrpcServer
from common.metrics import for_service
from common.telemetry import setup_logging, setup_tracing
from dsec.watcher.v1 import watcher_pb2  # noqa: F401  (registers the service descriptor)
from watcher.config import WatcherConfig
from watcher.ledger import SandboxLedger
from watcher.poller import SandboxPoller
from watcher.prober import Prober
from watcher.reconciler import Reconciler
from watcher.servicer import WatcherServicer
from watcher.view import ClusterView


async def main() -> None:
    cfg = load(WatcherConfig, "WATCHER")
    setup_logging("watcher", cfg.log_level, cfg.log_format)
    setup_tracing("watcher", cfg.otlp_endpoint)
    view = ClusterView(
        cfg.unhealthy_after, cfg.forget_after_s, max_clock_skew_s=cfg.max_clock_skew_s
    )
    ledger = SandboxLedger(cfg.sandbox_poll_interval_s, cfg.lost_retention_s)
    metrics = for_service("watcher", cfg)
    view.observe(metrics)
    server = GrpcServer(
        "watcher",
        cfg.listen,
        grace_s=cfg.shutdown_grace_s,
        metrics=metrics,
        metrics_listen=cfg.metrics_addr,
    )
    servicer = WatcherServicer(view, cfg.reregister_interval_s, ledger)
    server.add(servicer, "dsec.watcher.v1.WatcherService")
    reconciler = None
    if cfg.iam:
        reconciler = Reconciler(
            view,
            cfg.iam,
            interval_s=cfg.reconcile_interval_s,
            grace_s=cfg.reconcile_grace_s,
            gone_after_s=cfg.release_gone_after_s,
        )
        server.background(reconciler.run)
    prober = Prober(view, cfg.probe_interval_s, cfg.probe_timeout_s, reconciler, ledger)
    servicer.confirm_holder = prober.probe  # a taken edge id: is its holder still there?
    server.background(prober.run)
    poller = SandboxPoller(view, ledger, prober, gone_after_s=cfg.release_gone_after_s)
    server.background(poller.run)
    await server.run()
