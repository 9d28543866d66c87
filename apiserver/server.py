"""Composition root of the API server."""

from __future__ import annotations

from apiserver.config import ApiServerConfig
from apiserver.dashboard import Dashboard, DashboardFeed
from apiserver.environments import EnvironmentServicer
from apiserver.gateway import Gateway
from apiserver.nodes import NodeServicer
from apiserver.routing import EdgeDirectory
from apiserver.servicer import (
    DisplayServicer,
    ExecServicer,
    FileServicer,
    FunctionServicer,
    ProjectServicer,
    SandboxServicer,
)
from apiserver.viewer import Viewer
from common.channels import open_channel
from common.config import load
from common.grpc_server import GrpcServer
from common.metrics import ProjectScope, for_service
from common.telemetry import setup_logging, setup_tracing
from common.vip import RouteAgentHandle
from dsec.apiserver.v1 import apiserver_pb2  # noqa: F401  (registers the service descriptors)
from dsec.iam.v1 import iam_pb2, iam_pb2_grpc
from dsec.placement.v1 import placement_pb2_grpc


async def main() -> None:
    cfg = load(ApiServerConfig, "APISERVER")
    setup_logging("apiserver", cfg.log_level, cfg.log_format)
    setup_tracing(
        "apiserver",
        cfg.otlp_endpoint,
        starts_traces=True,
        sample_ratio=cfg.trace_sample_ratio,
    )
    iam_channel = open_channel(cfg.iam, "apiserver")
    placement_channel = open_channel(
        cfg.placement, "apiserver", retry_services=["dsec.placement.v1.PlacementService"]
    )
    iam = iam_pb2_grpc.IamServiceStub(iam_channel)
    placement = placement_pb2_grpc.PlacementServiceStub(placement_channel)
    edges = EdgeDirectory(cfg.watcher)
    metrics = for_service("apiserver", cfg)
    gw = Gateway(cfg, iam, placement, edges, metrics)

    async def operator_scope(token: str) -> ProjectScope:
        """A scrape's token: an admin sees its subtree's project series; others none."""
        p = await gw.auth.principal(token)
        return p.project_id if p.role == iam_pb2.ROLE_ADMIN else None

    server = GrpcServer(
        "apiserver",
        cfg.listen,
        grace_s=cfg.shutdown_grace_s,
        metrics=metrics,
        metrics_listen=cfg.metrics_addr,
        metrics_authorize=operator_scope,
    )
    server.add(SandboxServicer(gw), "dsec.apiserver.v1.SandboxService")
    server.add(ExecServicer(gw), "dsec.apiserver.v1.ExecService")
    server.add(FileServicer(gw), "dsec.apiserver.v1.FileService")
    server.add(DisplayServicer(gw), "dsec.apiserver.v1.DisplayService")
    server.add(ProjectServicer(gw, iam, cfg.instance_name), "dsec.apiserver.v1.ProjectService")
    functions = FunctionServicer(gw)
    server.add(functions, "dsec.apiserver.v1.FunctionService")
    server.add(EnvironmentServicer(gw), "dsec.apiserver.v1.EnvironmentService")
    server.add(NodeServicer(gw), "dsec.apiserver.v1.NodeService")
    server.background(edges.run)
    server.background(gw.queue.run)
    if cfg.vip:
        _announce(server, cfg)
    if cfg.viewer_addr != "off":
        feed = DashboardFeed(gw, cfg.dashboard_idle_s)  # runs only while the dashboard is used
        server.background(feed.run)
        viewer = Viewer(cfg, gw, routes=Dashboard(gw, feed).routes())
        viewer_socket = viewer.bind()  # a taken port fails the start, not a background task
        server.background(lambda: viewer.serve(viewer_socket))
        server.on_close(viewer_socket.close)
    server.on_close(gw.batcher.close)
    server.on_close(functions.router.close)  # its edge job streams, before the channels
    server.on_close(edges.close)
    server.on_close(iam_channel.close)
    server.on_close(placement_channel.close)
    await server.run()


def _announce(server: GrpcServer, cfg: ApiServerConfig) -> None:
    """This instance behind the virtual IP ``cfg.vip`` (common/vip.py): its route agent checks
    the SandboxService through the virtual IP; health "" waits for the agent."""
    port = cfg.listen.rsplit(":", 1)[1]
    agent = RouteAgentHandle(
        cfg,
        f"grpc:{cfg.vip}:{port}/dsec.apiserver.v1.SandboxService",
        lambda ok, reason: server.met("vip", ok, reason),
        name=cfg.instance_name,
    )
    server.require("vip", f"the route agent of virtual IP {cfg.vip} is starting")
    server.background(agent.run)
    server.on_stop(agent.withdraw)
    server.on_close(agent.close)
