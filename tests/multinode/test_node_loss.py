"""A node's loss costs only that node.

Under a rollout load on every node, every process of node3 is killed with SIGKILL (its edge and
its MooseFS client: what runs in the host's network namespace) and its link is cut, as when a
machine dies or drops off the network. Its sandboxes' own processes live on (they are in
namespaces of their own), as on a partitioned machine. Checked: the other nodes' sandboxes
answer every call throughout; new creates go to the other nodes; node3's sandboxes are
reported TERMINATED with reason EDGE_LOST (by ``get`` and on a watch stream) and their quota is
released; when the node returns, the sandboxes it still runs are stopped (the cluster told the
callers they were lost: lost is final) and it takes creates again.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter

import pytest

from libdsec import Sandbox
from libdsec.errors import DSecError, SandboxTerminated
from tests.multinode.conftest import MultiNode, restore_node

pytestmark = [pytest.mark.integration, pytest.mark.images("busybox")]

LOST = "node3"


class Rollout:
    """One thread per sandbox running a short command every 0.2 s; every failure is kept."""

    def __init__(self, sandboxes: list[Sandbox]) -> None:
        self.stop = threading.Event()
        self.calls: Counter[str] = Counter()
        self.errors: list[tuple[str, str]] = []
        self.threads = [threading.Thread(target=self._loop, args=(s,)) for s in sandboxes]

    def _loop(self, sb: Sandbox) -> None:
        n = 0
        while not self.stop.is_set() and n < 2000:  # bounded
            n += 1
            try:
                r = sb.run(f"echo {n}")
                if r.exit_code != 0 or r.stdout != f"{n}\n".encode():
                    self.errors.append((sb.id, repr(r)))
                self.calls[sb.id] += 1
            except Exception as exc:
                self.errors.append((sb.id, repr(exc)))
            self.stop.wait(0.2)

    def __enter__(self) -> Rollout:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


def _wait(what: str, check, timeout_s: float) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.25)
    return time.monotonic() - start


def test_a_lost_node_costs_only_its_own_sandboxes(multinode: MultiNode) -> None:
    m = multinode
    host = m.host(LOST)
    task = "node-loss"
    with m.client("apiserver") as c, m.client("apiserver1") as c2:
        made: list[Sandbox] = []
        try:
            for node in ("node1", "node2", "node3"):
                for _ in range(2):
                    made.append(
                        c.create(
                            image="busybox",
                            memory_mb=64,
                            cpu=0.25,
                            task_id=task,
                            node_selector={"node": node},
                        )
                    )
            by_node = {s.id: s.info.edge_id for s in made}
            assert Counter(by_node.values()) == {"node1": 2, "node2": 2, "node3": 2}
            lost_ids = {sid for sid, e in by_node.items() if e == LOST}
            kept = [s for s in made if s.id not in lost_ids]
            usage_before = c.get_project().usage
            # What the cluster can report lost is what the watcher has seen: its polls every
            # 2 s (a sandbox made within the last poll before a loss is NOT_FOUND after it).
            _wait("the watcher knows node3's sandboxes", lambda: _reported(m, LOST) >= 2, 20)

            events: list = []
            watch = c2.watch(task_id=task)
            reader = threading.Thread(target=lambda: events.extend(watch), daemon=True)
            reader.start()
            with Rollout(kept) as load:
                time.sleep(1.5)
                calls_before = sum(load.calls.values())
                killed = host.kill_all()
                host.link_down()
                t_kill = time.monotonic()
                assert killed, "nothing ran on the host"

                # New creates go elsewhere, while the watcher still counts the node healthy too.
                fresh = [
                    c.create(image="busybox", memory_mb=64, cpu=0.25, task_id=task)
                    for _ in range(3)
                ]
                made.extend(fresh)
                assert all(s.info.edge_id != LOST for s in fresh), [s.info for s in fresh]

                # The lost node's sandboxes: TERMINATED, EDGE_LOST, within the gone rule.
                def reported_lost() -> bool:
                    try:
                        infos = [c.get(sid) for sid in lost_ids]
                    except DSecError:  # not declared lost yet: its edge does not answer
                        return False
                    return all(i.info.termination_reason == "EDGE_LOST" for i in infos)

                _wait("EDGE_LOST reported", reported_lost, 60)
                lost_after = time.monotonic() - t_kill
                # Once declared lost, its sandboxes answer at once (the watcher's word), not
                # after a deadline spent on an edge whose link is down.
                one = next(iter(lost_ids))
                t = time.monotonic()
                assert c2.get(one).info.termination_reason == "EDGE_LOST"
                with pytest.raises(SandboxTerminated, match="EDGE_LOST"):
                    c2.get(one).run("true")
                assert time.monotonic() - t < 3, time.monotonic() - t
                # Their quota: released by the watcher's reconciliation of a gone edge (every
                # 5 s), the fresh sandboxes' counted.
                want = usage_before.sandboxes - len(lost_ids) + len(fresh)
                released_after = _wait(
                    "quota released", lambda: c.get_project().usage.sandboxes == want, 30
                )
                time.sleep(1.0)
                calls_during = sum(load.calls.values()) - calls_before
            watch.close()
            reader.join(timeout=10)

            # Nothing lost elsewhere: every call of the rollout on node1 and node2 succeeded.
            assert not load.errors, load.errors[:5]
            assert calls_during > 20, calls_during
            assert c.get_project().usage.sandboxes == want
            # Watch events: one EDGE_LOST termination per lost sandbox, none for the others.
            lost_events = {e.id for e in events if e.termination_reason == "EDGE_LOST"}
            assert lost_events == lost_ids, (lost_events, lost_ids)
            assert lost_after < 40, lost_after
            print(
                f"node loss -> EDGE_LOST in {lost_after:.1f} s, "
                f"quota released {released_after:.1f} s later"
            )
        finally:
            restore_node(m, LOST)

        # Back: the sandboxes it still ran are stopped (lost is final), and it takes creates.
        def stale_gone() -> bool:
            return not (lost_ids & set(_edge_sandbox_ids(m, LOST)))

        _wait("stale sandboxes stopped on the returned node", stale_gone, 60)
        for sid in lost_ids:
            assert c.get(sid).info.termination_reason == "EDGE_LOST"
        back = c.create(image="busybox", memory_mb=64, task_id=task, node_selector={"node": LOST})
        made.append(back)
        assert back.info.edge_id == LOST and back.run("echo back").stdout == b"back\n"
        for s in made:
            if s.id not in lost_ids:
                with contextlib.suppress(Exception):
                    s.stop()


def _reported(m: MultiNode, node: str) -> int:
    import grpc

    from dsec.watcher.v1 import watcher_pb2, watcher_pb2_grpc

    with grpc.insecure_channel(m.cluster.process("watcher").address) as ch:
        resp = watcher_pb2_grpc.WatcherServiceStub(ch).GetEdgeHealth(
            watcher_pb2.GetEdgeHealthRequest(edge_id=node), timeout=5
        )
    return int(resp.status.sandboxes_reported)


def _edge_sandbox_ids(m: MultiNode, node: str) -> list[str]:
    """The live sandboxes the node's edge itself lists (its own record, not the cluster's)."""
    import grpc

    from dsec.edge.v1 import edge_pb2, edge_pb2_grpc

    with grpc.insecure_channel(m.cluster.process(m.edge_of(node)).address) as ch:
        resp = edge_pb2_grpc.EdgeServiceStub(ch).ListSandboxes(
            edge_pb2.ListSandboxesRequest(), timeout=10
        )
    from dsec.types.v1 import types_pb2

    return [s.id for s in resp.sandboxes if s.state != types_pb2.SANDBOX_STATE_TERMINATED]
