"""Whether this edge is draining, kept in its state dir: a drained node stays drained.

An operator drains a node to take it out of placement (maintenance, a move, a bad disk): it
admits no new sandbox, those running go on. The flag outlives the edge process, so a restart
(a crash, an upgrade) does not put the node back into service behind the operator's back.

Fail closed: the file is written (temporary file, fsync, rename) before the flag changes in
memory, so a state that cannot be kept fails the call and changes nothing; a file that exists
but cannot be read or parsed drains the edge (reason naming the problem) rather than admitting.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: The file under the edge's state dir.
DRAIN_FILE = "drain.json"


@dataclass(frozen=True)
class DrainState:
    draining: bool = False
    reason: str = ""
    since: float = 0.0  # epoch seconds when drained (0: not draining)


class DrainFile:
    """The drain state on disk (``<state_dir>/drain.json``)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / DRAIN_FILE

    def load(self) -> DrainState:
        """The kept state; none kept: not draining; one that cannot be read: draining."""
        try:
            raw = self.path.read_text()
        except FileNotFoundError:
            return DrainState()
        except OSError as exc:
            return self._unreadable(f"cannot read {self.path}: {exc}")
        try:
            doc = json.loads(raw)
            state = DrainState(
                draining=bool(doc["draining"]),
                reason=str(doc.get("reason", "")),
                since=float(doc.get("since", 0.0)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            return self._unreadable(f"{self.path} is not a drain state ({exc!r})")
        if state.draining:
            log.warning("edge starts DRAINING (kept in %s): %s", self.path, state.reason or "-")
        return state

    def _unreadable(self, why: str) -> DrainState:
        log.error("drain state unreadable, the edge drains (fail closed): %s", why)
        return DrainState(True, f"drain state unreadable: {why}", time.time())

    def save(self, state: DrainState) -> None:
        """Writes ``state`` durably (raises OSError: then nothing changed on disk)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        data = json.dumps(
            {"draining": state.draining, "reason": state.reason, "since": state.since}
        )
        with open(tmp, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
