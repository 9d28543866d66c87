"""Composition root of placement."""

from __future__ import annotations

from common.config import load
from common.grpc_server import GrpcServer
from common.metrics import for_service
from common.telemetry import setup_logging, setup_tracing
from dsec.placement.v1 import placement_pb2  # noqa: F401  (registers the service descriptor)
from placement.config import PlacementConfig
from placement.follower import SnapshotFollower
from placement.policy import Placer
from placement.servicer import PlacementServicer


async def main() -> None:
    cfg = load(PlacementConfig, "PLACEMENT")
    setup_logging("placement", cfg.log_level, cfg.log_format)
    setup_tracing("placement", cfg.otlp_endpoint)
    placer = Placer(
        k=cfg.k,
        max_candidates=cfg.max_candidates,
        burst_threshold=cfg.burst_threshold,
        overlay_grace_s=cfg.overlay_grace_s,
    )
    follower = SnapshotFollower(placer, cfg.watcher)
    metrics = for_service("placement", cfg)
    server = GrpcServer(
        "placement",
        cfg.listen,
        grace_s=cfg.shutdown_grace_s,
        metrics=metrics,
        metrics_listen=cfg.metrics_addr,
    )
    servicer = PlacementServicer(
        placer, follower, cfg.snapshot_max_age_s, cfg.view_warmup_s, metrics=metrics
    )
    server.add(servicer, "dsec.placement.v1.PlacementService")
    server.background(follower.run)
    server.background(lambda: servicer.report_view_health(server.health))
    await server.run()
