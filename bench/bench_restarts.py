"""What a crash of each service costs a running RL job (issue 22), same run.

A supervised cluster (as ``dsec up`` runs it: supervisord restarts what dies) under the
rollout load of tests/rollouts.py (3 workers: create, write, background command, run, stop
every other sandbox). First a window with no kill (the baseline); then each service is killed
with SIGKILL in turn, each followed by a window of the same length. Per window:

- back SERVING: from the kill until supervisord's new process answers its health check;
- first success through it: from the kill until the first call that needs the killed service
  (and started after the kill) succeeded: a create for IAM, placement and the watcher, any
  call for the API server, a call into a sandbox (write, start, run) for the edge;
- calls and failed calls of the window (a failed call is one the SDK gave up on), against the
  baseline's.

usage: python bench/bench_restarts.py [--window-s 10] [--workers 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import IMAGES, table
from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client, Quota
from tests.rollouts import Rollouts

EDGE = "rst"
#: The calls that need each service.
THROUGH = {
    "iam": ("create",),
    "placement": ("create",),
    "watcher": ("create",),
    "apiserver": (),
    f"edge-{EDGE}": ("write", "start", "run"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=3)
    args = ap.parse_args()
    env = {
        "DSEC_EDGE_IMAGE_DIR": str(IMAGES),
        "DSEC_EDGE_FNCALL_POOLS": "",
        "DSEC_EDGE_PAUSE_SWAP_MB": "256",
    }
    with tempfile.TemporaryDirectory(prefix="dsec-bench-restarts-") as home:
        c = LocalCluster(
            Path(home),
            transport="unix",
            edges=[EdgeSpec(edge_id=EDGE, runtime="container", extra_env=env)],
            compat=False,
            log_level="WARNING",
            supervised=True,
        )
        c.start(timeout_s=120)
        try:
            rows = run(c, args.window_s, args.workers)
        finally:
            c.stop()
    table(
        f"a SIGKILL of each service under {args.workers} rollout workers; "
        f"{args.window_s:.0f} s windows; supervised by supervisord",
        [
            "killed",
            "back SERVING s",
            "first success through it s",
            "calls",
            "failed",
            "failed %",
        ],
        rows,
    )


def run(c: LocalCluster, window_s: float, workers: int) -> list[list[object]]:
    with Client(c.apiserver, token=c.token) as admin:
        project = admin.create_project(
            "bench-restarts", quota=Quota(cpu_millis=50_000, memory_mb=50_000, sandboxes=500)
        )
        token = admin.create_token("bench", project=project.project_id).secret
    rollouts = Rollouts(c.apiserver, token, workers=workers, max_rounds=10_000)
    rows: list[list[object]] = []
    rollouts.start()
    try:
        time.sleep(3)  # under way
        t0 = time.monotonic()
        time.sleep(window_s)
        rows.append(["(none: baseline)", "-", "-", *_window(rollouts, t0, window_s)])
        for name, through in THROUGH.items():
            old = c.supervised_processes()[name].pid
            killed = time.monotonic()
            os.kill(old, signal.SIGKILL)
            back = _wait_serving(c, name, old) - killed
            time.sleep(max(0.0, killed + window_s - time.monotonic()))
            first = rollouts.first_success_after(killed, through)
            rows.append(
                [
                    name,
                    back,
                    (first - killed) if first is not None else "none",
                    *_window(rollouts, killed, window_s),
                ]
            )
    finally:
        rollouts.stop()
        with Client(c.apiserver, token=token) as cleanup:
            cleanup.stop_all(labels=rollouts.labels)
    return rows


def _window(r: Rollouts, start: float, length: float) -> list[object]:
    calls = [x for x in r.calls if start <= x.started < start + length]
    failed = [x for x in calls if x.error]
    return [len(calls), len(failed), 100.0 * len(failed) / max(1, len(calls))]


def _wait_serving(c: LocalCluster, name: str, old_pid: int, timeout_s: float = 120) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = c.supervised_processes()[name].pid
        if pid not in (0, old_pid) and c.status()[name] == "SERVING":
            return time.monotonic()
        time.sleep(0.02)
    raise SystemExit(f"{name} not SERVING again within {timeout_s} s")


if __name__ == "__main__":
    main()
