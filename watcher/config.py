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
    #: IAM, for quota reconciliation against what edges report ("" = no reconciliation).
    iam: str = ""
    #: How often each edge's live sandbox ids are compared with IAM's reservations.
    reconcile_interval_s: float = 5.0
    #: Reservations younger than this are never released by reconciliation
    #: (the sandbox may still be on its way to the edge).
    reconcile_grace_s: float = 30.0
    #: An edge UNHEALTHY this long (or holding reservations while unknown to
    #: this watcher this long) is gone: every reservation on it is released.
    release_gone_after_s: float = 120.0
    #: How often each edge is asked what it holds (what a lost edge's sandboxes were), and
    #: how long the sandboxes of a lost edge are reported TERMINATED (EDGE_LOST).
    sandbox_poll_interval_s: float = 2.0
    lost_retention_s: float = 3600.0
    #: An edge whose clock differs from ours by more than this (measured at registration and
    #: by every probe, allowing for the probe's round trip) is UNHEALTHY (CLOCK_SKEW): sandbox
    #: times, TTLs and the lost-edge polls compare the two clocks.
    max_clock_skew_s: float = 30.0

    def validate(self) -> None:
        super().validate()
        if self.probe_interval_s <= 0 or self.probe_timeout_s <= 0:
            raise ConfigError("probe interval and timeout must be > 0")
        if self.unhealthy_after < 1:
            raise ConfigError("DSEC_WATCHER_UNHEALTHY_AFTER must be >= 1")
        if self.reconcile_interval_s <= 0 or self.reconcile_grace_s < 0:
            raise ConfigError("reconcile interval must be > 0 and grace >= 0")
        if self.release_gone_after_s <= 0:
            raise ConfigError("DSEC_WATCHER_RELEASE_GONE_AFTER_S must be > 0")
        if self.sandbox_poll_interval_s <= 0 or self.lost_retention_s < 0:
            raise ConfigError("sandbox poll interval must be > 0 and lost retention >= 0")
        if self.max_clock_skew_s <= 0:
            raise ConfigError("DSEC_WATCHER_MAX_CLOCK_SKEW_S must be > 0")
