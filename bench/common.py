"""Helpers shared by the benchmarks: a private cluster, percentiles, tables, memory."""

from __future__ import annotations

import statistics
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dsecctl.cluster import EdgeSpec, LocalCluster

IMAGES = Path("/var/lib/dsec/images")


@contextmanager
def cluster(
    *,
    edges: list[EdgeSpec] | None = None,
    apiservers: int = 1,
    log_level: str = "WARNING",
    extra_env: dict[str, str] | None = None,
) -> Iterator[LocalCluster]:
    """A private cluster on Unix sockets in a temp dir, always stopped."""
    with tempfile.TemporaryDirectory(prefix="dsec-bench-") as home:
        c = LocalCluster(
            Path(home),
            transport="unix",
            edges=edges or [EdgeSpec(edge_id="bench")],
            apiservers=apiservers,
            log_level=log_level,
            extra_env=extra_env,
        )
        c.start(timeout_s=120)
        try:
            yield c
        finally:
            c.stop()


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary_ms(values_s: list[float]) -> tuple[float, float, float]:
    ms = [v * 1000 for v in values_s]
    return pct(ms, 50), pct(ms, 99), statistics.fmean(ms) if ms else float("nan")


def table(title: str, header: list[str], rows: list[list[object]]) -> str:
    cells = [header] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        f"\n{title}",
        "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells[1:]]
    out = "\n".join(lines)
    print(out, flush=True)
    return out


def pss_kb(pid: int) -> tuple[int, int]:
    """(PSS, USS) of one process in kB from smaps_rollup."""
    pss = uss = 0
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key == "Pss":
                pss = int(rest.split()[0])
            elif key in ("Private_Clean", "Private_Dirty"):
                uss += int(rest.split()[0])
    return pss, uss


def descendants(pid: int) -> list[int]:
    out = [pid]
    i = 0
    while i < len(out):
        try:
            with open(f"/proc/{out[i]}/task/{out[i]}/children") as fh:
                out += [int(c) for c in fh.read().split()]
        except OSError:
            pass
        i += 1
    return out


def docker_available() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0
