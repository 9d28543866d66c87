"""A sandbox paused at its TTL instead of ended (SandboxSpec.pause_at_ttl, E2B's autoPause), on
a real container edge: paused with its files and memory kept, brought back by its next call
with a fresh TTL, paused again, and ended TTL once left paused past the edge's keep period;
through the dsec SDK and through the stock e2b SDK's lifecycle={"on_timeout": "pause"}."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import pytest

from libdsec import Client, SandboxInfo
from tests.integration.conftest import ClusterWith, container_edge
from tests.integration.e2b_support import E2bTarget, e2b_cluster, e2b_environment

pytestmark = pytest.mark.images("busybox", "e2b-base")

KEEP_S = 8


@pytest.fixture(scope="module")
def target(cluster_with: ClusterWith) -> Iterator[E2bTarget]:
    edge = container_edge("pt0", {"DSEC_EDGE_PAUSED_AT_TTL_KEEP_S": str(KEEP_S)})
    with e2b_cluster(cluster_with, "pausettl", edge) as target, e2b_environment(target):
        yield target


@pytest.fixture(scope="module")
def container_cluster(target: E2bTarget):  # type: ignore[no-untyped-def]
    """(So a failing test prints the services' log tails: see tests/conftest.py.)"""
    return target.cluster


def _until(get: Callable[[], SandboxInfo], state: str, within_s: float) -> SandboxInfo:
    deadline = time.monotonic() + within_s
    info = get()
    while info.state != state and time.monotonic() < deadline:
        time.sleep(0.25)
        info = get()
    assert info.state == state, info
    return info


def test_paused_at_its_ttl_resumed_by_a_call_then_ended_past_the_keep_period(
    target: E2bTarget, container_cluster: object
) -> None:
    with Client(target.cluster.apiserver, token=target.key) as c:
        sb = c.create(image="busybox", ttl_s=3, pause_at_ttl=True)
        try:
            sb.files.write("/root/state.txt", "kept")
            sb.start("sleep 600")  # a process, to see it come back too
            info = _until(lambda: c.get(sb.id).info, "PAUSED", 15)
            assert info.termination_reason is None and info.expires_at is not None
            assert info.expires_at.timestamp() > time.time() + KEEP_S - 4  # the keep period
            # Its next call resumes it, everything kept, with a fresh TTL from then.
            assert sb.run("cat /root/state.txt; ps | grep -c '[s]leep 600'").text == "kept1\n"
            info = c.get(sb.id).info
            assert info.state == "RUNNING" and info.expires_at is not None
            resumed = datetime.now(UTC).timestamp()
            assert resumed + 1 < info.expires_at.timestamp() <= resumed + 3.5
            # Paused again at that TTL; then, left paused, ended TTL after the keep period.
            _until(lambda: c.get(sb.id).info, "PAUSED", 15)
            ended = _until(lambda: c.get(sb.id).info, "TERMINATED", KEEP_S + 15)
            assert ended.termination_reason == "TTL"
            assert f"not resumed within {KEEP_S} s" in ended.termination_message
        finally:
            sb.stop()


def test_e2bs_on_timeout_pause_pauses_and_a_command_resumes(
    target: E2bTarget, container_cluster: object
) -> None:
    from e2b import Sandbox

    sb = Sandbox.create(
        template="base", timeout=3, lifecycle={"on_timeout": "pause"}, metadata={"t": "ttl"}
    )
    try:
        sb.files.write("note.txt", "before the pause")
        deadline = time.monotonic() + 15
        while sb.get_info().state.value != "paused" and time.monotonic() < deadline:
            time.sleep(0.25)
        assert sb.get_info().state.value == "paused"
        assert sb.commands.run("cat note.txt").stdout == "before the pause"
        assert sb.get_info().state.value == "running"
    finally:
        sb.kill()
