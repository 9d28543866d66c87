"""Where a create's milliseconds go (issue 43, item 2): a cold and a warm container create,
from the SDK call to the first command's answer, broken down by the services' own spans.

Every service of a private cluster exports its spans to a real OTLP/gRPC receiver run by this
bench (its own process), and the bench's SDK traces each `create() + run("true")` as one
trace (OpenTelemetry's SDK as its tracer provider). Besides the gRPC spans of every hop (SDK ->
API server -> IAM, placement -> edge -> chronus), the edge records the steps of a create
(common/steps.py): resolving the image, containment (network namespace, policy), the runtime's
steps (layers, writable layer, overlay, bundle, `runc run`, boot id), QoS, containment after
start, aether's Hello; a warm create: rename and claim.

Printed per span name, in the order they start, indented by depth: how many traces had it,
p50 of its duration, and p50 of its *self* time (its duration minus its children's, i.e. what
no finer span explains). The same run also times untraced creates (a client made before the
tracer provider, with the API server starting no traces: `DSEC_APISERVER_TRACE_SAMPLE_RATIO=0`),
interleaved with the traced ones, so what tracing itself adds shows beside the figures.

The same for the round trip on a running sandbox (item 3): `run("true")` against `get()` on the
same path, interleaved, each its own trace.

usage: python bench/bench_create_profile.py [--n 30] [--rtt 100]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import cluster, pct, serve_otlp, summary_ms, table
from dsecctl.cluster import EdgeSpec
from libdsec import Client

IMAGE = "busybox"
COLD = {"pool": "cold"}
WARM = {"pool": "warm"}
SERVICES = ("IAM", "APISERVER", "PLACEMENT", "WATCHER", "EDGE")
ROOT = "bench: create + first run"
RTT_ROOTS = {"run": 'bench: run("true")', "get": "bench: get()"}


def _receiver(port: Any, out: str) -> None:
    """A real OTLP/gRPC trace receiver (its own process): every span as one JSON line."""
    sink = open(out, "a", buffering=1)  # open for the process's life

    def write(request: Any) -> None:
        for rs in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in rs.resource.attributes}
            service = attributes.get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    span = {
                        "trace": s.trace_id.hex(),
                        "id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex(),
                        "name": s.name,
                        "service": service,
                        "kind": s.kind,
                        "start": s.start_time_unix_nano,
                        "end": s.end_time_unix_nano,
                    }
                    sink.write(json.dumps(span) + "\n")

    serve_otlp(port, write)


def _label(span: dict[str, Any]) -> str:
    """A span's row: gRPC spans by method and side (the client side of a call is the time
    on the wire and in the peer; the server side the time in the peer)."""
    name = span["name"]
    if name.startswith("/"):
        method = name.rsplit("/", 1)[1]
        side = {2: "server", 3: "client"}.get(span["kind"], "")
        return f"{span['service'].removeprefix('dsec-')} {side} {method}"
    return name


def breakdown(
    spans: list[dict[str, Any]], traces: set[str], root_name: str = ROOT
) -> list[list[object]]:
    """Rows of (indented name, traces with it, p50 ms, p50 self ms) over `traces`."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        if s["trace"] in traces:
            by_trace[s["trace"]].append(s)
    durations: dict[tuple[int, str], list[float]] = defaultdict(list)
    selfs: dict[tuple[int, str], list[float]] = defaultdict(list)
    order: dict[tuple[int, str], float] = {}
    for items in by_trace.values():
        kids: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for s in items:
            kids[s["parent"]].append(s)
        root = next((s for s in items if s["name"] == root_name), None)
        if root is None:
            continue

        def walk(
            s: dict[str, Any],
            depth: int,
            path: str,
            kids: dict[str, list[dict[str, Any]]] = kids,
            root: dict[str, Any] = root,
        ) -> None:
            key = (depth, f"{path}/{_label(s)}")
            dur = (s["end"] - s["start"]) / 1e6
            children = kids.get(s["id"], [])
            covered = _union_ms([(c["start"], c["end"]) for c in children])
            durations[key].append(dur)
            selfs[key].append(dur - covered)
            order.setdefault(key, (s["start"] - root["start"]) / 1e6)
            for c in sorted(children, key=lambda c: c["start"]):
                walk(c, depth + 1, key[1])

        walk(root, 0, "")
    rows = []
    # depth-first by path, siblings by when they start
    keys = sorted(durations, key=lambda k: _sort_key(k, order))
    for depth, path in keys:
        name = path.rsplit("/", 1)[1]
        rows.append(
            [
                "  " * depth + name,
                len(durations[(depth, path)]),
                pct(durations[(depth, path)], 50),
                pct(selfs[(depth, path)], 50),
            ]
        )
    return rows


def _sort_key(key: tuple[int, str], order: dict[tuple[int, str], float]) -> list[float]:
    """Orders a path after its parent and before its parent's later siblings."""
    parts = key[1].split("/")[1:]
    out = []
    for i in range(1, len(parts) + 1):
        prefix = (i - 1, "/" + "/".join(parts[:i]))
        out.append(order.get(prefix, 0.0))
    return out


def _union_ms(intervals: list[tuple[int, int]]) -> float:
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30, help="creates per kind (cold, warm)")
    ap.add_argument("--rtt", type=int, default=100, help='run("true") and get() calls each')
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dsec-bench-profile-"))
    out = work / "spans.jsonl"
    port = mp.Value("i", 0)
    rx = mp.Process(target=_receiver, args=(port, str(out)), daemon=True)
    rx.start()
    try:
        while port.value == 0:
            time.sleep(0.05)
        endpoint = f"127.0.0.1:{port.value}"
        env = {f"DSEC_{svc}_OTLP_ENDPOINT": endpoint for svc in SERVICES}
        env["DSEC_APISERVER_TRACE_SAMPLE_RATIO"] = "0"  # only the SDK's traces
        edge_env = {"DSEC_EDGE_CPU_OVERCOMMIT": "200", "DSEC_EDGE_FNCALL_POOLS": ""}
        edges = [
            EdgeSpec(edge_id="cold", runtime="container", labels=COLD, extra_env=edge_env),
            EdgeSpec(
                edge_id="warm",
                runtime="container",
                labels=WARM,
                extra_env={**edge_env, "DSEC_EDGE_WARM_POOL": f"{IMAGE}=8"},
            ),
        ]
        with cluster(edges=edges, extra_env=env) as c:
            run(c, endpoint, args.n, args.rtt)
        spans = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    finally:
        rx.kill()
        rx.join()
        shutil.rmtree(work, ignore_errors=True)
    roots = {s["trace"]: s for s in spans if s["name"] == ROOT}
    for kind in ("cold", "warm"):
        traces = set(roots) & KINDS[kind]
        table(
            f'where a {kind} create\'s time goes: create() + first run("true"), '
            f"{len(traces)} traces (ms; self = not inside a finer span)",
            ["span", "n", "p50", "p50 self"],
            breakdown(spans, traces),
        )
    for what, name in RTT_ROOTS.items():
        traces = {s["trace"] for s in spans if s["name"] == name}
        table(
            f"where a {what} on a running sandbox goes, {len(traces)} traces, interleaved "
            "with the other (ms)",
            ["span", "n", "p50", "p50 self"],
            breakdown(spans, traces, name),
        )
    rows = []
    for kind in ("cold", "warm"):
        traced, plain = TIMES[kind]["traced"], TIMES[kind]["plain"]
        rows.append(
            [kind, summary_ms(plain)[0], summary_ms(traced)[0], pct(traced, 50) / pct(plain, 50)]
        )
    table(
        "create + first run, untraced vs traced, interleaved (p50 ms)",
        ["create", "untraced", "traced", "ratio"],
        rows,
    )
    return 0


KINDS: dict[str, set[str]] = {"cold": set(), "warm": set()}
TIMES: dict[str, dict[str, list[float]]] = {
    k: {"traced": [], "plain": []} for k in ("cold", "warm")
}


def run(c: Any, endpoint: str, n: int, rtt: int) -> None:
    plain = Client(c.apiserver, token=c.token)  # before the provider: never traces
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint, insecure=True)))
    trace.set_tracer_provider(provider)
    tracer = trace.get_tracer("bench")
    traced = Client(c.apiserver, token=c.token)
    try:
        for sel in (COLD, WARM):  # the image mounted, the toolkit built, before anything counts
            plain.create(image=IMAGE, cpu=1, memory_mb=64, node_selector=sel).stop(grace_s=0)
        for i in range(n):
            for kind, sel in (("cold", COLD), ("warm", WARM)):
                order = ((traced, "traced"), (plain, "plain"))
                for client, how in order if i % 2 == 0 else order[::-1]:
                    _wait_warm(client, sel)
                    t0 = time.perf_counter()
                    if how == "traced":
                        with tracer.start_as_current_span(ROOT) as root:
                            sb = client.create(image=IMAGE, cpu=1, memory_mb=64, node_selector=sel)
                            assert sb.run("true").exit_code == 0
                        KINDS[kind].add(f"{root.get_span_context().trace_id:032x}")
                    else:
                        sb = client.create(image=IMAGE, cpu=1, memory_mb=64, node_selector=sel)
                        assert sb.run("true").exit_code == 0
                    TIMES[kind][how].append(time.perf_counter() - t0)
                    sb.stop(grace_s=0)
        # The round trip on a running sandbox (issue 43, item 3): run("true") against get().
        sb = traced.create(image=IMAGE, cpu=1, memory_mb=64, node_selector=COLD)
        for _ in range(20):
            sb.run("true")
        for _ in range(rtt):
            with tracer.start_as_current_span(RTT_ROOTS["run"]):
                assert sb.run("true").exit_code == 0
            with tracer.start_as_current_span(RTT_ROOTS["get"]):
                traced.get(sb.id)
        sb.stop(grace_s=0)
    finally:
        provider.force_flush()
        traced.close()
        plain.close()
    time.sleep(2.0)  # the services export in batches


def _wait_warm(client: Client, sel: dict[str, str]) -> None:
    """A warm create measures a claim: give the pool time to refill after the last one."""
    if sel is WARM:
        time.sleep(0.5)


if __name__ == "__main__":
    raise SystemExit(main())
