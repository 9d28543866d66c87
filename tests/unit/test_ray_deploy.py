"""`dsec deploy --ray` without a Ray cluster: edge ids, addresses, bad input refused before
``ray.init``, and the caller's $DSEC_HOME pointing at a deployment (tests/multinode has the
real cluster)."""

from __future__ import annotations

import json
import re
import socket
import stat
import time
from pathlib import Path

import pytest

from dsecctl.main import main
from dsecctl.ray_deploy import check_reachable, edge_id_for, parse_address
from dsecctl.ray_home import forget_home, recorded_deployment, write_home
from libdsec._config import resolve
from libdsec.errors import InvalidArgument, Unavailable


def test_edge_ids_are_stable_valid_and_distinct() -> None:
    assert edge_id_for("10.1.2.3") == "n010001002003"
    ids = {edge_id_for(ip) for ip in ("10.1.2.3", "10.1.23.0", "10.12.3.0", "fd00::1", "fd00::2")}
    assert len(ids) == 5
    assert all(re.fullmatch(r"[a-z0-9]{1,16}", i) for i in ids)
    assert edge_id_for("fd00::1") == edge_id_for("fd00:0::1")


def test_addresses() -> None:
    assert parse_address("ray://head:10001") == ("head", 10001)
    assert parse_address("ray://head") == ("head", 10001)
    assert parse_address("10.0.0.1:6379") == ("10.0.0.1", 6379)
    for bad in ("head", "ray://head:x", "head:0", ":6379"):
        with pytest.raises(InvalidArgument) as err:
            parse_address(bad)
        assert err.value.reason == "BAD_RAY_ADDRESS"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_address_nothing_answers_is_refused_at_once() -> None:
    t0 = time.monotonic()
    with pytest.raises(Unavailable) as err:
        check_reachable(f"ray://127.0.0.1:{_closed_port()}")
    assert err.value.reason == "RAY_UNREACHABLE"
    assert time.monotonic() - t0 < 2


def test_deploy_to_an_unreachable_address_fails_before_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DSEC_HOME", str(tmp_path))
    address = f"127.0.0.1:{_closed_port()}"
    assert main(["deploy", "--ray", address]) == 2
    err = capsys.readouterr().err
    assert "RAY_UNREACHABLE" in err and address in err
    assert list(tmp_path.iterdir()) == []


def test_home_points_at_the_deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = {"apiserver": "10.0.0.1:7100", "token": "s3cret", "created_at": 1.0}
    write_home(tmp_path, "ray://head:10001", st)
    assert stat.S_IMODE((tmp_path / "token").stat().st_mode) == 0o600
    monkeypatch.setenv("DSEC_HOME", str(tmp_path))
    monkeypatch.delenv("DSEC_TARGET", raising=False)
    monkeypatch.delenv("DSEC_TOKEN", raising=False)
    conn = resolve()
    assert (conn.target, conn.token) == ("10.0.0.1:7100", "s3cret")
    assert recorded_deployment(tmp_path) == "ray://head:10001"
    assert not forget_home(tmp_path, "ray://other:10001")
    assert forget_home(tmp_path, "ray://head:10001")
    assert list(tmp_path.iterdir()) == []


def test_local_commands_leave_a_deployment_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DSEC_HOME", str(tmp_path))
    write_home(tmp_path, "ray://head:10001", {"apiserver": "a:1", "token": "t", "created_at": 0})
    for command in (["up"], ["down"], ["restart"]):
        assert main(command) == 2
        assert "dsec undeploy --ray ray://head:10001" in capsys.readouterr().err
    assert json.loads((tmp_path / "cluster.json").read_text())["apiserver"] == "a:1"


def test_deploy_refuses_a_home_with_a_local_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DSEC_HOME", str(tmp_path))
    (tmp_path / "cluster.json").write_text(json.dumps({"apiserver": "127.0.0.1:7100"}))
    assert main(["deploy", "--ray", "ray://127.0.0.1:1"]) == 2
    assert "holds a local cluster" in capsys.readouterr().err


def test_a_deployment_behind_a_virtual_ip_needs_both_addresses(tmp_path: Path) -> None:
    from dsecctl.cluster import Wiring
    from dsecctl.ray_deploy import PORTS, DeploySettings

    assert DeploySettings().vip_problem() == "" and DeploySettings().vip_plan() is None
    for vip, router in (("10.9.0.1", ""), ("", "10.0.0.1"), ("vip", "10.0.0.1")):
        assert "go together" in DeploySettings(vip=vip, vip_router=router).vip_problem()
    s = DeploySettings(vip="10.9.0.1", vip_router="10.0.0.254", vip_asn=65200)
    plan = s.vip_plan()
    assert plan is not None and plan.target == f"10.9.0.1:{PORTS['apiserver']}"
    w = Wiring("iam:1", "watcher:1", "placement:1", tmp_path)
    p = Wiring.behind_vip(w.apiserver("apiserver1", "10.0.0.2:7100", viewer="x:1"), plan, tmp_path)
    assert p.env["DSEC_APISERVER_LISTEN"] == "0.0.0.0:7100"
    assert p.env["DSEC_APISERVER_VIP"] == "10.9.0.1"
    assert p.env["DSEC_APISERVER_VIP_PEER"] == "10.0.0.254"
    assert p.env["DSEC_APISERVER_VIP_ASN"] == "65200"
    assert p.marker == f"DSEC_APISERVER_VIP_STATE_DIR={tmp_path}"
