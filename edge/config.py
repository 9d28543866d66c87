"""Edge configuration (DSEC_EDGE_*)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from common.config import ConfigError, ServiceConfig
from edge.model import EDGE_ID


def _total_memory_mb() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 4096


@dataclass(frozen=True)
class EdgeConfig(ServiceConfig):
    listen: str = "127.0.0.1:7110"
    #: Node identity, [a-z0-9]{1,16}; encoded in every sandbox id it owns.
    edge_id: str = "edge0"
    #: Address others use to reach this edge ("" = the bound listen address).
    advertise: str = ""
    #: Where records, bundles and writable layers live.
    state_dir: Path = Path("/var/lib/dsec/edge")
    #: "container" (runc) or "null" (tracks sandboxes, starts nothing: tests and benchmarks).
    runtime: str = "container"
    #: Physical capacity offered; 0 = measured from this machine.
    cpu_millis: int = 0
    memory_mb: int = 0
    #: Overcommit ratios applied to the capacity at admission (sandboxes mostly wait on the model).
    cpu_overcommit: float = 4.0
    memory_overcommit: float = 1.5
    max_sandboxes: int = 1000
    gpus: int = 0
    #: Labels placement can select on, e.g. "location=cloud,zone=a".
    labels: dict[str, str] = field(default_factory=dict)
    #: Watcher to register with ("" = none: a standalone edge).
    watcher: str = ""
    #: IAM, told when sandboxes end so their quota is released ("" = none).
    iam: str = ""
    register_interval_s: float = 5.0
    #: Platform defaults for a sandbox that asks for nothing.
    default_ttl_s: int = 3600
    #: How long a terminated sandbox's record stays readable (its reason) before it is forgotten.
    terminated_retention_s: float = 3600.0
    reap_interval_s: float = 1.0
    #: On SIGTERM: "keep" sandboxes running (re-adopted when the edge comes back,
    #: e.g. an upgrade) or "stop" them all and release every mount (a local
    #: cluster going down).
    on_shutdown: str = "keep"
    #: Base images / environments (name.erofs or name.rootfs/ per image).
    image_dir: Path = Path("/var/lib/dsec/images")

    def validate(self) -> None:
        super().validate()
        if not EDGE_ID.match(self.edge_id):
            raise ConfigError(f"DSEC_EDGE_EDGE_ID={self.edge_id!r} must match [a-z0-9]{{1,16}}")
        if self.runtime not in ("container", "null"):
            raise ConfigError(f"DSEC_EDGE_RUNTIME={self.runtime!r}: expected container or null")
        if self.on_shutdown not in ("keep", "stop"):
            raise ConfigError(f"DSEC_EDGE_ON_SHUTDOWN={self.on_shutdown!r}: expected keep or stop")
        if self.cpu_overcommit < 1 or self.memory_overcommit < 1:
            raise ConfigError("overcommit ratios must be >= 1")
        if self.max_sandboxes < 1:
            raise ConfigError("DSEC_EDGE_MAX_SANDBOXES must be >= 1")

    def effective_cpu_millis(self) -> int:
        return int((self.cpu_millis or (os.cpu_count() or 1) * 1000) * self.cpu_overcommit)

    def effective_memory_mb(self) -> int:
        return int((self.memory_mb or _total_memory_mb()) * self.memory_overcommit)

    @property
    def hostname(self) -> str:
        return socket.gethostname()
