"""API servers behind one virtual IP (tests/multinode/viplab.py): ECMP over every healthy
instance, a route withdrawn within seconds of a kill, a hang or a stop, and callers that lose
nothing (idempotent calls retried by the SDK, watches resumed where they broke).

Real components throughout: FRR's bgpd in every instance's host and zebra + bgpd in the
router's, the kernel's multipath route, the SDK and the CLI dialing the one address.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsecctl.cluster import service_health
from dsecctl.vip_router import frr_installed
from libdsec.errors import Unavailable
from tests.helpers import wait_for
from tests.multinode.viplab import (
    Load,
    VipLab,
    answering_instance,
    instance_of,
    vip_cluster,
    wait_withdrawn,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def v(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VipLab]:
    missing = frr_installed()
    if missing:
        pytest.fail(f"{missing} (scripts/setup.sh installs it)")
    with vip_cluster(tmp_path_factory.mktemp("vip")) as lab:
        yield lab


def restore(v: VipLab, name: str) -> None:
    """Instance ``name`` running and announcing again (after a test killed or stopped it)."""
    p = v.cluster.process(name)
    if p.proc is not None and p.proc.poll() is None:
        os.kill(p.proc.pid, signal.SIGCONT)
    else:
        v.cluster._spawn(p)
        v.cluster.wait_serving([p], 60)
    v.router.wait_next_hops(v.vip, v.addresses())


def test_the_virtual_ip_spreads_new_connections_over_every_instance(v: VipLab) -> None:
    assert set(v.router.next_hops(v.vip)) == v.addresses()
    counts: dict[str, int] = {}
    for _ in range(40):
        name = answering_instance(v.target, v.cluster.token)
        counts[name] = counts.get(name, 0) + 1
    assert set(counts) == {"apiserver", "apiserver1"}, counts
    assert min(counts.values()) >= 5, counts  # hashed per flow, not pinned to one instance


def test_the_cli_and_the_sdk_use_the_one_address(v: VipLab, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "DSEC_TARGET": v.target,
        "DSEC_TOKEN": v.cluster.token,
        "DSEC_HOME": str(tmp_path),
    }
    with v.client() as c:
        sb = c.create(image="busybox", labels={"via": "vip"})
        assert c.get(sb.id).id == sb.id
        out = subprocess.run(
            [sys.executable, "-m", "dsecctl", "sandbox", "list"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert sb.id in out.stdout, out.stdout
        sb.stop()
    who = subprocess.run(
        [sys.executable, "-m", "dsecctl", "whoami"], env=env, capture_output=True, text=True
    )
    assert who.returncode == 0 and "bootstrap-admin" in who.stdout, (who.stdout, who.stderr)


def test_kill_9_under_load_withdraws_the_route_and_loses_no_idempotent_call(v: VipLab) -> None:
    victim = v.instance_on("api1")
    with Load(v) as load:
        assert "apiserver" in load.on and "apiserver1" in load.on, load.on
        time.sleep(1.0)
        t0 = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        victim.proc.wait(10)  # type: ignore[union-attr]
        withdrawn_s = wait_withdrawn(v, victim.host.address, t0)  # type: ignore[union-attr]
        time.sleep(2.0)
        first_ok_s = load.first_ok_after(t0, "apiserver")
        # every client keeps working, the victim's too (reconnected to the survivor)
        now = time.monotonic()
        assert all(any(x > now - 1.0 for x in ts) for ts in load.ok), load.on
    print(
        f"\nkill -9: route withdrawn in {withdrawn_s:.3f} s, first call of a client of the"
        f" dead instance ok after {first_ok_s:.3f} s, failed calls {len(load.failed)}"
    )
    assert withdrawn_s < 3.0  # the agent and bgpd die with it: the session closes at once
    assert first_ok_s < 5.0
    assert load.failed == []
    restore(v, "apiserver")


def test_a_broken_watch_resumes_where_it_stopped_without_losing_a_change(v: VipLab) -> None:
    task = f"w-{uuid.uuid4().hex[:6]}"
    # A watch whose connection is on the instance that dies.
    watcher = next(c for c in (v.client() for _ in range(30)) if instance_of(c) == "apiserver1")
    # The creates (not idempotent: no key) go through the instance that stays.
    creator = next(c for c in (v.client() for _ in range(30)) if instance_of(c) == "apiserver")
    created: list[str] = []
    sandboxes = []
    try:
        w = watcher.watch(task_id=task, keepalive_interval_s=0.2)
        sandboxes.append(creator.create(image="busybox", task_id=task))
        created.append(sandboxes[0].id)
        seen = {next(iter(w)).id}
        time.sleep(0.5)
        assert w.resume_at is not None
        victim = v.cluster.process("apiserver1")
        os.kill(victim.pid, signal.SIGKILL)
        for _ in range(3):  # while the stream is broken
            sandboxes.append(creator.create(image="busybox", task_id=task))
            created.append(sandboxes[-1].id)
        with pytest.raises(Unavailable):
            for info in w:
                seen.add(info.id)
        with watcher.watch(task_id=task, since=w.resume_at, timeout=10) as resumed:
            for info in resumed:
                seen.add(info.id)
                if set(created) <= seen:
                    break
        assert set(created) <= seen, (created, seen)
    finally:
        for sb in sandboxes:
            sb.stop()
        watcher.close()
        creator.close()
        restore(v, "apiserver1")


def test_a_hung_instance_is_withdrawn_its_clients_move_and_it_comes_back(v: VipLab) -> None:
    victim = v.instance_on("api2")
    with Load(v) as load:
        assert "apiserver1" in load.on, load.on
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            withdrawn_s = wait_withdrawn(v, victim.host.address, t0)  # type: ignore[union-attr]
            # Still alive (a process that is stopped, not dead), and no new call reaches it.
            assert victim.proc.poll() is None  # type: ignore[union-attr]
            names = {answering_instance(v.target, v.cluster.token) for _ in range(12)}
            assert names == {"apiserver"}, names
            # Its clients' connections move at their next keepalive ping (the route takes it
            # to the other instance, which resets it); their calls in flight are retried.
            moved = t0 + withdrawn_s
            wait_for(lambda: all(any(x > moved for x in ts) for ts in load.ok), timeout_s=20)
            moved_s = load.first_ok_after(moved, "apiserver1")
        finally:
            os.kill(victim.pid, signal.SIGCONT)
    back_s = v.router.wait_next_hops(v.vip, v.addresses())
    print(
        f"\nSIGSTOP: withdrawn in {withdrawn_s:.2f} s, its clients ok {moved_s:.2f} s later;"
        f" back {back_s:.2f} s after SIGCONT; failed calls {len(load.failed)}"
    )
    # the agent's check: 2 failures, each a 1 s timeout, 0.25 s apart
    assert withdrawn_s < 5.0
    assert load.failed == []


def test_a_stopping_instance_withdraws_first_and_fails_no_call(v: VipLab) -> None:
    victim = v.instance_on("api1")
    with Load(v) as load:
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(victim.pid, signal.SIGTERM)
        withdrawn_s = wait_withdrawn(v, victim.host.address, t0)  # type: ignore[union-attr]
        assert victim.proc.wait(30) == 0  # type: ignore[union-attr]
        exited_s = time.monotonic() - t0
        time.sleep(1.0)
    assert withdrawn_s < exited_s, (withdrawn_s, exited_s)
    assert load.failed == []
    restore(v, "apiserver")


def test_an_added_instance_takes_traffic_without_restarting_the_others(v: VipLab) -> None:
    pids = {p.name: p.pid for p in v.instances()}
    host = v.add_host("api3")
    p = v.cluster.add_apiserver(host)
    try:
        v.router.wait_next_hops(v.vip, v.addresses())
        names = {answering_instance(v.target, v.cluster.token) for _ in range(40)}
        assert p.name in names, names
        assert {q.name: q.pid for q in v.instances() if q.name in pids} == pids
    finally:
        os.kill(p.pid, signal.SIGTERM)
        p.proc.wait(30)  # type: ignore[union-attr]
        v.cluster.processes.remove(p)
        v.cluster.apiservers -= 1
    v.router.wait_next_hops(v.vip, v.addresses())


def test_an_instance_whose_routing_daemon_cannot_start_is_not_serving_and_says_why(
    v: VipLab, tmp_path: Path
) -> None:
    host = v.lab.hosts.get("api4") or v.add_host("api4")
    empty = tmp_path / "no-frr"
    empty.mkdir()
    i = len(v.instances())
    v.cluster.hosts[f"apiserver{i}"] = host
    p = v.cluster._apiserver_process(i)
    p.env["DSEC_APISERVER_VIP_FRR_DIR"] = str(empty)
    v.cluster.processes.append(p)
    try:
        v.cluster._spawn(p)
        deadline = time.monotonic() + 30
        while "not announced" not in v.cluster.log_tail(p, 50):
            assert time.monotonic() < deadline, v.cluster.log_tail(p, 50)
            time.sleep(0.2)
        assert service_health(p) == "NOT_SERVING"
        # Its gRPC server runs (so an operator can ask it), but it never announces.
        assert host.address not in v.router.next_hops(v.vip)
        tail = v.cluster.log_tail(p, 50)
        assert "routing daemon cannot start" in tail and str(empty / "bgpd") in tail, tail
        # `dsec status` names the reason.
        v.cluster.write_state()
        out = subprocess.run(
            [sys.executable, "-m", "dsecctl", "status"],
            env={**os.environ, "DSEC_HOME": str(v.cluster.home)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "NOT_SERVING" in out.stdout and "routing daemon cannot start" in out.stdout, (
            out.stdout
        )
    finally:
        if p.proc is not None and p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(10)
        v.cluster.processes.remove(p)
        v.cluster.write_state()
