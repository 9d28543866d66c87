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
    #: Parallel edge calls per CreateSandboxes batch.
    batch_concurrency: int = 256
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

    @property
    def instance_name(self) -> str:
        return self.instance or f"{socket.gethostname()}:{self.listen}"
