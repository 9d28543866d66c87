"""API server configuration (DSEC_APISERVER_*)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from common.config import ConfigError, ServiceConfig


@dataclass(frozen=True)
class ApiServerConfig(ServiceConfig):
    listen: str = "127.0.0.1:7100"
    iam: str = "127.0.0.1:7101"
    placement: str = "127.0.0.1:7102"
    watcher: str = "127.0.0.1:7103"
    #: Name of this instance (several run behind one virtual IP).
    instance: str = ""
    #: Upper bound on how long an authentication answer is cached (IAM may ask for less).
    auth_cache_ttl_s: float = 30.0
    #: Edges tried per sandbox before giving up (the first placement plus retries).
    max_create_attempts: int = 3
    #: A CreateSandboxes burst is cut into chunks of this many sandboxes, and this
    #: many chunks go through placement, IAM and the edges at once (pipelining).
    create_chunk: int = 2048
    create_chunks_inflight: int = 4
    #: Concurrent unary creates are coalesced into batches of at most this many,
    #: with at most this many batches in flight, unless the youngest one has run
    #: for create_batch_wait_s (a lone create waits for nothing).
    create_batch_max: int = 1024
    create_batches_inflight: int = 1
    create_batch_wait_s: float = 0.1
    #: ... and each batch lands on about this many edges (clumps of identical
    #: sandboxes per placement decision: fewer edge calls, imbalance <= one clump).
    create_batch_edges: int = 2
    #: Defaults for fields a caller leaves empty.
    default_cpu_millis: int = 1000
    default_memory_mb: int = 512
    default_ttl_s: int = 3600
    max_cpu_millis: int = 64_000
    max_memory_mb: int = 262_144
    max_ttl_s: int = 7 * 24 * 3600

    def validate(self) -> None:
        super().validate()
        if self.max_create_attempts < 1:
            raise ConfigError("DSEC_APISERVER_MAX_CREATE_ATTEMPTS must be >= 1")
        if (
            min(
                self.create_chunk,
                self.create_chunks_inflight,
                self.create_batch_max,
                self.create_batches_inflight,
            )
            < 1
        ):
            raise ConfigError("create chunk/batch sizes and in-flight counts must be >= 1")
        if self.create_batch_wait_s < 0:
            raise ConfigError("DSEC_APISERVER_CREATE_BATCH_WAIT_S must be >= 0")

    @property
    def instance_name(self) -> str:
        return self.instance or f"{socket.gethostname()}:{self.listen}"
