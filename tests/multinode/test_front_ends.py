"""The compatibility front ends against a multi-node cluster, unchanged: the stock e2b SDK
(pointed at the front end by its three variables) and SandboxFusion's run_code (the FnCall
pools of node2, reached from the front end on another host)."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from tests.integration.e2b_support import E2bTarget, e2b_environment
from tests.multinode.conftest import MultiNode

pytestmark = [pytest.mark.integration, pytest.mark.images("busybox", "python")]


def test_the_e2b_sdk_runs_unchanged_on_the_cluster(multinode: MultiNode) -> None:
    from e2b import Sandbox

    c = multinode.cluster
    with multinode.client() as admin:
        key = admin.create_token("e2b-multinode", agent=True).secret
    with e2b_environment(E2bTarget(c, c.compat_url, key)):
        sb = Sandbox.create(template="python", timeout=300)
        try:
            r = sb.commands.run("echo from-$(cat /proc/sys/kernel/ostype)")
            assert r.exit_code == 0 and r.stdout == "from-Linux\n", r
            sb.files.write("/tmp/a.txt", "written through the front end")
            assert sb.files.read("/tmp/a.txt") == "written through the front end"
            with multinode.client() as dsec:
                assert dsec.get(sb.sandbox_id).info.edge_id in multinode.nodes
        finally:
            sb.kill()


def test_sandbox_fusion_run_code_reaches_the_pools_of_another_node(multinode: MultiNode) -> None:
    with multinode.client() as admin:
        token = admin.create_token("fusion-multinode", agent=True).secret
    url = f"{multinode.cluster.sandbox_fusion_url}/t/{token}/run_code"
    body = {"code": "print(sum(range(10)))", "language": "python", "run_timeout": 30}
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    assert out["status"] == "Success", out
    assert out["run_result"]["stdout"] == "45\n", out
    assert os.environ.get("E2B_API_URL") is None  # the e2b test restored the environment


def test_the_front_ends_share_one_virtual_ip_and_a_killed_one_is_routed_around(
    multinode: MultiNode,
) -> None:
    from e2b import Sandbox

    c = multinode.cluster
    assert c.compat_vip is not None and c.compat_vip.address in c.compat_url
    assert c.compat_vip.address in c.sandbox_fusion_url
    hops = {c.process(n).host.address for n in ("compat", "compat1")}  # type: ignore[union-attr]
    assert set(multinode.router.next_hops(c.compat_vip.address)) == hops
    with multinode.client() as admin:
        key = admin.create_token("e2b-vip", agent=True).secret
    victim = c.process("compat1")
    victim.proc.kill()  # type: ignore[union-attr]
    victim.proc.wait(10)  # type: ignore[union-attr]
    try:
        multinode.router.wait_next_hops(c.compat_vip.address, hops - {victim.host.address}, 5)  # type: ignore[union-attr]
        with e2b_environment(E2bTarget(c, c.compat_url, key)):
            sb = Sandbox.create(template="python", timeout=120)
            try:
                assert sb.commands.run("echo ok").stdout == "ok\n"
            finally:
                sb.kill()
    finally:
        c._spawn(victim)
        c.wait_serving([victim], 60)
        multinode.router.wait_next_hops(c.compat_vip.address, hops, 30)
