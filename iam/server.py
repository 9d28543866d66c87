"""Composition root of the IAM service."""

from __future__ import annotations

import asyncio

from common.config import load
from common.grpc_server import GrpcServer
from common.metrics import for_service
from common.telemetry import setup_logging, setup_tracing
from dsec.iam.v1 import iam_pb2  # noqa: F401  (registers the service descriptor)
from iam.config import IamConfig
from iam.domain import Iam
from iam.metrics import IamMetrics
from iam.servicer import IamServicer
from iam.store import IamStore
from iam.store_sqlite import SqliteIamStore


def open_store(database: str) -> IamStore:
    """The store for ``DSEC_IAM_DATABASE``: ``sqlite:<path>`` or ``postgresql://...``."""
    if database.startswith("sqlite:"):
        return SqliteIamStore(database.removeprefix("sqlite:"))
    if database.startswith(("postgresql://", "postgres://")):
        from iam.store_pg import PostgresIamStore  # psycopg is needed only here

        return PostgresIamStore(database)
    raise ValueError(f"unsupported IAM database {database!r}")


def build(cfg: IamConfig) -> tuple[GrpcServer, Iam]:
    store = open_store(cfg.database)
    iam = Iam(store)
    metrics = for_service("iam", cfg)
    server = GrpcServer(
        "iam",
        cfg.listen,
        grace_s=cfg.shutdown_grace_s,
        metrics=metrics,
        metrics_listen=cfg.metrics_addr,
        metrics_authorize=IamMetrics(metrics, iam).authorize,
    )
    server.add(IamServicer(iam, cfg.auth_cache_ttl_s), "dsec.iam.v1.IamService")
    server.background(iam.purge_loop)
    server.on_close(lambda: asyncio.to_thread(store.close))
    return server, iam


async def main() -> None:
    cfg = load(IamConfig, "IAM")
    setup_logging("iam", cfg.log_level, cfg.log_format)
    setup_tracing("iam", cfg.otlp_endpoint)
    server, iam = build(cfg)
    await iam.bootstrap(cfg.bootstrap_token_file)
    await server.run()
