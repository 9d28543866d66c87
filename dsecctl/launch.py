"""``python -m dsecctl.launch ENV_FILE``: replaces itself (same PID) with
``python -m <module>``, or the file's ``argv`` when it has one (a host daemon), in the
environment the file gives (see dsecctl/supervisor.py)."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    env = {**spec["env"], "PYTHONUNBUFFERED": "1"}
    if spec.get("argv"):
        os.execvpe(spec["argv"][0], spec["argv"], env)
    os.execve(sys.executable, [sys.executable, "-m", spec["module"]], env)


if __name__ == "__main__":
    main()
