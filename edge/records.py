"""Sandbox records on disk: what lets a restarted edge re-adopt its sandboxes.

One JSON file per sandbox (``<state dir>/sandboxes/<sandbox id>.json``), rewritten (tmp +
rename) on each state change the manager persists, removed when the record is forgotten. The
in-memory table and the decisions stay with :class:`edge.manager.SandboxManager`; this module
only writes, removes and reads the files.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from edge.model import TERMINAL, SandboxRecord

log = logging.getLogger(__name__)


class RecordStore:
    """The directory of sandbox records of one edge."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self._failures = 0

    def write(self, rec: SandboxRecord) -> None:
        """Write the record (tmp + rename). Never raises: on a full disk (or any write error)
        the sandbox's life goes on — a teardown above all — with the record as it was; a
        terminated sandbox whose record cannot be written loses its file instead, so that
        recovery never re-adopts what was torn down (orphan cleanup removes any leftovers)."""
        path = self.directory / f"{rec.sandbox_id}.json"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(rec.to_json())
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if rec.state == TERMINAL:
                with contextlib.suppress(OSError):
                    path.unlink()
            self._failures += 1
            if self._failures in (1, 10, 100) or self._failures % 1000 == 0:
                log.error(
                    "cannot write the record of %s (%s; %d failed writes so far): going on "
                    "without it",
                    rec.sandbox_id,
                    exc.strerror or exc,
                    self._failures,
                    extra={"sandbox_id": rec.sandbox_id},
                )

    def forget(self, sandbox_id: str) -> None:
        with contextlib.suppress(OSError):
            (self.directory / f"{sandbox_id}.json").unlink(missing_ok=True)

    def read_all(self) -> Iterator[SandboxRecord]:
        """Every readable record, in sandbox id order (an unreadable one is logged, skipped)."""
        for path in sorted(self.directory.glob("*.json")):
            try:
                rec = SandboxRecord.from_json(path.read_text())
            except Exception as exc:
                log.error("unreadable sandbox record %s: %s", path, exc)
                continue
            yield rec
