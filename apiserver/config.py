"""API server configuration (DSEC_APISERVER_*)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from common.config import ConfigError, ServiceConfig
from common.vip import VipConfig


@dataclass(frozen=True)
class ApiServerConfig(ServiceConfig, VipConfig):
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
    #: The live view's HTTP listener (apiserver/viewer.py: the noVNC page and its websocket),
    #: host:port, next to the gRPC port on loopback; "off" serves none.
    viewer_addr: str = "127.0.0.1:7104"
    #: The viewer's URL as browsers reach it (a proxy, TLS in front), e.g.
    #: "https://dsec.example.com"; "" = http:// and viewer_addr. DisplayInfo's viewer_url.
    viewer_url: str = ""
    #: Where Debian's noVNC is (package novnc); without it the page answers 503 naming it.
    novnc_dir: Path = Path("/usr/share/novnc")
    #: The dashboard's watch (apiserver/dashboard.py) stops this long after its last use;
    #: its history of state changes starts again empty at the next.
    dashboard_idle_s: float = 900.0

    def validate(self) -> None:
        super().validate()
        self.validate_vip(self.listen)
        self._validate_viewer()
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
        if not self.dashboard_idle_s >= 1:
            raise ConfigError(
                f"DSEC_APISERVER_DASHBOARD_IDLE_S={self.dashboard_idle_s}: must be >= 1 (seconds)"
            )

    def _validate_viewer(self) -> None:
        if self.viewer_addr == "off":
            return
        host, sep, port = self.viewer_addr.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(
                f"DSEC_APISERVER_VIEWER_ADDR={self.viewer_addr!r}: expected host:port or off"
            )
        if self.viewer_url and not self.viewer_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"DSEC_APISERVER_VIEWER_URL={self.viewer_url!r}: expected an http(s):// URL"
            )

    @property
    def viewer_host(self) -> str:
        return self.viewer_addr.rpartition(":")[0].strip("[]")

    @property
    def viewer_port(self) -> int:
        return int(self.viewer_addr.rpartition(":")[2])

    @property
    def instance_name(self) -> str:
        return self.instance or f"{socket.gethostname()}:{self.listen}"
