"""common/metrics.py: project series only within a token's scope, the endpoint's answers, the
configuration's checks, and metrics turned off (the benchmark's baseline)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from common.config import ConfigError, ServiceConfig
from common.metrics import Metrics, MetricsEndpoint, ProjectScope, in_scope
from libdsec.errors import Unauthenticated


def _metrics() -> Metrics:
    m = Metrics("unit")
    used = m.meter.create_counter("dsec_unit_used")
    for project in ("root", "root/a", "root/a/x", "root/ab", "root/b"):
        used.add(1, {"project": project})
    m.meter.create_counter("dsec_unit_calls").add(3, {"method": "M"})
    return m


def _projects(text: str) -> set[str]:
    return {
        line.split('project="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if 'project="' in line
    }


def test_in_scope_is_the_subtree_not_a_name_prefix() -> None:
    assert in_scope("root/a", "root/a") and in_scope("root/a/x", "root/a")
    assert not in_scope("root/ab", "root/a") and not in_scope("root", "root/a")
    assert not in_scope("root/a", None)


@pytest.mark.parametrize(
    ("scope", "seen"),
    [
        (None, set()),
        ("root", {"root", "root/a", "root/a/x", "root/ab", "root/b"}),
        ("root/a", {"root/a", "root/a/x"}),
    ],
)
def test_a_scrape_shows_the_projects_of_its_scope_only(scope: ProjectScope, seen: set[str]) -> None:
    m = _metrics()
    text = asyncio.run(m.exposition(scope)).decode()
    assert _projects(text) == seen
    assert 'dsec_unit_calls_total{method="M"} 3.0' in text  # node-level: always
    assert "dsec_build_info" in text


def test_metrics_off_record_nothing() -> None:
    m = Metrics("unit", enabled=False)
    m.meter.create_counter("dsec_unit_used").add(1)
    text = asyncio.run(m.exposition("root")).decode()
    assert "dsec_" not in text


def test_the_endpoint_checks_tokens_and_requests() -> None:
    async def authorize(token: str) -> ProjectScope:
        if token == "admin":
            return "root"
        if token == "member":
            return None
        raise Unauthenticated("unknown token", reason="BAD_TOKEN")

    async def run() -> None:
        endpoint = MetricsEndpoint(_metrics(), "127.0.0.1:0", authorize)
        await endpoint.start()
        try:
            async with httpx.AsyncClient(base_url=f"http://{endpoint.address}") as http:

                async def get(token: str = "", path: str = "/metrics") -> httpx.Response:
                    headers = {"authorization": f"Bearer {token}"} if token else {}
                    return await http.get(path, headers=headers)

                assert _projects((await get()).text) == set()
                assert _projects((await get("member")).text) == set()
                assert len(_projects((await get("admin")).text)) == 5
                bad = await get("nope")
                assert bad.status_code == 401 and "BAD_TOKEN" in bad.text
                assert (await get(path="/")).status_code == 404
                assert (await http.post("/metrics")).status_code == 405
            # A request head larger than the limit: 400, and the listener goes on serving.
            reader, writer = await asyncio.open_connection(*endpoint.address.rsplit(":", 1))
            writer.write(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 40_000 + b"\r\n\r\n")
            await writer.drain()
            assert (await reader.read(100)).startswith(b"HTTP/1.1 400")
            writer.close()
            async with httpx.AsyncClient(base_url=f"http://{endpoint.address}") as http:
                assert (await http.get("/metrics")).status_code == 200
        finally:
            await endpoint.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"metrics_addr": "nowhere"}, "metrics_addr must be host:port"),
        ({"metrics_addr": "127.0.0.1:99999"}, "metrics_addr must be host:port"),
        ({"metrics": "maybe"}, "metrics must be on or off"),
        ({"metrics": "off", "metrics_addr": "127.0.0.1:0"}, "metrics is off"),
        ({"otlp_metrics_interval_s": 5.0}, "needs otlp_endpoint"),
        ({"otlp_metrics_interval_s": -1.0}, ">= 0"),
    ],
)
def test_bad_metrics_configuration_is_refused_naming_the_field(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        ServiceConfig(**fields).validate()  # type: ignore[arg-type]
