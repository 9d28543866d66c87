"""A sandbox's resource-use samples (GetSandboxMetrics, edge/usage.py), through the dsec SDK
and through E2B's metrics routes with the stock e2b SDK, on a real container edge sampling every
second: CPU a command burns, memory it holds, disk it writes, each seen in the samples; the
window; the typed errors (a bad window, another backend, an unknown sandbox)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from libdsec import Client, SandboxMetric
from libdsec.errors import InvalidArgument, SandboxTerminated
from tests.integration.conftest import ClusterWith, container_edge
from tests.integration.e2b_support import E2bTarget, e2b_cluster, e2b_environment

pytestmark = pytest.mark.images("busybox", "bookworm", "e2b-base")

MIB = 1 << 20


@pytest.fixture(scope="module")
def target(cluster_with: ClusterWith) -> Iterator[E2bTarget]:
    edge = container_edge("mt0", {"DSEC_EDGE_USAGE_SAMPLE_S": "1", "DSEC_EDGE_USAGE_KEEP_S": "120"})
    with e2b_cluster(cluster_with, "metrics", edge) as target, e2b_environment(target):
        yield target


@pytest.fixture(scope="module")
def container_cluster(target: E2bTarget):  # type: ignore[no-untyped-def]
    """(So a failing test prints the services' log tails: see tests/conftest.py.)"""
    return target.cluster


def _until(get: Callable[[], list[SandboxMetric]], ok: Callable[[SandboxMetric], bool]) -> None:
    deadline = time.monotonic() + 30
    seen: list[SandboxMetric] = []
    while time.monotonic() < deadline:
        seen = get()
        if any(ok(m) for m in seen):
            return
        time.sleep(0.5)
    raise AssertionError(f"no sample met the condition in 30 s: {seen[-5:]}")


def test_samples_show_the_cpu_memory_and_disk_a_sandbox_uses(
    target: E2bTarget, container_cluster: object
) -> None:
    with Client(target.cluster.apiserver, token=target.key) as c:
        with c.create(image="bookworm", cpu=1, memory_mb=256, disk_mb=256) as sb:
            _until(sb.metrics, lambda m: m.cpu_count == 1 and m.mem_total_bytes == 256 * MIB)
            quiet = sb.metrics()[-1]
            assert quiet.cpu_used_pct < 50 and quiet.disk_total_bytes > 200 * MIB
            # CPU: one core busy for a while.
            sb.start("timeout 6 sh -c 'while :; do :; done'; true")
            _until(sb.metrics, lambda m: m.cpu_used_pct > 60)
            # Memory: 96 MiB held by a process (not page cache).
            sb.start("python3 -c 'import time; b = bytearray(96 << 20); time.sleep(8)'")
            _until(sb.metrics, lambda m: m.mem_used_bytes > 90 * MIB)
            # Disk: 40 MiB written to the writable layer.
            before = sb.metrics()[-1].disk_used_bytes
            sb.run("dd if=/dev/urandom of=/root/blob bs=1M count=40 status=none && sync")
            _until(sb.metrics, lambda m: m.disk_used_bytes > before + 35 * MIB)
            samples = sb.metrics()
            ats = [m.at for m in samples]
            assert ats == sorted(ats) and len(samples) >= 3
            assert all(0 <= m.cpu_used_pct <= 100 for m in samples)
            # The window.
            cut = ats[len(ats) // 2]
            later = sb.metrics(start=cut)
            assert later and all(m.at >= cut - timedelta(seconds=1) for m in later)
            assert len(later) < len(samples)
            assert sb.metrics(end=datetime.now(UTC) - timedelta(hours=1)) == []
            with pytest.raises(InvalidArgument) as bad:
                sb.metrics(start=datetime.now(UTC), end=datetime.now(UTC) - timedelta(hours=1))
            assert bad.value.reason == "BAD_TIME_RANGE"
        with pytest.raises(SandboxTerminated):  # stopped on leaving the block
            sb.metrics()


def test_e2bs_metrics_routes_answer_with_the_same_samples(
    target: E2bTarget, container_cluster: object
) -> None:
    from e2b import Sandbox

    sb = Sandbox.create(metadata={"test": "metrics"})
    try:
        sb.commands.run("timeout 4 sh -c 'while :; do :; done'; true", background=True)
        deadline = time.monotonic() + 30
        metrics = []
        while time.monotonic() < deadline:
            metrics = sb.get_metrics()
            if any(m.cpu_used_pct > 60 for m in metrics):
                break
            time.sleep(0.5)
        assert any(m.cpu_used_pct > 60 for m in metrics), metrics
        last = metrics[-1]
        assert last.cpu_count == 1 and last.mem_total == 512 * MIB
        assert 0 < last.mem_used < last.mem_total and last.disk_total > 0
        assert metrics == sorted(metrics, key=lambda m: m.timestamp)
        headers = {"X-API-Key": target.key}
        with httpx.Client(base_url=target.url, timeout=30, headers=headers) as http:
            many = http.get("/sandboxes/metrics", params={"sandbox_ids": f"{sb.sandbox_id},nope"})
            assert many.status_code == 200
            body = many.json()["sandboxes"]
            assert list(body) == [sb.sandbox_id]
            assert set(body[sb.sandbox_id]) >= {"timestamp", "cpuUsedPct", "memUsed", "diskUsed"}
            assert http.get("/sandboxes/metrics").status_code == 400
            r = http.get(f"/sandboxes/{sb.sandbox_id}/metrics", params={"start": "soon"})
            assert r.status_code == 400 and "Unix seconds" in r.json()["message"]
            r = http.get(f"/sandboxes/{sb.sandbox_id}/metrics", params={"start": 20, "end": 10})
            assert r.status_code == 400
            assert http.get("/sandboxes/sb-nope-0000/metrics").status_code == 404
            now = int(time.time())
            r = http.get(
                f"/sandboxes/{sb.sandbox_id}/metrics", params={"start": now - 2, "end": now + 1}
            )
            assert r.status_code == 200 and 1 <= len(r.json()) <= 5
    finally:
        sb.kill()
