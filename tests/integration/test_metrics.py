"""Every service's metrics, read by a real Prometheus (the Debian package, started here).

The module's cluster: one container edge, one API server, the compatibility front ends. The
test's Prometheus scrapes every service's /metrics once a second twice over: as job ``dsec``
without a token (what anyone on the metrics port sees: node-level series) and, for IAM and the
API server, as job ``dsec-operator`` with the cluster's admin token (project series too).
What is checked: every target up; a sandbox's start, pause, resume and end counted by the
edge; RPCs by method and code; an edge's refusal by reason; the front end's requests by route
template; project series only to an operator's token; the endpoint's answers to bad requests;
the Grafana dashboard asking only for series Prometheus has.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc

from common.metrics import Metrics
from dsecctl.cluster import LocalCluster, free_port
from libdsec import Client, Quota
from libdsec.errors import DSecError, SandboxNotFound
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith, container_edge

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "dsec.json"
PROMETHEUS = shutil.which("prometheus")


@pytest.fixture(scope="module")
def mc(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    with cluster_with("met", edges=[container_edge("met")]) as c:
        yield c


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{q}", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/query", query=expr)["result"])

    def value(self, expr: str) -> float:
        """The single value of ``expr`` now (0 when it has no series)."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else 0.0

    def scraped_since(self, t: float) -> None:
        """Until every target's last scrape began after ``t`` (then a query sees what the
        services counted before ``t``)."""

        def fresh() -> bool:
            targets = self.get("/api/v1/targets")["activeTargets"]
            return bool(targets) and all(
                _rfc3339(tg["lastScrape"]) > t and tg["health"] == "up" for tg in targets
            )

        wait_for(fresh, timeout_s=30, interval_s=0.5)


def _rfc3339(value: str) -> float:
    from datetime import datetime

    # Prometheus gives nanoseconds ("2026-12-06T10:20:30.123456789Z"): keep microseconds.
    m = re.match(r"(.*?\.\d{1,6})\d*(Z|[+-].*)$", value)
    text = f"{m.group(1)}{m.group(2)}" if m else value
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@pytest.fixture(scope="module")
def prom(mc: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    if PROMETHEUS is None:  # a setup fault, not a missing feature of the host: fail, named
        pytest.fail("needs the prometheus binary: scripts/setup.sh installs it (apt prometheus)")
    home = tmp_path_factory.mktemp("prometheus")
    targets = [p.metrics for p in mc.processes if p.metrics]
    operator = [p.metrics for p in mc.processes if p.metrics and p.module in ("iam", "apiserver")]
    (home / "token").write_text(mc.token)
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": "dsec", "static_configs": [{"targets": targets}]},
            {
                "job_name": "dsec-operator",
                "authorization": {"credentials_file": str(home / "token")},
                "static_configs": [{"targets": operator}],
            },
        ],
    }
    (home / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log = (home / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        p = Prometheus(f"http://127.0.0.1:{port}")

        def ready() -> bool:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{p.url}/-/ready", timeout=2) as r:
                    return r.status == 200
            return False

        wait_for(ready, timeout_s=60, interval_s=0.5)
        p.scraped_since(time.time())
        yield p
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def _metrics(
    address: str, token: str = "", method: str = "GET", path: str = "/metrics"
) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, f"http://{address}{path}", headers=headers, timeout=10)


# ------------------------------------------------------------------------------ tests


def test_every_service_is_a_target_and_up(mc: LocalCluster, prom: Prometheus) -> None:
    want = {p.metrics for p in mc.processes if p.metrics}
    assert {p.module for p in mc.processes if p.metrics} >= {
        "iam",
        "watcher",
        "placement",
        "edge",
        "apiserver",
        "compat",
    }
    up = prom.query('up{job="dsec"}')
    assert {r["metric"]["instance"] for r in up} == want
    assert all(r["value"][1] == "1" for r in up), up
    # Each names itself (OpenTelemetry's resource, as Prometheus' target_info).
    services = {r["metric"]["service_name"] for r in prom.query('target_info{job="dsec"}')}
    assert {
        "dsec-iam",
        "dsec-watcher",
        "dsec-placement",
        "dsec-apiserver",
        "dsec-compat",
    } <= services
    assert "dsec-edge-met" in services


#: What one sandbox's life adds, each by exactly one (the test's own calls only).
LIFE = {
    "started": 'sum(dsec_edge_sandboxes_started_total{backend="CONTAINER"})',
    "pauses": 'sum(dsec_edge_pauses_total{backend="CONTAINER"})',
    "resumes": 'sum(dsec_edge_resumes_total{backend="CONTAINER",outcome="ok"})',
    "stopped": 'sum(dsec_edge_terminations_total{reason="STOPPED"})',
    "creates": 'sum(dsec_rpc_server_calls_total{job="dsec",method="SandboxService/CreateSandbox",code="OK"})',
    "not_found": 'sum(dsec_rpc_server_calls_total{job="dsec",method="SandboxService/GetSandbox",code="NOT_FOUND"})',
}


def test_a_sandboxs_life_is_counted_by_the_edge(mc: LocalCluster, prom: Prometheus) -> None:
    before = {k: prom.value(expr) for k, expr in LIFE.items()}
    with Client(mc.apiserver, token=mc.token) as c:
        s = c.create(image="busybox", cpu=0.1, memory_mb=64, task_id="met")
        try:
            prom.scraped_since(time.time())
            # Live now: one RUNNING container sandbox, and its memory committed.
            assert prom.value('dsec_edge_sandboxes{backend="CONTAINER",state="RUNNING"}') >= 1
            assert prom.value('dsec_edge_committed{resource="memory_mb"}') >= 64
            assert prom.value('dsec_edge_capacity{resource="memory_mb"}') > 0
            s.pause()
            prom.scraped_since(time.time())
            assert prom.value('dsec_edge_sandboxes{backend="CONTAINER",state="PAUSED"}') >= 1
            s.resume()
        finally:
            s.stop()
        with pytest.raises(SandboxNotFound):
            c.get("sb-met-0000000000000000")
    prom.scraped_since(time.time())
    after = {k: prom.value(expr) for k, expr in LIFE.items()}
    assert {k: after[k] - before[k] for k in before} == {k: 1.0 for k in before}
    # Durations were measured: a start, a pause and a resume each took some time.
    for name in ("start", "pause", "resume"):
        count = prom.value(f'sum(dsec_edge_{name}_duration_seconds_count{{backend="CONTAINER"}})')
        total = prom.value(f'sum(dsec_edge_{name}_duration_seconds_sum{{backend="CONTAINER"}})')
        assert count >= 1 and total > 0, name
    assert prom.value('dsec_edge_sandboxes{backend="CONTAINER",state="RUNNING"}') == 0


def test_an_edge_refusal_is_counted_by_reason(mc: LocalCluster, prom: Prometheus) -> None:
    expr = 'sum(dsec_edge_admission_refusals_total{reason="IMAGE_NOT_FOUND"})'
    before = prom.value(expr)
    with Client(mc.apiserver, token=mc.token) as c, pytest.raises(DSecError) as info:
        c.create(image="no-such-image-here", cpu=0.1, memory_mb=32)
    assert info.value.reason == "IMAGE_NOT_FOUND"
    prom.scraped_since(time.time())
    assert prom.value(expr) - before >= 1


def test_the_front_end_counts_requests_by_route_template(
    mc: LocalCluster, prom: Prometheus
) -> None:
    with httpx.Client(base_url=mc.compat_url, timeout=10) as http:
        r = http.get("/sandboxes/sb-nope-0000", headers={"X-API-Key": mc.token})
    assert r.status_code == 404
    prom.scraped_since(time.time())
    rows = prom.query('dsec_compat_http_requests_total{api="e2b",status="404"}')
    routes = {r["metric"]["route"] for r in rows}
    assert any("{" in route for route in routes), routes  # a template, not the id
    assert not any("sb-nope" in route for route in routes)


def test_project_series_need_an_operators_token(mc: LocalCluster, prom: Prometheus) -> None:
    with Client(mc.apiserver, token=mc.token) as admin:
        team = admin.create_project("metteam", quota=Quota(sandboxes=7))
        member = admin.create_token("met-agent", project=team.project_id, agent=True).secret
    iam = mc.process("iam").metrics
    anyone = _metrics(iam)
    assert anyone.status_code == 200 and anyone.headers["content-type"].startswith("text/plain")
    assert "dsec_rpc_server_calls_total" in anyone.text
    assert "project=" not in anyone.text
    assert "project=" not in _metrics(iam, member).text  # a member's token: no operator
    operator = _metrics(iam, mc.token).text
    assert f'dsec_project_quota{{project="{team.project_id}",resource="sandboxes"}} 7.0' in operator
    bad = _metrics(iam, "dsec_nope_notatoken")
    assert bad.status_code == 401 and "project=" not in bad.text
    # Through Prometheus: only the operator's job has them.
    prom.scraped_since(time.time())
    rows = prom.query(f'dsec_project_quota{{project="{team.project_id}",resource="sandboxes"}}')
    assert {r["metric"]["job"] for r in rows} == {"dsec-operator"}
    assert prom.query('dsec_project_usage{job="dsec"}') == []


def test_the_endpoint_answers_bad_requests_precisely(mc: LocalCluster) -> None:
    edge = mc.process("edge-met").metrics
    assert _metrics(edge, path="/other").status_code == 404
    assert _metrics(edge, method="POST").status_code == 405
    assert _metrics(edge, method="POST").headers["allow"] == "GET"
    basic = httpx.get(f"http://{edge}/metrics", headers={"authorization": "Basic eDp5"}, timeout=10)
    assert basic.status_code == 401
    host, port = edge.rsplit(":", 1)
    import socket

    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"NONSENSE\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 400")


def test_status_and_cluster_json_give_each_metrics_address(mc: LocalCluster) -> None:
    state = json.loads((mc.home / "cluster.json").read_text())
    for p in mc.processes:
        if p.module in ("iam", "watcher", "placement", "edge", "apiserver", "compat"):
            assert state["services"][p.name]["metrics"] == f"http://{p.metrics}/metrics"
    out = subprocess.run(
        [sys.executable, "-m", "dsecctl", "status", "--json"],
        env={**os.environ, "DSEC_HOME": str(mc.home)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = {row["name"]: row for row in json.loads(out.stdout)["services"]}
    assert rows["edge-met"]["metrics"] == f"http://{mc.process('edge-met').metrics}/metrics"


#: Dashboard series this module's cluster does not produce, and why (each still has to be an
#: instrument the code declares: checked below).
ABSENT_HERE = {
    "dsec_edge_fncall_pool": "no FnCall pools on this edge",
    "dsec_edge_fncall_jobs": "no FnCall pools on this edge",
    "dsec_edge_fncall_recycled": "no FnCall pools on this edge",
    "dsec_edge_warm": "no warm pool on this edge",
    "dsec_edge_warm_claims": "no warm pool on this edge",
    "dsec_edge_warm_misses": "no warm pool on this edge",
    "dsec_queue_waiting": "no create waits in the queue here",
    "dsec_queue_wait_seconds": "no create waits in the queue here",
    "dsec_edge_resume_duration_seconds": "only once a resume ran (another test)",
    "dsec_edge_pause_duration_seconds": "only once a pause ran (another test)",
    "dsec_edge_pause_freed_bytes": "only once a pause freed memory (another test)",
    "dsec_edge_pauses": "only once a pause ran (another test)",
    "dsec_edge_resumes": "only once a resume ran (another test)",
    "dsec_edge_admission_refusals": "only once an edge refused (another test)",
    "dsec_edge_terminations": "only once a sandbox ended (another test)",
    "dsec_compat_http_requests": "only once the front end answered (another test)",
}


def _base(name: str) -> str:
    """An instrument's name from a Prometheus series name (counters get _total, histograms
    _bucket, _sum and _count)."""
    return re.sub(r"_(total|bucket|sum|count)$", "", name)


def test_the_grafana_dashboard_asks_only_for_series_the_services_export(
    prom: Prometheus,
) -> None:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    assert len(board["panels"]) >= 20
    used = {m for e in exprs for m in re.findall(r"\b(dsec_[a-z_]+)", e)}
    # Every name is an instrument some service declares ...
    source = "\n".join(
        f.read_text()
        for d in ("common", "edge", "iam", "apiserver", "placement", "watcher", "compat")
        for f in (REPO / d).rglob("*.py")
    )
    declared = set(re.findall(r'"(dsec_[a-z_]+)"', source))
    assert {_base(u) for u in used} <= declared, sorted({_base(u) for u in used} - declared)
    # ... and Prometheus has each one this cluster produces.
    names = set(prom.get("/api/v1/label/__name__/values"))
    missing = {u for u in used if u not in names and _base(u) not in ABSENT_HERE}
    assert not missing, sorted(missing)
    for e in exprs:  # each one is a query Prometheus accepts
        prom.get("/api/v1/query", query=e.replace("$__rate_interval", "1m"))


class _MetricsReceiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """A real OTLP/gRPC metrics receiver (opentelemetry-proto's service)."""

    def __init__(self) -> None:
        self.points: list[tuple[str, str, float]] = []  # (service.name, metric, value)

    def Export(self, request: Any, context: object) -> Any:
        for rm in request.resource_metrics:
            service = next(
                (a.value.string_value for a in rm.resource.attributes if a.key == "service.name"),
                "",
            )
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    for dp in metric.sum.data_points:
                        self.points.append((service, metric.name, dp.as_double or dp.as_int))
        return metrics_service_pb2.ExportMetricsServiceResponse()


def test_metrics_are_pushed_over_otlp_when_asked() -> None:
    """DSEC_<SVC>_OTLP_METRICS_INTERVAL_S: the same instruments pushed to an OTLP receiver."""
    receiver = _MetricsReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    m = Metrics("otlp-test", otlp_endpoint=f"127.0.0.1:{port}", otlp_interval_s=0.2)
    try:
        m.meter.create_counter("dsec_test_pushed").add(5, {"kind": "k"})
        wait_for(
            lambda: ("dsec-otlp-test", "dsec_test_pushed", 5) in receiver.points,
            timeout_s=20,
            interval_s=0.1,
        )
    finally:
        m.shutdown()
        server.stop(None)
