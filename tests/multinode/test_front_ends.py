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
