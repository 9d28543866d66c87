"""What tracing costs (issue 40): unary creates and ``run("true")`` with tracing off, sampled at
1% and at 100%, in the same run; and at 100% what it cost with OpenTelemetry's SDK as the
services' tracer provider (before common/tracer.py), and what the hand-written interceptors
cost with tracing off (before OpenTelemetry's instrumentation).

Each row is a fresh cluster of real processes: IAM, watcher, placement, an API server, a
null-runtime edge (the creates: the control plane without a runtime's cost, where tracing's
share is largest) and a container edge (the runs: one busybox sandbox, through aether and
chronus). ``DSEC_TRACE_INTERCEPTORS`` picks the interceptors of every service and
``DSEC_TRACE_PROVIDER`` their tracer provider. Off: no OTLP endpoint (nothing recorded,
context still propagated: the default). 1% / 100%: every service exports to a real OTLP/gRPC
receiver run by this bench (its own process, not counted), and the API server starts a trace
for that fraction of the calls (``DSEC_APISERVER_TRACE_SAMPLE_RATIO``). The "+ SDK" row: the
load generator also traces (OpenTelemetry's SDK, 100%, exporting to the same receiver), so
every call is a trace from the SDK to chronus.

The load comes from a process of its own (an AsyncClient): ``--clients`` concurrent unary
creates on the null edge for ``--seconds``, then as many concurrent ``run("true")`` on one
container sandbox. Reported per phase: operations/s, p50 latency, and the CPU the cluster's
processes spent per operation (on a 2-core machine the steadier figure), each against the
"off" row. Target: at 100%, at most 10% more cluster CPU per operation. Rounds alternate the
order of the rows.

usage: python bench/bench_tracing.py [--seconds 5] [--clients 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import cluster, pct, serve_otlp, table
from dsecctl.cluster import EdgeSpec

ROOT = Path(__file__).resolve().parents[1]
IMAGES = Path("/var/lib/dsec/images")
#: Room on the null edge for every create of a row (they are not stopped: a stop would be
#: another call in the measured loop).
NULL_SANDBOXES = 100_000

#: (label, interceptors, tracer provider, sample ratio or None for off, whether the SDK traces)
ROWS: list[tuple[str, str, str, float | None, bool]] = [
    ("off", "otel", "dsec", None, False),
    ("1%", "otel", "dsec", 0.01, False),
    ("100%", "otel", "dsec", 1.0, False),
    ("100% + the SDK tracing", "otel", "dsec", 1.0, True),
    ("100%, the OpenTelemetry SDK's provider", "otel", "sdk", 1.0, False),
    ("off, hand-written interceptors", "handwritten", "dsec", None, False),
]
BASELINE = "off"


# ------------------------------------------------------------------ the OTLP receiver


def _receiver(port: Any, spans: Any) -> None:
    """A real OTLP/gRPC trace receiver (its own process): counts what it is sent."""

    def count(request: Any) -> None:
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with spans.get_lock():
            spans.value += n

    serve_otlp(port, count)


# ------------------------------------------------------------------ the load generator


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def _phase(op: Any, clients: int, seconds: float, pids: list[int]) -> dict[str, float]:
    """``clients`` loops of ``op`` for ``seconds`` (after a 1 s warm-up)."""
    latencies: list[float] = []
    recording = False
    end = time.perf_counter() + 1.0 + seconds

    async def loop() -> None:
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            await op()
            if recording:
                latencies.append(time.perf_counter() - t0)

    tasks = [asyncio.create_task(loop()) for _ in range(clients)]
    await asyncio.sleep(1.0)
    recording, cpu0, t0 = True, _cpu_s(pids), time.perf_counter()
    await asyncio.gather(*tasks)
    wall, cpu = time.perf_counter() - t0, _cpu_s(pids) - cpu0
    n = len(latencies)
    return {
        "ops_s": n / wall,
        "p50_ms": pct(latencies, 50) * 1000,
        "cpu_ms": cpu / max(n, 1) * 1000,
    }


async def _load(args: argparse.Namespace) -> dict[str, Any]:
    if args.sdk_endpoint:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=args.sdk_endpoint, insecure=True))
        )
        trace.set_tracer_provider(provider)
    from libdsec import AsyncClient

    pids = [int(p) for p in args.pids.split(",")]
    async with AsyncClient(args.target, token=args.token, timeout=60) as dsec:

        async def create() -> None:
            await dsec.create(
                image="busybox", cpu=0.01, memory_mb=16, node_selector={"bench": "null"}
            )

        creates = await _phase(create, args.clients, args.seconds, pids)
        sb = await dsec.create(
            image="busybox", cpu=1, memory_mb=256, node_selector={"bench": "container"}
        )

        async def run() -> None:
            result = await sb.run("true")
            assert result.exit_code == 0, result

        runs = await _phase(run, args.clients, args.seconds, pids)
        await sb.stop()
    return {"create": creates, "run": runs}


# ------------------------------------------------------------------------------ rows


def _one_row(
    interceptors: str,
    provider: str,
    ratio: float | None,
    sdk: bool,
    endpoint: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    env = {"DSEC_TRACE_INTERCEPTORS": interceptors, "DSEC_TRACE_PROVIDER": provider}
    if ratio is not None:
        env |= {
            f"DSEC_{svc}_OTLP_ENDPOINT": endpoint
            for svc in ("IAM", "APISERVER", "PLACEMENT", "WATCHER", "EDGE")
        }
        env["DSEC_APISERVER_TRACE_SAMPLE_RATIO"] = str(ratio)
    edges = [
        EdgeSpec(
            edge_id="bnull",
            runtime="null",
            labels={"bench": "null"},
            cpu_millis=NULL_SANDBOXES * 10,
            memory_mb=NULL_SANDBOXES * 16,
            max_sandboxes=NULL_SANDBOXES,
        ),
        EdgeSpec(
            edge_id="bctr",
            runtime="container",
            labels={"bench": "container"},
            extra_env={
                "DSEC_EDGE_IMAGE_DIR": str(IMAGES),
                "DSEC_EDGE_FNCALL_POOLS": "",
                "DSEC_EDGE_VM": "off",
                "DSEC_EDGE_CGROUP_PARENT": f"dsec-bench-tracing-{os.getpid()}",
            },
        ),
    ]
    with cluster(edges=edges, extra_env=env) as c:
        pids = ",".join(str(p.pid) for p in c.processes if p.name != "compat")
        argv = [sys.executable, __file__, "--load", c.apiserver, c.token, pids]
        argv += ["--seconds", str(args.seconds), "--clients", str(args.clients)]
        if sdk:
            argv += ["--sdk-endpoint", endpoint]
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"load generator failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load", nargs=3, metavar=("TARGET", "TOKEN", "PIDS"))
    parser.add_argument("--sdk-endpoint", default="")
    args = parser.parse_args()
    if args.load:
        args.target, args.token, args.pids = args.load
        print(json.dumps(asyncio.run(_load(args))))
        return

    ctx = mp.get_context("spawn")
    port, spans = ctx.Value("i", 0), ctx.Value("q", 0)
    receiver = ctx.Process(target=_receiver, args=(port, spans), daemon=True)
    receiver.start()
    try:
        while port.value == 0:
            time.sleep(0.05)
        endpoint = f"127.0.0.1:{port.value}"
        results: dict[str, list[dict[str, Any]]] = {label: [] for label, *_ in ROWS}
        exported: dict[str, list[int]] = {label: [] for label, *_ in ROWS}
        for r in range(args.rounds):
            order = ROWS if r % 2 == 0 else list(reversed(ROWS))
            for label, interceptors, provider, ratio, sdk in order:
                before = spans.value
                results[label].append(_one_row(interceptors, provider, ratio, sdk, endpoint, args))
                exported[label].append(spans.value - before)
                print(f"round {r + 1}: {label} done", flush=True)
    finally:
        receiver.terminate()
        receiver.join(5)
    _report(results, exported, args)


def _mean(runs: list[dict[str, Any]], phase: str, key: str) -> float:
    return statistics.fmean(run[phase][key] for run in runs)


def _report(
    results: dict[str, list[dict[str, Any]]],
    exported: dict[str, list[int]],
    args: argparse.Namespace,
) -> None:
    base = results[BASELINE]
    for phase, what in (("create", "unary create (null edge)"), ("run", 'run("true") (container)')):
        rows: list[list[object]] = []
        for label, *_ in ROWS:
            runs = results[label]
            cpu = _mean(runs, phase, "cpu_ms")
            rows.append(
                [
                    label,
                    " · ".join(f"{run[phase]['ops_s']:.0f}" for run in runs),
                    _mean(runs, phase, "ops_s") / _mean(base, phase, "ops_s"),
                    _mean(runs, phase, "p50_ms"),
                    _mean(runs, phase, "p50_ms") / _mean(base, phase, "p50_ms"),
                    cpu,
                    cpu / _mean(base, phase, "cpu_ms"),
                    " · ".join(str(n) for n in exported[label]),
                ]
            )
        table(
            f"{what}: {args.clients} concurrent clients, {args.seconds:g} s per round, "
            f"{args.rounds} rounds (ratios: mean over rounds vs {BASELINE!r}; "
            "target at 100%: CPU ratio <= 1.10)",
            [
                "tracing",
                "ops/s per round",
                "ops/s ratio",
                "p50 ms",
                "p50 ratio",
                "cluster CPU ms/op",
                "CPU ratio",
                "spans exported (both phases)",
            ],
            rows,
        )


if __name__ == "__main__":
    main()
