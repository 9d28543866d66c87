"""What each edge last reported holding, and the sandboxes of edges declared lost.

Per edge, the watcher keeps the live sandboxes its polls returned (``EdgeService/WatchSandboxes``
replays of what was created, started or ended since the previous poll; the first poll, and one
after a gap, takes every live sandbox). The edge's live ids, fetched by the probes for quota
reconciliation, drop what the edge no longer has and reveal a gap (a live id no poll returned).

When an edge is declared gone (UNHEALTHY for ``release_gone_after_s``, the rule that also
releases its quota, or forgotten by the view), the sandboxes it last reported are *lost*:
callers see them TERMINATED with reason EDGE_LOST for ``retention_s``. Lost is final: if the
edge comes back still holding one, it is to be stopped (with that reason), so what callers
were told stays true. Nothing is durable: a restarted watcher knows no earlier loss.

All times compared with a sandbox's are the edge's own clock (its poll keepalives and its
``as_of``); ``lost_at`` is this watcher's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: A survivor of a lost edge is asked to stop again after this long (the first stop was lost).
RESTOP_AFTER_S = 30.0


@dataclass(frozen=True)
class Reported:
    """One sandbox as an edge reported it; ``sandbox`` is the message itself (opaque here)."""

    sandbox_id: str
    project_id: str
    task_id: str
    labels: Mapping[str, str]
    created_at: float  # the edge's clock
    terminated: bool
    sandbox: Any


@dataclass
class Lost:
    reported: Reported
    edge_id: str
    lost_at: float
    stop_sent_at: float = 0.0  # monotonic; 0 = never


@dataclass
class EdgeSandboxes:
    live: dict[str, Reported] = field(default_factory=dict)
    #: changed_since of the next poll (opaque: the edge's last poll keepalive); None = a full poll
    since: Any = None
    since_s: float = 0.0  # the same, in seconds
    polled_at: float = float("-inf")  # monotonic
    declared_lost: bool = False


class SandboxLedger:
    def __init__(self, poll_interval_s: float, retention_s: float) -> None:
        self.poll_interval_s = poll_interval_s
        self.retention_s = retention_s
        self.edges: dict[str, EdgeSandboxes] = {}
        self.lost: dict[str, Lost] = {}
        #: edges declared lost and not seen since -> when (this watcher's clock)
        self.lost_edges: dict[str, float] = {}

    # ------------------------------------------------------------- polls

    def _edge(self, edge_id: str) -> EdgeSandboxes:
        e = self.edges.get(edge_id)
        if e is None:
            e = self.edges[edge_id] = EdgeSandboxes()
        return e

    def wants_poll(self, edge_id: str) -> bool:
        e = self.edges.get(edge_id)
        return e is None or time.monotonic() - e.polled_at >= self.poll_interval_s

    def reported(self, edge_id: str) -> int:
        """Live sandboxes the edge's polls returned (what a loss would report now)."""
        e = self.edges.get(edge_id)
        return len(e.live) if e is not None else 0

    def poll_since(self, edge_id: str) -> Any:
        """The next poll's changed_since, or None for a full poll (every live sandbox)."""
        e = self.edges.get(edge_id)
        return None if e is None else e.since

    def polled(
        self, edge_id: str, reported: Iterable[Reported], at: Any, at_s: float, *, full: bool
    ) -> None:
        """A poll's answer: everything live (``full``) or what changed since the last one."""
        e = self._edge(edge_id)
        if full:
            e.live = {}
        for r in reported:
            if r.terminated:
                e.live.pop(r.sandbox_id, None)
            else:
                e.live[r.sandbox_id] = r
        e.since, e.since_s = at, at_s
        e.polled_at = time.monotonic()

    def retain(self, edge_id: str, live_ids: Iterable[str], as_of: float) -> None:
        """The edge's live ids as of ``as_of``: forgets what it no longer holds; a live id
        that no poll returned although one ran after ``as_of`` means a gap: poll it all."""
        e = self.edges.get(edge_id)
        if e is None:
            return
        ids = set(live_ids)
        for sid, r in list(e.live.items()):
            if sid not in ids and r.created_at < as_of:
                del e.live[sid]
        if e.since is not None and as_of <= e.since_s and not ids <= e.live.keys():
            e.since = None

    # ----------------------------------------------------------- losses

    def declare_lost(self, edge_id: str, now: float | None = None) -> int:
        """The edge is gone: what it last reported is lost. Returns how many sandboxes."""
        e = self._edge(edge_id)
        if e.declared_lost:
            return 0
        now = time.time() if now is None else now
        e.declared_lost = True
        self.lost_edges[edge_id] = now
        for sid, r in e.live.items():
            self.lost[sid] = Lost(r, edge_id, now)
        n = len(e.live)
        e.live = {}
        e.since = None  # if it comes back: a full poll
        return n

    def is_declared(self, edge_id: str) -> bool:
        e = self.edges.get(edge_id)
        return e is not None and e.declared_lost

    def back(self, edge_id: str) -> None:
        """A declared edge answers again (its lost sandboxes stay lost)."""
        e = self.edges.get(edge_id)
        if e is not None:
            e.declared_lost = False
        self.lost_edges.pop(edge_id, None)

    def has_survivors(self, edge_id: str) -> bool:
        e = self.edges.get(edge_id)
        return e is not None and not e.declared_lost and any(s in self.lost for s in e.live)

    def survivors(self, edge_id: str) -> list[str]:
        """Lost sandboxes the (returned) edge still holds live, not asked to stop lately."""
        e = self.edges.get(edge_id)
        if e is None or e.declared_lost:
            return []
        mono = time.monotonic()
        out = []
        for sid in e.live:
            lost = self.lost.get(sid)
            if lost is not None and lost.edge_id == edge_id:
                if mono - lost.stop_sent_at >= RESTOP_AFTER_S or not lost.stop_sent_at:
                    lost.stop_sent_at = mono
                    out.append(sid)
        return out

    def forget_edge(self, edge_id: str) -> None:
        """The view forgot the edge (after declaring it lost): its lost sandboxes stay."""
        self.edges.pop(edge_id, None)

    def expire(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for sid in [s for s, lost in self.lost.items() if now - lost.lost_at > self.retention_s]:
            del self.lost[sid]
        for edge_id, at in list(self.lost_edges.items()):
            if now - at > self.retention_s:
                del self.lost_edges[edge_id]

    def find(
        self,
        *,
        sandbox_ids: Iterable[str] = (),
        edge_id: str = "",
        project_prefix: str = "",
        task_id: str = "",
        labels: Mapping[str, str] | None = None,
    ) -> list[Lost]:
        """Lost sandboxes matching every filter given (as ListSandboxes' filters)."""
        wanted = set(sandbox_ids)
        pool: Iterable[Lost] = (
            (self.lost[s] for s in wanted if s in self.lost) if wanted else self.lost.values()
        )
        out = []
        for lost in pool:
            r = lost.reported
            if edge_id and lost.edge_id != edge_id:
                continue
            if project_prefix and not (
                r.project_id == project_prefix or r.project_id.startswith(project_prefix + "/")
            ):
                continue
            if task_id and r.task_id != task_id:
                continue
            if labels and any(r.labels.get(k) != v for k, v in labels.items()):
                continue
            out.append(lost)
        out.sort(key=lambda lost: (lost.reported.created_at, lost.reported.sandbox_id))
        return out
