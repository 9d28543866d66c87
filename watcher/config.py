"""Watcher configuration (DSEC_WATCHER_*)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import ConfigError, ServiceConfig


@dataclass(frozen=True)
class WatcherConfig(ServiceConfig):
    listen: str = "127.0.0.1:7103"
    #: How often every edge is probed, and how long a probe may take.
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0
    #: Consecutive failed probes before an edge is UNHEALTHY.
    unhealthy_after: int = 3
    #: An edge that neither answers nor re-registers for this long is forgotten.
    forget_after_s: float = 300.0
    #: Edges re-register this often (told to them in RegisterEdgeResponse).
    reregister_interval_s: int = 5

    def validate(self) -> None:
        super().validate()
        if self.probe_interval_s <= 0 or self.probe_timeout_s <= 0:
            raise ConfigError("probe interval and timeout must be > 0")
        if self.unhealthy_after < 1:
            raise ConfigError("DSEC_WATCHER_UNHEALTHY_AFTER must be >= 1")
