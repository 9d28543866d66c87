"""Placement configuration (DSEC_PLACEMENT_*)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import WATCHER_WARMUP_S, ConfigError, ServiceConfig


@dataclass(frozen=True)
class PlacementConfig(ServiceConfig):
    listen: str = "127.0.0.1:7102"
    watcher: str = "127.0.0.1:7103"
    #: Power-of-k: how many random eligible edges are compared.
    k: int = 2
    #: Candidates returned per item (the caller retries down the list on rejection).
    max_candidates: int = 3
    #: On-prem allocation ratio past which eligible requests go to cloud edges.
    burst_threshold: float = 0.8
    #: How long the last snapshot may be used while the watcher is unreachable
    #: (health of "dsec.placement.v1.ClusterView" is NOT_SERVING meanwhile).
    snapshot_max_age_s: float = 60.0
    #: A probe counts one of our placements only if taken this long after it
    #: (the sandbox reaches the edge a little after it is placed).
    overlay_grace_s: float = 1.0
    #: After a watcher (re)start, for this long "no edges are registered" is UNAVAILABLE
    #: (CLUSTER_VIEW_WARMING: the edges have yet to register again; clients retry), not
    #: RESOURCE_EXHAUSTED. Longer than the edges' registration interval.
    view_warmup_s: float = WATCHER_WARMUP_S

    def validate(self) -> None:
        super().validate()
        if self.k < 1 or self.max_candidates < 1:
            raise ConfigError("k and max_candidates must be >= 1")
        if not 0 < self.burst_threshold <= 1:
            raise ConfigError("DSEC_PLACEMENT_BURST_THRESHOLD must be in (0, 1]")
