"""supervisord event listener: counts each service's automatic restarts into a JSON file
(``python -m dsecctl.supervisor_events PATH``; see dsecctl/supervisor.py).

A restart is a start that supervisord made on its own: from EXITED (the service died) or
BACKOFF (it died while starting). Starts from STOPPED (``dsec up``, ``dsec restart``) are
not counted. The file is rewritten atomically after every change.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from supervisor import childutils


def count(counts: dict[str, dict[str, Any]], event: str, fields: dict[str, str]) -> bool:
    """Applies one PROCESS_STATE event; whether ``counts`` changed."""
    name = fields.get("processname", "")
    entry = counts.setdefault(name, {"restarts": 0, "last_exit_at": 0.0, "fatal": False})
    if event == "PROCESS_STATE_STARTING" and fields.get("from_state") in ("EXITED", "BACKOFF"):
        entry["restarts"] += 1
        entry["fatal"] = False
        return True
    if event in ("PROCESS_STATE_EXITED", "PROCESS_STATE_BACKOFF"):
        entry["last_exit_at"] = time.time()
        return True
    if event == "PROCESS_STATE_FATAL":
        entry["fatal"] = True
        return True
    if event == "PROCESS_STATE_RUNNING":
        entry["fatal"] = False
        return True
    return False


def save(path: Path, counts: dict[str, dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(counts, indent=1))
    os.replace(tmp, path)


def main() -> None:
    path = Path(sys.argv[1])
    try:  # a restarted listener goes on counting
        counts: dict[str, dict[str, Any]] = json.loads(path.read_text())
    except (OSError, ValueError):
        counts = {}
    while True:
        headers, payload = childutils.listener.wait(sys.stdin, sys.stdout)
        fields, _ = childutils.eventdata(payload + "\n")
        if count(counts, headers["eventname"], fields):
            save(path, counts)
        childutils.listener.ok(sys.stdout)


if __name__ == "__main__":
    main()
