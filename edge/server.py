"""Composition root of the edge service."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NoReturn

import grpc

from common.channels import DEFAULT_DEADLINE_S, open_channel
from common.config import load
from common.convert import ts
from common.grpc_server import GrpcServer
from common.metrics import for_service
from common.telemetry import setup_logging, setup_tracing
from common.version import DSEC_VERSION
from dsec.edge.v1 import edge_pb2  # noqa: F401  (registers the service descriptor)
from dsec.types.v1 import types_pb2
from dsec.watcher.v1 import watcher_pb2, watcher_pb2_grpc
from edge import controls
from edge.backends import NullBackend, SandboxBackend, registry
from edge.backends.contract import DiskUsage, offers, require
from edge.backends.registry import BackendRefused
from edge.config import EdgeConfig
from edge.controls import Control
from edge.disk_guard import DiskGuard
from edge.fncall.adapter import FnCallAdapter
from edge.fncall.service import FnCallService
from edge.layers_adapter import LayersAdapter
from edge.manager import Capacity, SandboxManager
from edge.metrics import EdgeMetrics
from edge.network.claims import NetworkClaimError
from edge.node import NodeServices
from edge.operations import Operations
from edge.oplog import OpLog
from edge.quota import QuotaReleaser
from edge.servicer import EdgeServicer
from libdsec.errors import from_rpc_error

log = logging.getLogger(__name__)

#: This process's incarnation (EdgeInfo.incarnation): the watcher tells a restart by it.
INCARNATION = secrets.token_hex(8)


def check_controls(cfg: EdgeConfig) -> list[Control]:
    """The host controls the runtime relies on (edge/controls.py); raises ControlMissing.
    The null runtime starts nothing, so it relies on none."""
    if cfg.runtime == "null":
        return []
    from edge.runtime import apparmor, mounts

    found = controls.check(
        disabled=cfg.disabled_controls,
        bpf_pin_dir=cfg.bpf_pin_dir,
        apparmor=apparmor.available(),
        erofs_mount=cfg.erofs_mount,
    )
    mounts.set_erofs_mode(cfg.erofs_mount)
    return found


def make_backends(
    cfg: EdgeConfig, node: NodeServices | None
) -> tuple[list[SandboxBackend], list[Control]]:
    """The edge's backends, from the registry (edge/backends/registry.py), and what to report
    of them and of the node's services. The null runtime starts nothing: no node services, one
    NullBackend. Raises BackendRefused, ControlMissing."""
    if node is None:
        return [NullBackend()], []
    backends, backend_controls = registry.build(cfg, node)
    for b in backends:  # the reserve watches what the backends write too
        if offers(b, DiskUsage):
            for path in require(b, DiskUsage).disk_paths():
                node.disk_guard.watch(path)
    return backends, node.controls() + backend_controls


def make_fncall(cfg: EdgeConfig) -> tuple[FnCallService | None, str]:
    """The FnCall pools of a container edge, or None and why there are none."""
    if cfg.runtime != "container":
        return None, f"edge {cfg.edge_id} runs the {cfg.runtime} runtime: no fncall pools"
    settings = cfg.fncall_settings()
    if not settings.pools:
        return None, f"edge {cfg.edge_id} has no fncall pools (DSEC_EDGE_FNCALL_POOLS)"
    service = FnCallService(cfg.edge_id, cfg.state_dir / "fncall", cfg.image_dir, settings)
    if not service.offered:
        why = "; ".join(f"{k}: {v}" for k, v in sorted(service.unavailable.items()))
        return None, f"edge {cfg.edge_id} offers no fncall environment ({why})"
    return service, ""


def edge_info(
    cfg: EdgeConfig,
    manager: SandboxManager,
    address: str,
    fncall: FnCallService | None = None,
) -> types_pb2.EdgeInfo:
    backends = set(manager.backends) | ({"FNCALL"} if fncall is not None else set())
    # Placement selects edges for a fncall job by these labels (environment, language).
    labels = {**(fncall.labels() if fncall is not None else {}), **cfg.labels}
    return types_pb2.EdgeInfo(
        edge_id=cfg.edge_id,
        address=cfg.advertise or address,
        backends=[types_pb2.Backend.Value("BACKEND_" + b) for b in sorted(backends)],  # type: ignore[misc]
        labels=labels,
        hostname=cfg.hostname,
        gpu_count=cfg.gpus,
        cpu_millis_capacity=manager.capacity.cpu_millis,
        memory_mb_capacity=manager.capacity.memory_mb,
        version=DSEC_VERSION,
        incarnation=INCARNATION,
    )


async def register_loop(cfg: EdgeConfig, info: types_pb2.EdgeInfo) -> None:
    """Registers with the watcher now and periodically, so a restarted watcher relearns us.

    Fail closed: until the watcher has accepted us once, ALREADY_EXISTS (EDGE_ID_IN_USE:
    another live edge holds our id) stops this process (exit 2), so two nodes never serve
    under one id. Later (the watcher restarted, another edge took the id meanwhile) we already
    run sandboxes under it: logged as an error at every refusal, and retried."""
    channel = open_channel(cfg.watcher, "edge")
    stub = watcher_pb2_grpc.WatcherServiceStub(channel)
    interval = cfg.register_interval_s
    accepted = False
    try:
        while True:
            try:
                resp = await stub.RegisterEdge(
                    watcher_pb2.RegisterEdgeRequest(info=info, sent_at=ts(time.time())),
                    timeout=DEFAULT_DEADLINE_S,
                )
                interval = resp.reregister_interval_s or cfg.register_interval_s
                accepted = True
            except grpc.aio.AioRpcError as exc:  # the watcher may be down; keep serving, retry soon
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                    err = from_rpc_error(exc)
                    if not accepted:
                        log.critical(
                            "edge %s cannot join the cluster: the watcher refused it (%s): %s",
                            cfg.edge_id,
                            err.reason,
                            err.message,
                        )
                        raise EdgeIdInUse(err.message) from None
                    log.error(
                        "edge %s: the watcher refuses our registration (%s): %s",
                        cfg.edge_id,
                        err.reason,
                        err.message,
                    )
                else:
                    log.warning(
                        "registering with watcher %s failed: %s", cfg.watcher, exc.code().name
                    )
                interval = min(cfg.register_interval_s, 1.0)
            await asyncio.sleep(interval)
    finally:
        await channel.close()


class EdgeIdInUse(Exception):
    """The watcher refused our first registration: another live edge holds our id."""


def start_refused(cfg: EdgeConfig, exc: Exception) -> NoReturn:
    """A start refusal (a missing control, no free network, a backend refused): logged, exit 2."""
    log.critical("edge %s cannot start: %s", cfg.edge_id, exc)
    raise SystemExit(2) from None


async def main() -> None:
    """config -> controls -> node services -> backends -> manager -> servicer -> server."""
    cfg = load(EdgeConfig, "EDGE")
    setup_logging(f"edge-{cfg.edge_id}", cfg.log_level, cfg.log_format)
    setup_tracing("edge", cfg.otlp_endpoint)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    # Runtime calls (runc, mounts) block in threads; a burst needs more than the default 6.
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max_workers=64, thread_name_prefix="edge")
    )
    try:
        host_controls = check_controls(cfg)
        node = None if cfg.runtime == "null" else NodeServices.build(cfg)
        backends, backend_controls = make_backends(cfg, node)
    except (controls.ControlMissing, NetworkClaimError, BackendRefused) as exc:
        start_refused(cfg, exc)
    manager = SandboxManager(
        cfg.edge_id,
        cfg.state_dir,
        Capacity(
            cfg.effective_cpu_millis(), cfg.effective_memory_mb(), cfg.max_sandboxes, cfg.gpus
        ),
        backends,
        terminated_retention_s=cfg.terminated_retention_s,
        reap_interval_s=cfg.reap_interval_s,
        disk_guard=node.disk_guard
        if node is not None
        else DiskGuard([cfg.state_dir], cfg.disk_reserve_mb << 20),
        disk_check_interval_s=cfg.disk_check_interval_s,
        paused_at_ttl_keep_s=cfg.paused_at_ttl_keep_s,
    )
    await manager.recover()
    oplog = OpLog(
        cfg.state_dir / "oplog.db",
        max_bytes=cfg.oplog_max_mb << 20,
        copy_bytes=cfg.oplog_copy_kb << 10,
        retention_s=cfg.oplog_retention_s,
    )
    unknown = oplog.recover()
    if unknown:
        log.warning("%d operations were under way when the edge stopped: OUTCOME_UNKNOWN", unknown)
    operations = Operations(oplog, enabled=cfg.oplog == "on")
    metrics = for_service(f"edge-{cfg.edge_id}", cfg)
    server = GrpcServer(
        f"edge-{cfg.edge_id}",
        cfg.listen,
        grace_s=cfg.shutdown_grace_s,
        metrics=metrics,
        metrics_listen=cfg.metrics_addr,
    )
    info = types_pb2.EdgeInfo()  # filled in once the address is bound (register below)
    fncall, no_fncall = make_fncall(cfg)
    servicer = EdgeServicer(
        manager,
        info,
        fncall=FnCallAdapter(fncall, no_fncall),
        layers=LayersAdapter(node.environments if node is not None else None, manager),
        controls=host_controls + backend_controls,
        pause_reclaim=node.pause_reclaim if node is not None else None,
        operations=operations,
    )
    server.add(servicer, "dsec.edge.v1.EdgeService")
    manager.metrics = EdgeMetrics(
        metrics,
        records=lambda: manager.records.values(),
        capacity=manager.capacity,
        node_status=servicer.node_status,
        disk_guard=manager.reaper.disk_guard,
        network=node.network if node is not None else None,
    )
    server.background(lambda: operations.follow_endings(manager))
    server.on_close(oplog.close)
    serve_in_background(cfg, server, manager, node, backends, fncall, info)
    await server.run()


def serve_in_background(
    cfg: EdgeConfig,
    server: GrpcServer,
    manager: SandboxManager,
    node: NodeServices | None,
    backends: list[SandboxBackend],
    fncall: FnCallService | None,
    info: types_pb2.EdgeInfo,
) -> None:
    """The edge's loops (reaper, disk guard, the node's and the backends' own, FnCall pools,
    registration) and what runs at shutdown, in reverse order of registration: sandboxes
    stop (on_shutdown=stop), the manager, the backends, then the node's services close."""
    loops = [manager.reap_loop, manager.disk_guard_loop]
    loops += [*(node.background_loops() if node is not None else ())]
    loops += [loop for b in backends for loop in b.background_loops()]
    if node is not None:
        server.on_close(node.close)
    if fncall is not None:
        loops.append(fncall.run_pools)
        server.on_close(fncall.close)
    for b in backends:
        server.on_close(b.close)
    server.on_close(manager.close)
    if cfg.on_shutdown == "stop":
        server.on_close(lambda: manager.stop_all("the edge shut down"))

    async def register() -> None:
        # Background tasks start after the server has bound its address.
        info.CopyFrom(edge_info(cfg, manager, server.address, fncall))
        if cfg.watcher:
            try:
                await register_loop(cfg, info)
            except EdgeIdInUse:
                # Out at once, like a SIGKILL (which the edge is built to survive): a shutdown
                # would run the closers, and stop_all (on_shutdown=stop) would stop the
                # sandboxes of our state dir, which may be the live holder's.
                logging.shutdown()
                os._exit(2)

    loops.append(register)
    if cfg.iam:
        loops.append(QuotaReleaser(manager, cfg.iam).run)
    for loop in loops:
        server.background(loop)
