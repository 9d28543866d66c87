"""Quick latency check of the runtime on this node (benchmarks proper live in bench/).

    python -m edge.runtime [--n 20] [--image /var/lib/dsec/images/busybox.erofs] [--no-seccomp]

Creates and destroys N sandboxes one after the other, with pid 1 = `busybox sleep`, and prints
p50/p90/max of create() and destroy(). Must run as root.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from edge.runtime import cgroups
from edge.runtime.runc import RuncRuntime, become_subreaper
from edge.runtime.spec import LaunchSpec


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m edge.runtime")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--image", type=Path, default=Path("/var/lib/dsec/images/busybox.erofs"))
    ap.add_argument("--toolkit", type=Path, default=None)
    ap.add_argument("--no-seccomp", action="store_true")
    args = ap.parse_args()
    become_subreaper()
    with tempfile.TemporaryDirectory(prefix="dsec-rt-bench-") as tmp:
        rt = RuncRuntime(Path(tmp), cgroup_parent="dsec-bench", use_seccomp=not args.no_seccomp)
        keep = LaunchSpec(  # holds the layer mount so every create measures the shared case
            "bench-holder",
            [args.image],
            ["/bin/busybox", "sleep", "3600"],
            {},
            toolkit_dir=args.toolkit,
        )
        rt.create(keep)
        creates, destroys = [], []
        try:
            for i in range(args.n):
                spec = LaunchSpec(
                    f"bench-{i}",
                    [args.image],
                    ["/bin/busybox", "sleep", "3600"],
                    {},
                    toolkit_dir=args.toolkit,
                )
                t0 = time.perf_counter()
                rt.create(spec)
                t1 = time.perf_counter()
                rt.destroy(spec.sandbox_id)
                t2 = time.perf_counter()
                creates.append((t1 - t0) * 1000)
                destroys.append((t2 - t1) * 1000)
        finally:
            rt.cleanup_orphans(set())
            cgroups.remove("/dsec-bench")
    print(f"{'op':<8} {'n':>3} {'p50 ms':>8} {'p90 ms':>8} {'max ms':>8}")
    for name, xs in (("create", creates), ("destroy", destroys)):
        print(
            f"{name:<8} {len(xs):>3} {statistics.median(xs):>8.1f} {_pct(xs, 0.9):>8.1f} {max(xs):>8.1f}"
        )


if __name__ == "__main__":
    main()
