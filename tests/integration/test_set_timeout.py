"""Changing a live sandbox's lifetime (SandboxService/SetSandboxTimeout) end to end, with real
container sandboxes: shortened, extended, validated, owner-checked, kept across an edge
restart."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dsecctl.cluster import LocalCluster
from libdsec import Client, Sandbox
from libdsec.aio import AsyncSandbox
from libdsec.errors import InvalidArgument, SandboxNotFound, SandboxTerminated
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith

pytestmark = pytest.mark.images("busybox")
MAX_TTL_S = 7 * 24 * 3600  # apiserver's default max_ttl_s


@pytest.fixture(scope="module")
def container_cluster(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """A cluster of the module's own: a test kills and restarts its edge."""
    with cluster_with("ttl0") as c:
        yield c


@pytest.fixture
def sandbox_defaults() -> dict[str, Any]:
    return {"memory_mb": 128, "grace_s": 0.5}


def test_a_long_ttl_cut_to_two_seconds_ends_with_the_ttl_reason(
    client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox(ttl_s=3600)
    before = time.time()
    info = sb.set_timeout(2)
    assert info.state == "RUNNING" and info.expires_at is not None
    assert before + 1.5 <= info.expires_at.timestamp() <= time.time() + 2.5
    ended = wait_for(lambda: (i := client.get(sb.id).info).terminated and i, timeout_s=15)
    assert ended.termination_reason == "TTL"
    assert time.time() < before + 8  # at the new deadline (+ the reaper's second), not in an hour


def test_an_extended_sandbox_outlives_its_original_ttl(
    client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox(ttl_s=3)
    info = sb.set_timeout(60)
    assert info.expires_at is not None and info.expires_at.timestamp() > time.time() + 50
    time.sleep(5)  # past the original TTL (the reaper runs every second)
    assert client.get(sb.id).info.state == "RUNNING"
    assert sb.run("echo alive").text == "alive\n"


def test_bad_timeouts_name_the_field(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox()
    for bad in (0, -1, MAX_TTL_S + 1, float("nan")):
        with pytest.raises(InvalidArgument) as exc:
            sb.set_timeout(bad)
        assert exc.value.reason == "INVALID_TTL"
        assert exc.value.metadata.get("field") == "timeout_s"
        assert "timeout_s" in str(exc.value)
    assert sb.set_timeout(MAX_TTL_S).state == "RUNNING"  # the maximum itself is accepted


def test_an_ended_sandbox_is_a_precondition(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox()
    sb.stop(grace_s=0.2)
    with pytest.raises(SandboxTerminated) as exc:
        sb.set_timeout(60)
    assert exc.value.reason == "SANDBOX_TERMINATED"


def test_another_projects_sandbox_is_not_found(
    container_cluster: LocalCluster, client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox(ttl_s=600)
    project = client.create_project("ttl-other")
    token = client.create_token("ttl-other-agent", project=project.project_id, agent=True)
    with Client(container_cluster.apiserver, token=token.secret) as other:
        theirs = Sandbox(other, AsyncSandbox(other._async, sb.info))
        with pytest.raises(SandboxNotFound):
            theirs.set_timeout(1)
    assert client.get(sb.id).info.expires_at == sb.info.expires_at  # unchanged


def test_the_new_deadline_survives_an_edge_restart(
    container_cluster: LocalCluster, client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox(ttl_s=3600)
    deadline = sb.set_timeout(12).expires_at
    container_cluster.kill("edge-ttl0", signal.SIGKILL)
    container_cluster.restart("edge-ttl0")
    info = wait_for(lambda: (i := client.get(sb.id).info).state == "RUNNING" and i, timeout_s=30)
    assert info.expires_at == deadline
    ended = wait_for(lambda: (i := client.get(sb.id).info).terminated and i, timeout_s=30)
    assert ended.termination_reason == "TTL"
