"""The dashboard's memory of state changes: which sandbox went from which state to which, when.

The API server keeps no state of its own, and the edges keep each sandbox's current record,
not its past (a replay of WatchSandboxes gives the state now, not the pauses and resumes
before it). A task's pause/resume history is therefore what this API server *observed*: the
dashboard's feed (apiserver/dashboard.py) hands every change its watch reports to
:meth:`StateLog.observe`, which turns it into a :class:`Change` when the state differs from
the last one seen (a watch is at least once: a repeat is not a change).

Bounded, in memory, lost with the API server: at most :data:`MAX_CHANGES` changes (the
oldest go first) and the last state of at most :data:`MAX_SANDBOXES` sandboxes (least
recently changed go first; one that comes back after that counts as first seen). Changes are
plain data, filtered on the way out by the caller's rule of visibility (the dashboard passes
``apiserver.routing.within`` its project: its own project and the ones below, never another's).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

#: Changes kept, all projects together (a change is ~200 bytes: ~2 MB).
MAX_CHANGES = 10_000
#: Sandboxes whose last state is remembered (to tell a change from a repeat).
MAX_SANDBOXES = 100_000


@dataclass(frozen=True)
class Change:
    """One state change of one sandbox as this API server saw it. ``previous`` is "" the first
    time the sandbox is seen (created, or first seen since the log started)."""

    at: float  # unix time, this API server's clock when the change arrived
    sandbox_id: str
    project_id: str
    task_id: str
    state: str  # RUNNING, PAUSED, TERMINATED, ...
    previous: str
    reason: str  # the termination reason of a TERMINATED change, else ""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class StateLog:
    """Observed state changes, bounded (see the module doc)."""

    def __init__(self, max_changes: int = MAX_CHANGES, max_sandboxes: int = MAX_SANDBOXES) -> None:
        if max_changes < 1 or max_sandboxes < 1:
            raise ValueError("a state log keeps at least one change and one sandbox")
        self.max_sandboxes = max_sandboxes
        self._changes: deque[Change] = deque(maxlen=max_changes)
        self._last: OrderedDict[str, str] = OrderedDict()
        #: When the log started (unix time): the history goes back to here at most.
        self.since: float | None = None

    def start(self, now: float) -> None:
        """Forgets everything: observing begins (again) at ``now``."""
        self._changes.clear()
        self._last.clear()
        self.since = now

    def seed(self, sandbox_id: str, state: str) -> None:
        """The sandbox's state as it is when observing begins (no change recorded): its first
        change then has a ``previous``. A state observed already is newer and stays."""
        if sandbox_id not in self._last:
            self._last[sandbox_id] = state
            while len(self._last) > self.max_sandboxes:
                self._last.popitem(last=False)

    def observe(
        self,
        *,
        at: float,
        sandbox_id: str,
        project_id: str,
        task_id: str,
        state: str,
        reason: str = "",
    ) -> Change | None:
        """Records the sandbox's state as reported at ``at``; the change, or None for a repeat."""
        previous = self._last.get(sandbox_id, "")
        if previous == state:
            self._last.move_to_end(sandbox_id)
            return None
        self._last[sandbox_id] = state
        self._last.move_to_end(sandbox_id)
        while len(self._last) > self.max_sandboxes:
            self._last.popitem(last=False)
        change = Change(at, sandbox_id, project_id, task_id, state, previous, reason)
        self._changes.append(change)
        return change

    def history(self, visible: Callable[[str], bool], task_id: str = "") -> list[Change]:
        """The changes of sandboxes whose project is ``visible`` (and of task ``task_id`` if
        given), oldest first."""
        return list(self._matching(visible, task_id))

    def _matching(self, visible: Callable[[str], bool], task_id: str) -> Iterator[Change]:
        for c in self._changes:
            if (not task_id or c.task_id == task_id) and visible(c.project_id):
                yield c

    def __len__(self) -> int:
        return len(self._changes)
