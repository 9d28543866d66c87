"""Pause that gives memory back, against real runc sandboxes (issue: RL preemption and density).

The edge's swap area is a real swap file (1 GiB per test edge, removed when the edge stops);
a pause freezes the sandbox and pushes its memory out with process_madvise(MADV_PAGEOUT) and
memory.force_empty; the numbers asserted are read from the sandbox's memory cgroup by the edge
and from /proc by the test.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from dsec.edge.v1 import edge_pb2, edge_pb2_grpc
from dsecctl.cluster import LocalCluster
from libdsec import Client, Sandbox
from libdsec.errors import FailedPrecondition, NodeMemoryFull, ResourceExhausted
from tests.helpers import dsec_status, sandbox_factory, wait_for
from tests.integration.conftest import ClusterWith, container_edge

pytestmark = pytest.mark.images("busybox", "bookworm")
MiB = 1 << 20
#: Node memory offered for admission: three sandboxes of 512 MiB do not fit, two do.
NODE_MEMORY_MB = 1280

# Holds 200 MiB of random bytes; writes their digest at start (/work/sha0) and again each time
# /work/ask appears (/work/sha1): the same digest after a pause means every page came back.
HOLD = """
import hashlib, os, time
data = bytearray(os.urandom(200 << 20))
open("/work/sha0.tmp", "w").write(hashlib.sha256(data).hexdigest())
os.rename("/work/sha0.tmp", "/work/sha0")
while True:
    if os.path.exists("/work/ask"):
        os.remove("/work/ask")
        open("/work/sha1.tmp", "w").write(hashlib.sha256(data).hexdigest())
        os.rename("/work/sha1.tmp", "/work/sha1")
    time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def container_cluster(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """A cluster of the module's own: a small node (tests fill it and read its figures), a
    restart of its edge."""
    edge = container_edge("pr0", {"DSEC_EDGE_MEMORY_OVERCOMMIT": "1"}, memory_mb=NODE_MEMORY_MB)
    with cluster_with("pr0", edges=[edge]) as c:
        try:
            yield c
        finally:
            with Client(c.apiserver, token=c.token) as client:
                for s in client.list():
                    if not s.terminated:
                        client.get(s.id).stop(grace_s=0)


@pytest.fixture
def make_sandbox(
    container_cluster: LocalCluster, client: Client, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Sandbox]]:
    """The suite's factory (512 MB sandboxes), then a wait for the node to be empty."""
    with sandbox_factory(client, request.node.nodeid, memory_mb=512, grace_s=0.2) as make:
        yield make
    # The node is small (tests fill it): the next test starts once placement's view of the
    # edge (the watcher probes every 0.5 s) has this test's sandboxes gone.
    wait_for(lambda: node_status(container_cluster).load.sandboxes == 0, 15)
    time.sleep(1.2)


def node_status(cluster: LocalCluster) -> edge_pb2.GetNodeStatusResponse:
    with grpc.insecure_channel(cluster.process("edge-pr0").address) as ch:
        return edge_pb2_grpc.EdgeServiceStub(ch).GetNodeStatus(
            edge_pb2.GetNodeStatusRequest(), timeout=5
        )


def holding(sb: Sandbox) -> str:
    """Starts the 200 MiB holder in `sb`; returns the digest of its memory."""
    sb.files.write("/work/hold.py", HOLD)
    sb.start("python3 /work/hold.py")
    sha = wait_for(lambda: sb.files.exists("/work/sha0") and sb.files.read("/work/sha0"), 30)
    return bytes(sha).decode()


def digest_now(sb: Sandbox) -> str:
    """Asks the holder for its memory's digest again (a call that resumes a paused sandbox)."""
    sb.run("rm -f /work/sha1 && touch /work/ask")
    sha = wait_for(lambda: sb.files.exists("/work/sha1") and sb.files.read("/work/sha1"), 30)
    return bytes(sha).decode()


def test_pause_pages_the_memory_out_and_resume_brings_every_page_back(
    container_cluster: LocalCluster, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox(image="bookworm")
    sha = holding(sb)
    before = sb.refresh().memory
    assert before is not None and before.resident_bytes > 200 * MiB, before
    load0 = node_status(container_cluster).load.memory_mb_allocated

    paused = sb.pause()
    assert paused.state == "PAUSED"
    m = sb.refresh().memory
    assert m is not None and not m.frozen_only, m
    # >= 90% of the sandbox's memory left RAM; the 200 MiB are in the edge's swap area.
    assert m.resident_bytes <= 0.1 * before.resident_bytes, (before, m)
    assert m.swapped_bytes >= 190 * MiB, m
    assert m.freed_bytes >= 0.9 * before.resident_bytes, m
    assert m.released_mb >= 512 - (m.resident_bytes // MiB) - 1, m
    st = node_status(container_cluster)
    assert st.pause.paused == 1 and st.pause.released_mb == m.released_mb
    assert st.pause.swapped_bytes == m.swapped_bytes
    # (swap_used_bytes is the area's use by anyone: another edge of this machine's area may
    # hold these pages, the kernel picks the highest-priority one.)
    assert 1023 * MiB < st.pause.swap_size_bytes <= 1024 * MiB
    assert st.load.memory_mb_allocated == load0 - m.released_mb  # admission knows
    assert any(c.name == "pause_reclaim" and c.state == "enforced" for c in st.controls)

    assert digest_now(sb) == sha  # transparently resumed: every byte is back
    assert sb.refresh().state == "RUNNING"
    assert node_status(container_cluster).load.memory_mb_allocated == load0
    assert "pause: 0 paused" in dsec_status(container_cluster.home)


def test_twenty_pause_cycles_lose_nothing(make_sandbox: Callable[..., Sandbox]) -> None:
    """Files, a background counter, an in-sandbox HTTP server and a shell session survive 20
    pause/resume cycles; each cycle is resumed by a different kind of call."""
    sb = make_sandbox(image="bookworm")
    sb.run("mkdir -p /work/www && echo hello > /work/www/index.html")
    ticker = sb.start("i=0; while true; do i=$((i+1)); echo $i > /work/ticks; sleep 0.05; done")
    server = sb.start("cd /work/www && exec python3 -m http.server 8000")
    wait_for(lambda: _http_ok(sb), 20)
    session = sb.session(cwd="/work")
    session.run("export ROUND=start")
    kinds = ["exec", "files", "http", "session", "stream", "resume"]
    for i in range(20):
        assert sb.pause().state == "PAUSED"
        assert sb.refresh().state == "PAUSED"  # a get does not resume
        kind = kinds[i % len(kinds)]
        if kind == "exec":
            assert sb.run(f"echo {i} >> /work/log.exec").exit_code == 0
        elif kind == "files":
            sb.files.write(f"/work/f{i}", str(i))
        elif kind == "http":
            assert sb.http(8000, "/index.html").body == b"hello\n"
        elif kind == "session":
            assert session.run(f"echo $ROUND {i} >> log.session && pwd").text == "/work\n"
        elif kind == "stream":
            out = b"".join(getattr(e, "data", b"") for e in sb.stream(f"echo {i}; cat /work/ticks"))
            assert out.startswith(f"{i}\n".encode()), out
        else:
            assert sb.resume().state == "RUNNING"
        assert sb.refresh().state == "RUNNING", (i, kind)
    assert sb.files.read("/work/log.exec").decode().split() == [str(i) for i in range(0, 20, 6)]
    assert [sb.files.read(f"/work/f{i}").decode() for i in range(1, 20, 6)] == [
        str(i) for i in range(1, 20, 6)
    ]
    assert sb.files.read("/work/log.session").decode().splitlines() == [
        f"start {i}" for i in range(3, 20, 6)
    ]
    t1 = int(sb.files.read("/work/ticks").decode())
    time.sleep(0.3)
    assert int(sb.files.read("/work/ticks").decode()) > t1  # the counter still counts
    assert ticker.wait(timeout_s=0.1).running and server.wait(timeout_s=0.1).running
    assert _http_ok(sb)


def test_a_paged_out_sandbox_makes_room_and_a_resume_that_does_not_fit_waits(
    client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    a = make_sandbox(image="busybox", cpu=0.1)
    make_sandbox(image="busybox", cpu=0.1)
    with pytest.raises(ResourceExhausted):  # 3 x 512 MiB > the node's 1280
        make_sandbox(image="busybox", cpu=0.1)
    a.files.write("/work/kept", "kept")
    a.pause()
    assert (a.refresh().memory or pytest.fail("no memory")).released_mb > 400
    # The paused one made room (once placement's view of the edge, polled every 0.5 s, has it).
    c = wait_for(lambda: _create(make_sandbox), 10)
    assert c.run("echo in").text == "in\n"
    with pytest.raises(NodeMemoryFull) as info:
        a.resume()
    assert info.value.code.name == "RESOURCE_EXHAUSTED" and "stays PAUSED" in str(info.value)
    with pytest.raises(NodeMemoryFull):
        a.run("true")  # a call resumes first: refused the same way, nothing is lost
    assert a.refresh().state == "PAUSED"
    c.stop()
    assert a.run("cat /work/kept").text == "kept"


def test_ttl_counts_while_paused_and_the_idle_timeout_does_not(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox(image="busybox", ttl_s=10, idle_timeout_s=2)
    sb.pause()
    time.sleep(3.5)  # past the idle timeout: a paused sandbox is not idle
    assert sb.refresh().state == "PAUSED"
    end = wait_for(lambda: (i := sb.refresh()).terminated and i, 15)
    assert end.termination_reason == "TTL"


def test_a_paused_sandbox_stops_normally_and_its_swap_is_freed(
    container_cluster: LocalCluster, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox(image="bookworm")
    holding(sb)
    swap0 = _host_swap_used()
    sb.pause()
    assert node_status(container_cluster).pause.swapped_bytes >= 190 * MiB
    end = sb.stop(grace_s=1)
    assert end.state == "TERMINATED" and end.termination_reason == "STOPPED"
    st = node_status(container_cluster).pause
    assert st.paused == 0 and st.swapped_bytes == 0
    # The host's swap (all areas) has its pages back (others on this machine may swap too).
    assert _host_swap_used() - swap0 < 64 * MiB
    with pytest.raises(FailedPrecondition):
        sb.pause()  # not running any more: a precondition, naming its state


def test_a_paused_sandbox_survives_an_edge_crash_paged_out(
    container_cluster: LocalCluster, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox(image="bookworm")
    sha = holding(sb)
    sb.pause()
    container_cluster.kill("edge-pr0")
    container_cluster.restart("edge-pr0")
    info = wait_for(lambda: _get(sb), 30)
    assert info.state == "PAUSED"
    m = sb.refresh().memory
    assert m is not None and m.swapped_bytes >= 190 * MiB, m  # re-adopted, still paged out
    assert digest_now(sb) == sha


def _host_swap_used() -> int:
    rows = Path("/proc/swaps").read_text().splitlines()[1:]
    return sum(int(r.split()[3]) for r in rows) * 1024


def _create(make_sandbox: Callable[..., Sandbox]) -> Sandbox | None:
    try:
        return make_sandbox(image="busybox", cpu=0.1)
    except ResourceExhausted:
        return None


def _get(sb: Sandbox) -> object:
    try:
        return sb.refresh()
    except Exception:
        return None


def _http_ok(sb: Sandbox) -> bool:
    try:
        return sb.http(8000, "/index.html", timeout_s=2).status == 200
    except Exception:
        return False


def test_without_room_for_a_swap_area_the_edge_says_so_and_pause_only_freezes(
    tmp_path: Path, cluster_with: ClusterWith
) -> None:
    """A swap area larger than the disk's free space minus the reserve is refused at start:
    the edge reports why and pauses by freezing only, saying so on each paused sandbox."""
    free_mb = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize >> 20
    env = {"DSEC_EDGE_PAUSE_SWAP_MB": str(free_mb + 1024)}
    with cluster_with("nosw", edge_env=env) as c:
        assert "freeze only (no room for a" in dsec_status(c.home)
        assert not (c.home / "edges" / "nosw" / "swap" / "pause.swap").exists()
        with Client(c.apiserver, token=c.token) as client:
            with client.create(image="busybox", cpu=0.1, memory_mb=128) as sb:
                sb.files.write("/work/kept", "kept")
                sb.pause()
                m = sb.refresh().memory
                assert m is not None and m.frozen_only.startswith("no room for a"), m
                assert m.released_mb == 0 and m.swapped_bytes == 0
                assert sb.files.read("/work/kept") == b"kept"  # resumed, nothing lost
