"""Helpers shared by the benchmarks: a private cluster, percentiles, tables, memory."""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


# ---------------------------------------------------------------- CPU per process group

_HZ = os.sysconf("SC_CLK_TCK")


Snapshot = tuple[int, dict[int, tuple[str, int, int, int]]]


def cpu_snapshot() -> Snapshot:
    """(busy ticks of the whole machine,
    {pid: (cmdline, parent pid, own ticks, reaped children's ticks)})."""
    with open("/proc/stat") as fh:
        v = [int(x) for x in fh.readline().split()[1:]]
    busy = sum(v) - v[3] - v[4]  # all but idle and iowait
    procs: dict[int, tuple[str, int, int, int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                st = fh.read()
            with open(f"/proc/{d}/cmdline", "rb") as fb:
                cmd = fb.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        f = st[st.rfind(")") + 2 :].split()
        procs[int(d)] = (cmd, int(f[1]), int(f[11]) + int(f[12]), int(f[13]) + int(f[14]))
    return busy, procs


def cpu_split(
    before: Snapshot, after: Snapshot, classify: Callable[[int, str, str], tuple[str, str]]
) -> dict[str, float]:
    """CPU seconds per group between two snapshots. ``classify(pid, cmdline, parent's
    cmdline)`` names the group of a process's own CPU and the group of its reaped children's;
    what no live process accounts for (kernel threads, exits nobody reaped) is "other"."""
    out: dict[str, float] = {}
    procs = after[1]
    for pid, (cmd, ppid, own, kids) in procs.items():
        own0, kids0 = before[1].get(pid, (cmd, ppid, 0, 0))[2:]
        mine, children = classify(pid, cmd, procs.get(ppid, ("",))[0])
        out[mine] = out.get(mine, 0.0) + (own - own0) / _HZ
        out[children] = out.get(children, 0.0) + (kids - kids0) / _HZ
    out["other"] = out.get("other", 0.0) + (after[0] - before[0]) / _HZ - sum(out.values())
    return out


def serve_otlp(port: Any, export: Callable[[Any], None]) -> None:
    """A real OTLP/gRPC trace receiver on loopback, for a process of its own: `export` gets
    every ExportTraceServiceRequest; the port it listens on goes to `port.value` (an
    `mp.Value`). Runs until the process is killed."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import (
        trace_service_pb2,
        trace_service_pb2_grpc,
    )

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            export(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port.value = server.add_insecure_port("127.0.0.1:0")
    server.start()
    server.wait_for_termination()
