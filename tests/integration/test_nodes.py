"""Node management through real service processes (two null edges): draining a node (durable,
placement avoids it, what still runs there), the operator-only NodeService and `dsec node`, and
the watcher's registration checks (clock skew, dsec version, an edge id a live edge holds), by
raw RegisterEdge calls and by a second real edge process started with a live edge's id.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.convert import ts
from common.version import DSEC_VERSION
from dsec.apiserver.v1 import apiserver_pb2
from dsec.types.v1 import types_pb2
from dsec.watcher.v1 import watcher_pb2, watcher_pb2_grpc
from dsecctl.cluster import EdgeSpec, LocalCluster
from dsecctl.main import main as dsec
from dsecctl.node_cli import _call
from libdsec import Client
from libdsec.errors import (
    AlreadyExists,
    NoEligibleEdge,
    NotFound,
    PermissionDenied,
    SandboxNotFound,
    from_rpc_error,
)
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith
from tests.integration.test_control_plane import project_with_token

SPEC = {"cpu": 0.1, "memory_mb": 32}
#: Raw registrations below name addresses nothing serves: their probes fail, slowly enough
#: here that a registration's own verdict is read before PROBES_FAILING takes precedence.
WATCHER_ENV = {"DSEC_WATCHER_UNHEALTHY_AFTER": "40"}


@pytest.fixture(scope="module")
def lc(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    edges = [EdgeSpec(edge_id=e, runtime="null", labels={"node": e}) for e in ("na", "nb")]
    with cluster_with("nodes", edges=edges, extra_env=WATCHER_ENV) as c:
        yield c


@pytest.fixture
def operator(lc: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> LocalCluster:
    """`dsec` commands of this test talk to the cluster with its bootstrap (operator) token."""
    monkeypatch.setenv("DSEC_TARGET", lc.apiserver)
    monkeypatch.setenv("DSEC_TOKEN", lc.token)
    return lc


def watcher_stub(lc: LocalCluster) -> tuple[grpc.Channel, watcher_pb2_grpc.WatcherServiceStub]:
    ch = grpc.insecure_channel(lc.process("watcher").address)
    return ch, watcher_pb2_grpc.WatcherServiceStub(ch)


def status(lc: LocalCluster, edge_id: str) -> watcher_pb2.EdgeStatus:
    ch, stub = watcher_stub(lc)
    with ch:
        return stub.GetEdgeHealth(
            watcher_pb2.GetEdgeHealthRequest(edge_id=edge_id), timeout=5
        ).status


def health(lc: LocalCluster, edge_id: str) -> tuple[str, str]:
    s = status(lc, edge_id)
    return watcher_pb2.EdgeHealth.Name(s.health).removeprefix("EDGE_HEALTH_"), s.health_reason


def register(
    lc: LocalCluster,
    edge_id: str,
    *,
    address: str,
    version: str = DSEC_VERSION,
    incarnation: str = "raw",
    skew_s: float = 0.0,
) -> watcher_pb2.RegisterEdgeResponse:
    info = types_pb2.EdgeInfo(
        edge_id=edge_id,
        address=address,
        version=version,
        incarnation=incarnation,
        labels={"node": edge_id},
        backends=[types_pb2.BACKEND_CONTAINER],
        cpu_millis_capacity=8000,
        memory_mb_capacity=8192,
    )
    ch, stub = watcher_stub(lc)
    with ch:
        try:
            return stub.RegisterEdge(
                watcher_pb2.RegisterEdgeRequest(info=info, sent_at=ts(time.time() + skew_s)),
                timeout=5,
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None  # type: ignore[arg-type]


def test_a_drained_node_takes_no_new_sandbox_across_its_restart_until_undrained(
    operator: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    lc = operator
    with Client(lc.apiserver, token=lc.token) as c:
        kept = c.create(node_selector={"node": "na"}, task_id="drain-task", **SPEC)
        try:
            assert dsec(["node", "drain", "na", "--reason", "disk swap"]) == 0
            out = capsys.readouterr().out
            assert "node na" in out and "is draining: disk swap" in out
            assert "1 sandboxes still run there" in out
            assert "task drain-task: 1" in out
            wait_for(lambda: health(lc, "na") == ("DRAINING", "DRAINING"))
            assert status(lc, "na").health_detail == "disk swap"
            # Placement avoids it; what ran there goes on.
            for _ in range(4):
                s = c.create(**SPEC)
                assert s.info.edge_id == "nb"
                s.stop()
            with pytest.raises(NoEligibleEdge) as refused:
                c.create(node_selector={"node": "na"}, **SPEC)
            assert "1 draining" in refused.value.message
            assert c.get(kept.id).info.state == "RUNNING"
            # `dsec node list` and `dsec status` show it, with the reason.
            assert dsec(["node", "list", "--json"]) == 0
            rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
            assert rows["na"]["health"] == "DRAINING" and rows["na"]["draining"] is True
            assert rows["na"]["health_detail"] == "disk swap"
            assert rows["na"]["sandboxes"] == 1 and rows["na"]["version"] == DSEC_VERSION
            assert rows["nb"]["health"] == "HEALTHY" and rows["nb"]["draining"] is False

            # Durable: a restarted edge is still draining (read from its state dir).
            before = status(lc, "na").info.incarnation
            lc.restart("edge-na")
            wait_for(lambda: status(lc, "na").info.incarnation != before, 20)
            wait_for(lambda: health(lc, "na") == ("DRAINING", "DRAINING"), 20)
            assert status(lc, "na").health_detail == "disk swap"
            with pytest.raises(NoEligibleEdge):
                c.create(node_selector={"node": "na"}, **SPEC)

            assert dsec(["node", "undrain", "na"]) == 0
            assert "is not draining" in capsys.readouterr().out
            wait_for(lambda: health(lc, "na") == ("HEALTHY", ""))
            back = c.create(node_selector={"node": "na"}, **SPEC)
            assert back.info.edge_id == "na"
            back.stop()
        finally:
            dsec(["node", "undrain", "na"])
            with contextlib.suppress(SandboxNotFound):  # a null edge restarts empty
                kept.stop()


def test_node_calls_are_for_operators_and_name_known_nodes(
    operator: LocalCluster, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    lc = operator
    project, member = project_with_token(lc, "nodes-member")
    with Client(lc.apiserver, token=lc.token) as admin:
        sub_admin = admin.create_token("nodes-sub-admin", project=project, admin=True).secret
    for token in (member, sub_admin):
        monkeypatch.setenv("DSEC_TOKEN", token)
        with pytest.raises(PermissionDenied) as denied:
            _call("DrainNode", apiserver_pb2.DrainNodeRequest(edge_id="nb"))
        assert denied.value.reason == "OPERATOR_ONLY"
        assert dsec(["node", "list"]) == 2
        assert "PermissionDenied [OPERATOR_ONLY]" in capsys.readouterr().err
    monkeypatch.setenv("DSEC_TOKEN", lc.token)
    assert health(lc, "nb") == ("HEALTHY", "")
    assert dsec(["node", "drain", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "NotFound [EDGE_NOT_FOUND]" in err and "nosuch" in err
    with pytest.raises(NotFound):
        _call("UndrainNode", apiserver_pb2.UndrainNodeRequest(edge_id="nosuch"))


def test_a_skewed_clock_makes_an_edge_unhealthy_until_it_is_right(lc: LocalCluster) -> None:
    register(lc, "skew1", address="unix:/nonexistent/skew1.sock", skew_s=-120)
    s = status(lc, "skew1")
    assert (health(lc, "skew1")) == ("UNHEALTHY", "CLOCK_SKEW")
    assert -121 < s.clock_skew_s < -119
    assert "120.0 s behind" in s.health_detail
    with Client(lc.apiserver, token=lc.token) as c, pytest.raises(NoEligibleEdge) as refused:
        c.create(node_selector={"node": "skew1"}, **SPEC)
    assert "1 unhealthy (CLOCK_SKEW)" in refused.value.message
    register(lc, "skew1", address="unix:/nonexistent/skew1.sock", skew_s=0.0)
    assert health(lc, "skew1") == ("HEALTHY", "")
    register(lc, "skew1", address="unix:/nonexistent/skew1.sock", skew_s=45)
    assert health(lc, "skew1") == ("UNHEALTHY", "CLOCK_SKEW")
    assert "ahead of" in status(lc, "skew1").health_detail


def test_another_dsec_major_minor_is_unhealthy_a_patch_is_not(lc: LocalCluster) -> None:
    major, minor, _ = DSEC_VERSION.split(".")
    other = f"{major}.{int(minor) + 1}.0"
    register(lc, "vers1", address="unix:/nonexistent/vers1.sock", version=other)
    assert health(lc, "vers1") == ("UNHEALTHY", "VERSION_MISMATCH")
    assert other in status(lc, "vers1").health_detail
    register(lc, "vers1", address="unix:/nonexistent/vers1.sock", version=f"{major}.{minor}.97")
    assert health(lc, "vers1") == ("HEALTHY", "")


def test_an_id_a_live_edge_holds_is_refused_a_restart_is_not(lc: LocalCluster) -> None:
    holder = status(lc, "nb").info
    with pytest.raises(AlreadyExists) as taken:
        register(lc, "nb", address="unix:/nonexistent/impostor.sock", incarnation="impostor")
    assert taken.value.reason == "EDGE_ID_IN_USE"
    assert taken.value.metadata["holder_address"] == holder.address
    assert holder.address in taken.value.message
    after = status(lc, "nb")
    assert after.info.address == holder.address and after.info.incarnation == holder.incarnation
    # The same address (a restart of the same edge) is accepted; then the real edge re-registers.
    register(lc, "nb", address=holder.address, incarnation="restarted")
    wait_for(lambda: status(lc, "nb").info.incarnation == holder.incarnation, 10)
    wait_for(lambda: health(lc, "nb") == ("HEALTHY", ""))


def test_a_second_edge_process_with_a_live_edge_s_id_exits(
    lc: LocalCluster, tmp_path: Path
) -> None:
    env = dict(lc.process("edge-na").env)
    env["DSEC_EDGE_LISTEN"] = f"unix:{tmp_path / 'twin.sock'}"
    env["DSEC_EDGE_STATE_DIR"] = str(tmp_path / "state")
    env["DSEC_EDGE_METRICS_ADDR"] = "127.0.0.1:0"  # its own, as its own socket (not the twin's)
    log_path = tmp_path / "twin.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "edge"],
            env={**os.environ, **lc.extra_env, **env, "PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert rc == 2, text[-2000:]
    assert "EDGE_ID_IN_USE" in text
    assert lc.process("edge-na").address in text
    assert health(lc, "na")[0] != "UNHEALTHY"
    assert status(lc, "na").info.address == lc.process("edge-na").address


def test_status_shows_every_node_the_watcher_knows_with_health_and_why(
    operator: LocalCluster, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not only the edges of this cluster.json: a node that registered from elsewhere too."""
    lc = operator
    monkeypatch.setenv("DSEC_HOME", str(lc.home))
    register(lc, "ghost1", address="unix:/nonexistent/ghost1.sock", skew_s=300)
    assert dsec(["status"]) == 1  # an UNHEALTHY node fails the status
    out = capsys.readouterr().out
    assert "nodes (as the watcher knows them):" in out
    ghost = out[out.index("ghost1") :].splitlines()
    assert "UNHEALTHY" in ghost[0] and "CLOCK_SKEW" in ghost[1] and "300.0 s ahead" in ghost[1]
    assert dsec(["status", "--json"]) == 1
    nodes = {n["id"]: n for n in json.loads(capsys.readouterr().out)["nodes"]}
    assert {"na", "nb", "ghost1"} <= set(nodes)
    assert nodes["ghost1"]["health_reason"] == "CLOCK_SKEW"
    assert (
        nodes["nb"]["health"] == "HEALTHY"
        and nodes["nb"]["address"] == lc.process("edge-nb").address
    )
