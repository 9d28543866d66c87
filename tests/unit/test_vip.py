"""Virtual IPs without a network: the instances' settings and refusals, bgpd's and the
router's configuration, the cluster's plan for instances behind a virtual IP, the watch's
resume point and the health of an HTTP front end that must not be given traffic."""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from apiserver.config import ApiServerConfig
from apiserver.watch import MAX_REPLAY_S, replay_start
from common.config import ConfigError, load
from common.vip import RouteAgentHandle, VipConfig, bgpd_config
from compat.config import CompatConfig
from dsec.apiserver.v1 import apiserver_pb2
from dsecctl.cluster import EdgeSpec, LocalCluster, VipPlan, http_health
from dsecctl.hosts import Host, HostLab
from dsecctl.vip_router import VipRouter, lab_vips
from libdsec._watch import AsyncWatch
from libdsec.errors import InvalidArgument

GOOD = {"vip": "10.252.0.1", "vip_peer": "10.190.0.10", "vip_state_dir": "/run/x"}


def vip(**kw: object) -> VipConfig:
    return dataclasses.replace(VipConfig(), **{**GOOD, **kw})  # type: ignore[arg-type]


def test_without_a_vip_nothing_is_checked() -> None:
    VipConfig().validate_vip("127.0.0.1:7100")
    VipConfig().validate_vip("unix:/tmp/a.sock")


@pytest.mark.parametrize(
    ("fields", "listen", "words"),
    [
        ({"vip": "10.252.0"}, "0.0.0.0:7100", "IPv4"),
        ({"vip_peer": "router"}, "0.0.0.0:7100", "IPv4"),
        ({}, "127.0.0.1:7100", "0.0.0.0:<port>"),
        ({}, "unix:/tmp/a.sock", "0.0.0.0:<port>"),
        ({"vip_state_dir": ""}, "0.0.0.0:7100", "vip_state_dir"),
        ({"vip_hold_s": 1}, "0.0.0.0:7100", "vip_keepalive_s"),
        ({"vip_fall": 0}, "0.0.0.0:7100", "vip_fall"),
        ({"vip_check_interval_s": 0}, "0.0.0.0:7100", "vip_check_interval_s"),
    ],
)
def test_bad_vip_settings_are_refused_at_start(
    fields: dict[str, object], listen: str, words: str
) -> None:
    with pytest.raises(ConfigError, match=words.replace("<", ".").replace(">", ".")):
        vip(**fields).validate_vip(listen)


def test_the_vip_itself_or_every_address_may_be_listened_on() -> None:
    vip().validate_vip("0.0.0.0:7100")
    vip().validate_vip("10.252.0.1:7100")


def test_the_services_read_their_vip_settings_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k, v in {
        "LISTEN": "0.0.0.0:7100",
        "VIP": "10.252.0.1",
        "VIP_PEER": "10.190.0.10",
        "VIP_STATE_DIR": "/run/x",
        "VIP_ASN": "65123",
    }.items():
        monkeypatch.setenv(f"DSEC_APISERVER_{k}", v)
    cfg = load(ApiServerConfig, "APISERVER")
    assert (cfg.vip, cfg.vip_peer, cfg.vip_asn) == ("10.252.0.1", "10.190.0.10", 65123)
    monkeypatch.setenv("DSEC_APISERVER_LISTEN", "127.0.0.1:7100")
    with pytest.raises(ConfigError, match=r"0\.0\.0\.0"):
        load(ApiServerConfig, "APISERVER")
    monkeypatch.setenv("DSEC_COMPAT_VIP", "10.252.0.2")
    monkeypatch.setenv("DSEC_COMPAT_VIP_PEER", "10.190.0.10")
    monkeypatch.setenv("DSEC_COMPAT_VIP_STATE_DIR", "/run/y")
    monkeypatch.setenv("DSEC_COMPAT_LISTEN", "0.0.0.0:7130")
    # the SandboxFusion listener must take the virtual IP's calls too
    monkeypatch.setenv("DSEC_COMPAT_SANDBOX_FUSION_LISTEN", "127.0.0.1:7131")
    with pytest.raises(ConfigError, match=r"0\.0\.0\.0"):
        load(CompatConfig, "COMPAT")
    monkeypatch.setenv("DSEC_COMPAT_SANDBOX_FUSION_LISTEN", "0.0.0.0:7131")
    assert load(CompatConfig, "COMPAT").vip == "10.252.0.2"


def test_bgpd_speaks_to_the_router_only_with_the_hold_timer_that_ends_a_lost_host() -> None:
    conf = bgpd_config(vip(vip_asn=65101, vip_peer_asn=65000, vip_hold_s=3), "10.190.0.11")
    assert "router bgp 65101" in conf
    assert "bgp router-id 10.190.0.11" in conf
    assert "neighbor 10.190.0.10 remote-as 65000" in conf
    assert "neighbor 10.190.0.10 timers 1 3" in conf
    # announced by the agent (vtysh), never by the configuration: a new bgpd starts withdrawn
    assert "network" not in conf.replace("no bgp network import-check", "")


def test_the_router_takes_any_peer_of_its_subnet_and_spreads_over_sixteen(tmp_path: Path) -> None:
    lab = HostLab(tmp_path, "t1")
    lab.subnet = __import__("ipaddress").IPv4Network("10.190.7.0/24")
    host = Host("router", "dsec-t1-router", "10.190.7.10", "labt1p0", lab)
    conf = VipRouter(host).config()
    assert "bgp listen range 10.190.7.0/24 peer-group INSTANCES" in conf
    assert "maximum-paths 16" in conf
    assert "multipath-relax" in conf
    assert lab_vips(lab) == ["10.252.7.1", "10.252.7.2"]


def test_instances_behind_a_vip_listen_everywhere_on_one_port_and_clients_dial_the_vip(
    tmp_path: Path,
) -> None:
    lab = HostLab(tmp_path / "lab", "t2")
    hosts = {
        n: Host(n, f"dsec-t2-{n}", f"10.190.9.{10 + i}", f"labt2p{i}", lab)
        for i, n in enumerate(("api1", "api2", "cp"))
    }
    plan = VipPlan("10.252.9.1", "10.190.9.1")
    c = LocalCluster(
        tmp_path / "home",
        edges=[EdgeSpec(edge_id="n", runtime="null")],
        apiservers=2,
        hosts={"apiserver": hosts["api1"], "apiserver1": hosts["api2"], "compat": hosts["cp"]},
        vip=plan,
    )
    procs = {p.name: p for p in c.plan()}
    for name, host in (("apiserver", "api1"), ("apiserver1", "api2")):
        p = procs[name]
        assert p.address == f"{hosts[host].address}:7100"
        assert p.env["DSEC_APISERVER_LISTEN"] == "0.0.0.0:7100"
        assert p.env["DSEC_APISERVER_VIP"] == "10.252.9.1"
        assert p.env["DSEC_APISERVER_VIP_PEER"] == "10.190.9.1"
        assert p.marker.startswith("DSEC_APISERVER_VIP_STATE_DIR=")
    assert procs["compat"].env["DSEC_COMPAT_APISERVER"] == "10.252.9.1:7100"
    assert c.apiserver == "10.252.9.1:7100"


def test_a_vip_needs_every_instance_on_a_host_of_its_own(tmp_path: Path) -> None:
    lab = HostLab(tmp_path / "lab", "t3")
    h = Host("api1", "dsec-t3-api1", "10.190.9.10", "labt3p0", lab)
    with pytest.raises(ValueError, match="host of its own"):
        LocalCluster(
            tmp_path,
            apiservers=2,
            hosts={"apiserver": h, "apiserver1": h},
            vip=VipPlan("10.252.9.1", "10.190.9.1"),
        )
    with pytest.raises(ValueError, match="host of its own"):
        LocalCluster(
            tmp_path, apiservers=2, hosts={"apiserver": h}, vip=VipPlan("10.252.9.1", "10.190.9.1")
        )
    with pytest.raises(ValueError, match="need a virtual IP"):
        LocalCluster(tmp_path, compats=2)


def _ts(dt: datetime) -> Timestamp:
    t = Timestamp()
    t.FromDatetime(dt)
    return t


def test_a_resumed_watch_replays_from_its_changed_since_within_an_hour() -> None:
    now = time.time()
    assert abs(replay_start(apiserver_pb2.WatchSandboxesRequest()) - now) < 1
    ago = datetime.now(UTC) - timedelta(seconds=90)
    req = apiserver_pb2.WatchSandboxesRequest(changed_since=_ts(ago))
    assert abs(replay_start(req) - ago.timestamp()) < 0.01
    for bad in (timedelta(seconds=-(MAX_REPLAY_S + 60)), timedelta(minutes=5)):
        req = apiserver_pb2.WatchSandboxesRequest(changed_since=_ts(datetime.now(UTC) + bad))
        with pytest.raises(InvalidArgument) as err:
            replay_start(req)
        assert err.value.reason == "BAD_CHANGED_SINCE"


def test_the_sdk_sends_since_and_refuses_a_naive_time() -> None:
    since = datetime.now(UTC) - timedelta(seconds=5)
    w = AsyncWatch(None, since=since)  # type: ignore[arg-type]
    assert w._request.changed_since.ToDatetime(tzinfo=UTC) == since.replace(
        microsecond=since.microsecond
    )
    assert w.resume_at == since
    with pytest.raises(InvalidArgument, match="timezone"):
        AsyncWatch(None, since=datetime.now())  # type: ignore[arg-type]


@pytest.fixture
def http_status() -> Iterator[tuple[str, list[int]]]:
    codes = [200]

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(codes[0])
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{srv.server_address[1]}", codes
    finally:
        srv.shutdown()
        srv.server_close()


def test_an_http_front_end_answering_503_is_not_serving(http_status: tuple[str, list[int]]) -> None:
    address, codes = http_status
    assert http_health(address) == "SERVING"
    codes[0] = 503
    assert http_health(address) == "NOT_SERVING"
    codes[0] = 500
    assert http_health(address) == "HTTP 500"


def test_an_agent_that_cannot_start_bgpd_reports_why_and_is_started_again(tmp_path: Path) -> None:
    """The real agent process, with FRR's directory empty: it says why, the instance's side
    reports not-OK with that reason, and starts it again."""
    changes: list[tuple[bool, str]] = []

    async def main() -> None:
        twice = asyncio.Event()

        async def on_change(ok: bool, reason: str) -> None:
            changes.append((ok, reason))
            if len(changes) >= 2:
                twice.set()

        cfg = vip(
            vip_frr_dir=str(tmp_path / "none"),
            vip_state_dir=str(tmp_path / "s"),
            vip_peer="127.0.0.1",
            vip="127.0.0.1",
        )
        handle = RouteAgentHandle(cfg, "grpc:127.0.0.1:1/x", on_change, name="t")
        task = asyncio.create_task(handle.run())
        try:
            async with asyncio.timeout(30):
                await twice.wait()
        finally:
            await handle.close()
            task.cancel()

    asyncio.run(main())
    assert all(not ok for ok, _ in changes)
    assert "routing daemon cannot start" in changes[0][1]
    assert str(tmp_path / "none" / "bgpd") in changes[0][1]
