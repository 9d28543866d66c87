"""A trainer that dies mid-episode and resumes from its task id without doubling a command.

usage: python examples/exactly_once.py TASK_ID [--turns 5] [--crash-at N]

An episode is TASK_ID's sandbox (created with an idempotency key, so the resumed trainer gets
the same one) and a few turns, each one non-idempotent command (it appends to a history file,
as a `git commit` or a migration would change state), run with the operation id
``<TASK_ID>-turn<n>``. ``--crash-at N`` kills this process with SIGKILL while turn N runs.
Run it again without: the turns that ended answer from the sandbox's operation log, the one
that was running is joined, the rest run; the history shows each turn once. The sandbox is
stopped at the end and the episode's operation log printed; run again after that, it prints
the log of the ended episode (the edge keeps it for an hour after the end).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

from libdsec import Client, Sandbox
from libdsec.errors import SandboxTerminated


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("task_id")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--crash-at", type=int, default=0)
    args = ap.parse_args()
    with Client() as dsec:
        try:
            sb = dsec.create(
                image="busybox", task_id=args.task_id, idempotency_key=f"{args.task_id}-sandbox"
            )
        except SandboxTerminated as ended:  # this episode ran to its end before: its record
            sb = dsec.get(ended.metadata["sandbox_id"])
            print(f"{args.task_id} has ended; its log:")
            show_log(sb)
            return
        for turn in range(1, args.turns + 1):
            if turn == args.crash_at:  # the trainer dies in the middle of this turn
                threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
            r = sb.run(
                f"echo turn {turn} >> /tmp/history; sleep 1; wc -l < /tmp/history",
                operation_id=f"{args.task_id}-turn{turn}",
            )
            print(f"turn {turn}: history has {r.stdout.decode().strip()} lines")
        print(sb.run("cat /tmp/history").stdout.decode(), end="")
        sb.stop()
        show_log(sb)


def show_log(sb: Sandbox) -> None:
    for op in sb.log():
        print(f"  #{op.seq} {op.operation_id:<22} {op.kind:<12} {op.state:<9} {op.summary}")


if __name__ == "__main__":
    main()
