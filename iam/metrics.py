"""IAM's metrics: each project's quota and what it uses, and its creates waiting their turn.

These are the series that name projects (label ``project``): common/metrics.py shows them
only to a scrape with an operator's token (an ADMIN token; projects of its subtree). The
figures are read once per scrape, in a thread (the store is blocking), before the
callbacks run: a scrape costs one read of the projects and of the waiting queue entries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from opentelemetry.metrics import CallbackOptions, Observation

from common.metrics import Metrics, ProjectScope
from iam.domain import ROLE_ADMIN, ROOT, Iam
from iam.store import ProjectRecord

#: What a project's quota and usage are counted in (the label ``resource``).
RESOURCES = ("cpu_millis", "memory_mb", "sandboxes")


class IamMetrics:
    def __init__(self, metrics: Metrics, iam: Iam) -> None:
        self.iam = iam
        self._projects: list[ProjectRecord] = []
        self._waiting: dict[str, int] = {}
        metrics.before_scrape(self.refresh)
        m = metrics.meter
        m.create_observable_gauge(
            "dsec_project_usage",
            callbacks=[self._usage],
            description="What a project's subtree holds now, by resource",
        )
        m.create_observable_gauge(
            "dsec_project_quota",
            callbacks=[self._quota],
            description="A project's own limit, by resource (0: none of its own)",
        )
        m.create_observable_gauge(
            "dsec_queue_waiting",
            callbacks=[self._queue],
            description="Creates waiting their turn in the create queue, by project",
        )

    async def authorize(self, token: str) -> ProjectScope:
        """A scrape's token: an admin sees the projects of its subtree; anyone else none."""
        who = await self.iam.authenticate(token)
        return who.project_id if who.role == ROLE_ADMIN else None

    async def refresh(self) -> None:
        def read() -> tuple[list[ProjectRecord], dict[str, int]]:
            store = self.iam.store
            root = store.get_project(ROOT)
            projects = ([root] if root is not None else []) + store.list_projects(ROOT, True)
            waiting: dict[str, int] = {}
            for row in store.queue_list("", True):
                waiting[row.project_id] = waiting.get(row.project_id, 0) + 1
            return projects, waiting

        self._projects, self._waiting = await asyncio.to_thread(read)

    def _usage(self, _: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(getattr(p.usage, r), {"project": p.project_id, "resource": r})
            for p in self._projects
            for r in RESOURCES
        ]

    def _quota(self, _: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(getattr(p.quota, r), {"project": p.project_id, "resource": r})
            for p in self._projects
            for r in RESOURCES
        ]

    def _queue(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"project": p}) for p, n in sorted(self._waiting.items())]
