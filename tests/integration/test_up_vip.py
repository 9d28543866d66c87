"""`dsec up --vip`: the local cluster's API servers behind one virtual IP, through the real CLI.

Each instance on a lab host of its own announcing the address over BGP to an FRR router that
spreads connections with ECMP (dsecctl/vip_router.py); the rest of the cluster supervised here
as usual. `dsec status` shows the route's next hops; an instance killed is restarted by the
supervisor and announces again; `dsec down` removes the router, the hosts and their routes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsecctl.cluster import LocalCluster
from dsecctl.vip_router import RUN_DIR, frr_installed
from libdsec import Client
from tests.helpers import wait_for
from tests.integration.test_supervisor import Up, _free_port_base

pytestmark = [pytest.mark.timeout(600), pytest.mark.images("busybox")]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    missing = frr_installed()
    if missing:
        pytest.fail(f"{missing} (scripts/setup.sh installs it)")
    home = tmp_path_factory.mktemp("upvip")
    env = {
        **os.environ,
        "DSEC_HOME": str(home),
        "DSEC_EDGE_WARM_POOL": "",
        "DSEC_EDGE_FNCALL_POOLS": "",
        "DSEC_EDGE_VM": "off",
        "DSEC_EDGE_PAUSE_SWAP_MB": "256",
    }
    u = Up(home, env)
    try:
        out = u.dsec("up", "--vip", "--apiservers", "2", "--port-base", str(_free_port_base()))
        assert out.returncode == 0, out.stdout + out.stderr
        assert "virtual IP" in out.stdout, out.stdout
        yield u
    finally:
        u.dsec("down")
        c = LocalCluster.from_state(home)
        if c is not None:  # `dsec down` failed: stop it from here
            c.stop()


def next_hops(u: Up) -> list[str]:
    out = u.dsec("status", "--json")
    return list(json.loads(out.stdout)["vip"]["next_hops"])


def test_status_shows_both_instances_behind_the_virtual_ip(up: Up) -> None:
    out = up.dsec("status")
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.search(r"virtual IP (\S+) via router (\S+): next hops (.+)", out.stdout)
    assert m, out.stdout
    assert len(m.group(3).split(", ")) == 2, out.stdout
    state = json.loads((up.home / "cluster.json").read_text())
    assert state["apiserver"] == m.group(1) == state["vip"]["address"] + f":{state['vip']['port']}"


def test_a_sandbox_through_the_virtual_ip(up: Up) -> None:
    with up.client() as c:  # cluster.json's address: the virtual IP
        sb = c.create(image="busybox")
        try:
            assert sb.run("echo through-the-vip").stdout == b"through-the-vip\n"
        finally:
            sb.stop()
    # the CLI's default target ($DSEC_HOME's cluster.json) is the virtual IP too
    who = up.dsec("whoami")
    assert who.returncode == 0 and "bootstrap-admin" in who.stdout, who.stdout + who.stderr


def test_a_killed_instance_is_restarted_and_announces_again(up: Up) -> None:
    c = up.cluster()
    before = next_hops(up)
    pid = c.supervised_processes()["apiserver1"].pid
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: len(next_hops(up)) == 1, timeout_s=10)
    wait_for(
        lambda: up.cluster().supervised_processes()["apiserver1"].pid not in (0, pid),
        timeout_s=60,
    )
    wait_for(lambda: next_hops(up) == before, timeout_s=60)
    with Client(c.apiserver, token=c.token) as client:
        assert client.whoami().name == "bootstrap-admin"


def test_down_removes_the_router_the_hosts_and_the_route(up: Up) -> None:
    state = json.loads((up.home / "vip.json").read_text())
    router_dir = RUN_DIR / state["router"]
    assert router_dir.exists()
    out = up.dsec("down")
    assert out.returncode == 0, out.stdout + out.stderr
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in netns for ns in state["namespaces"]), netns
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    assert state["uplink"] + ":" not in links and state["uplink"] + "@" not in links
    assert not router_dir.exists()
    assert not (up.home / "vip.json").exists()
    assert not Path(up.home / "cluster.json").exists()
