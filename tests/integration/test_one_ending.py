"""One ending per sandbox, whatever races to end it (issue 31).

Measured before the fix: a sandbox whose writable layer filled (DISK_QUOTA) while its owner
stopped it was torn down twice and released twice; the edge's live count went below zero,
every GetNodeStatus failed ("Value out of range: -1") and the node refused every create. Here a
few hundred real runc sandboxes are ended by everything at once — owner stops, task stops, TTL
expiry, containment (a full writable layer, a full process table, blocked connects), and a
SIGKILL of the edge in the middle — and each must end exactly once, with one reason, the
node's counts back at zero and no accounting error.
"""

from __future__ import annotations

import random
import re
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from dsec.edge.v1 import edge_pb2, edge_pb2_grpc
from dsecctl.cluster import LocalCluster
from libdsec import Client, NetworkPolicy, Sandbox
from libdsec.errors import DSecError
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith

pytestmark = pytest.mark.images("busybox")
EDGE = "oneend"
PER_GROUP = 40
#: What may end each group: the race's two sides (a SIGKILLed edge may lose one in flight).
GROUPS: dict[str, set[str]] = {
    "stop": {"STOPPED"},
    "task": {"STOPPED", "PREEMPTED"},
    "ttl": {"TTL", "STOPPED"},
    "disk": {"DISK_QUOTA", "STOPPED"},
    "pids": {"PIDS_EXHAUSTED", "STOPPED"},
    "net": {"POLICY_VIOLATION", "STOPPED"},
}
LOST = {"RUNTIME_ERROR", "CHANNEL_CLOSED"}  # "lost while the edge was down", a cut channel


@pytest.fixture(scope="module")
def cluster(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """A cluster of the module's own: its tests count the node's sandboxes and kill its edge."""
    with cluster_with(EDGE) as c:
        yield c


def node_status(cluster: LocalCluster) -> edge_pb2.GetNodeStatusResponse:
    with grpc.insecure_channel(cluster.process(f"edge-{EDGE}").address) as ch:
        return edge_pb2_grpc.EdgeServiceStub(ch).GetNodeStatus(
            edge_pb2.GetNodeStatusRequest(include_sandbox_ids=True), timeout=5
        )


def _create(client: Client, group: str, task: str) -> list[Sandbox]:
    opts: dict[str, object] = {"image": "busybox", "cpu": 0.05, "memory_mb": 64}
    if group == "ttl":
        opts["ttl_s"] = 6
    if group == "disk":
        opts["disk_mb"] = 16
    if group == "pids":
        opts["pids_max"] = 24
    if group == "net":
        opts["network"] = NetworkPolicy(allow=["10.255.255.1:80"], max_blocked_connects=2)
    made = client.create_many(PER_GROUP, task_id=f"{task}-{group}", **opts)  # type: ignore[arg-type]
    sandboxes = [s for s in made if isinstance(s, Sandbox)]
    assert len(sandboxes) == PER_GROUP, [e for e in made if not isinstance(e, Sandbox)][:3]
    return sandboxes


def _provoke(sb: Sandbox, group: str) -> None:
    """Start what makes containment end the sandbox (in the background: it may end first)."""
    cmd = {
        "disk": "dd if=/dev/zero of=/work/fill bs=1M count=64",
        "pids": "while :; do sleep 600 & done",
        "net": "while :; do nc -w 1 10.9.9.9 80 </dev/null; sleep 0.2; done",
    }.get(group)
    if cmd:
        try:
            sb.start(cmd)
        except DSecError:
            pass  # already ending: fine, that is the race


def _stop(sb: Sandbox, after_s: float = 0.0) -> None:
    time.sleep(after_s)
    try:
        sb.stop(grace_s=0.2)
    except DSecError:
        pass  # ended meanwhile, or the edge is restarting: the ending is checked below


def test_every_sandbox_ends_once_whatever_races_to_end_it(cluster: LocalCluster) -> None:
    task = f"race-{uuid.uuid4().hex[:6]}"
    with Client(cluster.apiserver, token=cluster.token, timeout=60) as client:
        made = {g: _create(client, g, task) for g in GROUPS}
        by_id = {sb.id: g for g, sbs in made.items() for sb in sbs}
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=200) as pool:
            for g in ("disk", "pids", "net"):
                list(pool.map(lambda sb, g=g: _provoke(sb, g), made[g]))
            # The races: the owners' stops land spread over the seconds in which containment
            # (a filled disk, 3 s at the pids limit, 2 blocked connects) and TTL (6 s) end theirs.
            rng = random.Random(task)
            stops = [
                pool.submit(_stop, sb, max(0.0, start + rng.uniform(2.0, 8.0) - time.monotonic()))
                for g in ("stop", "ttl", "disk", "pids", "net")
                for sb in made[g]
            ]
            time.sleep(max(0.0, start + 5.0 - time.monotonic()))
            task_stop = threading.Thread(
                target=lambda: client.stop_task(f"{task}-task", preempted=True), daemon=True
            )
            task_stop.start()
            for sb in made["task"][: PER_GROUP // 2]:
                stops.append(pool.submit(_stop, sb))
            # ... and the edge dies in the middle of it all, and comes back.
            time.sleep(1.0)
            edge = f"edge-{EDGE}"
            cluster.kill(edge, signal.SIGKILL)
            cluster.restart(edge)
            for f in stops:
                f.result()
            task_stop.join(timeout=120)

        # Whatever was left running after the restart (its stop hit the dead edge) is stopped.
        def all_ended() -> bool:
            live = [s for s in client.list() if s.id in by_id and not s.terminated]
            for s in live:
                _stop(client.get(s.id))
            return not live

        wait_for(all_ended, timeout_s=180, interval_s=1.0)
        infos = {s.id: s for s in client.list() if s.id in by_id}

    assert set(infos) == set(by_id)
    for sid, info in infos.items():
        allowed = GROUPS[by_id[sid]] | LOST
        assert info.termination_reason in allowed, (by_id[sid], sid, info.termination_reason)

    # Each ended once: one "terminated" line per sandbox across both edge processes' logs.
    log = cluster.process(f"edge-{EDGE}").log_path.read_text(errors="replace")
    ended = Counter(re.findall(r"sandbox (sb-[a-z0-9-]+) terminated: ", log))
    twice = {sid: n for sid, n in ended.items() if n > 1}
    assert not twice, f"ended more than once: {twice}"
    assert ended.keys() <= set(by_id)
    # The contained groups were really contained by containment in part (the race had sides).
    reasons = Counter(i.termination_reason for i in infos.values())
    assert reasons["DISK_QUOTA"] + reasons["PIDS_EXHAUSTED"] + reasons["POLICY_VIOLATION"] > 0, (
        reasons
    )
    assert reasons["STOPPED"] > 0, reasons

    # The node's accounting is whole: nothing live, nothing held, no release refused.
    st = wait_for(lambda: (s := node_status(cluster)).load.sandboxes == 0 and s, timeout_s=30)
    assert st.load.cpu_millis_allocated == 0 and st.load.memory_mb_allocated == 0, st.load
    assert not st.live_sandbox_ids and not st.sandboxes_by_task and not st.sandboxes_by_project
    assert all(v == 0 for v in st.load.sandboxes_by_backend.values()), st.load
    assert st.accounting_errors == 0
    # ... and it takes creates again.
    with Client(cluster.apiserver, token=cluster.token) as client:
        sb = wait_for(lambda: _try_create(client), timeout_s=30)
        assert sb.run("echo fine").text == "fine\n"
        sb.stop()


def _try_create(client: Client) -> Sandbox | None:
    try:
        return client.create(image="busybox", memory_mb=64)
    except DSecError:
        return None
