"""The local cluster under its supervisor, through the real `dsec` CLI: `dsec up` starts every
service under supervisord; a killed service comes back by itself and its restarts are counted
in `dsec status`; `dsec up` on a partly running cluster starts only what is down; `dsec restart`
restarts services without stopping sandboxes (an edge re-adopts them, background commands go
on); a service that cannot start is given up after a bound and `dsec status` shows why;
`dsec down --keep-sandboxes` leaves sandboxes for the next `dsec up`; `dsec down` ends them.

One cluster for the module (its own DSEC_HOME and a free port range), stopped in any case.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsecctl.cluster import LocalCluster
from dsecctl.supervisor import START_RETRIES
from libdsec import Client
from libdsec.errors import DSecError
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(600)

SERVICES = ["iam", "watcher", "placement", "edge-edge0", "apiserver", "compat"]


@dataclass
class Up:
    home: Path
    env: dict[str, str]

    def dsec(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "dsecctl", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def cluster(self) -> LocalCluster:
        c = LocalCluster.from_state(self.home)
        assert c is not None
        return c

    def pids(self) -> dict[str, int]:
        return {n: i.pid for n, i in self.cluster().supervised_processes().items()}

    def client(self) -> Client:
        state = json.loads((self.home / "cluster.json").read_text())
        return Client(state["apiserver"], token=(self.home / "token").read_text().strip())

    def cluster_processes_alive(self) -> list[int]:
        """PIDs of processes started for this cluster (supervisord, services): they all
        carry its DSEC_HOME."""
        mark = f"DSEC_HOME={self.home}\0".encode()
        found = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) != os.getpid():
                try:
                    if mark in (d / "environ").read_bytes():
                        found.append(int(d.name))
                except OSError:
                    pass
        return found

    def runc_ids(self) -> str:
        root = self.home / "edges" / "edge0" / "container" / "runtime" / "runc"
        if not root.exists():
            return ""
        out = subprocess.run(["runc", "--root", str(root), "list", "-q"], capture_output=True)
        return out.stdout.decode()


def _free_port_base(span: int = 32) -> int:
    """A base port with ``span`` free ports after it."""
    for base in range(27100, 60000, 97):
        try:
            socks = []
            for port in range(base, base + span):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    home = tmp_path_factory.mktemp("supervised")
    env = {
        **os.environ,
        "DSEC_HOME": str(home),
        "DSEC_EDGE_WARM_POOL": "",
        "DSEC_EDGE_FNCALL_POOLS": "",
        "DSEC_EDGE_PAUSE_SWAP_MB": "256",
    }
    u = Up(home, env)
    port_base = str(_free_port_base())
    try:
        out = u.dsec("up", "--port-base", port_base)
        assert out.returncode == 0, out.stdout + out.stderr
        yield u
    finally:
        out = u.dsec("down")
        c = LocalCluster.from_state(home)
        if c is not None:  # `dsec down` failed: stop it from here
            c.stop()
        # a test that failed between `down --keep-sandboxes` and `up` left containers alone
        root = home / "edges" / "edge0" / "container" / "runtime" / "runc"
        for sandbox_id in u.runc_ids().split():
            subprocess.run(["runc", "--root", str(root), "delete", "--force", sandbox_id])
        LocalCluster(home).release_mounts()
        LocalCluster(home).release_swaps()
        assert str(home) not in Path("/proc/self/mountinfo").read_text()


def _running(c: Client, sandbox_id: str) -> bool:
    try:
        sb = c.get(sandbox_id)
        return sb.info.state == "RUNNING" and sb.run("true").exit_code == 0
    except DSecError:
        return False


def _serving(u: Up, name: str) -> bool:
    return u.cluster().status()[name] == "SERVING"


def test_up_runs_every_service_supervised(up: Up) -> None:
    out = up.dsec("status")
    assert out.returncode == 0, out.stdout + out.stderr
    for name in SERVICES:
        line = next(line for line in out.stdout.splitlines() if line.startswith(name + " "))
        assert "SERVING" in line and "restarts 0" in line, line
    # `dsec up` again: nothing to do, nothing touched
    before = up.pids()
    again = up.dsec("up")
    assert again.returncode == 0 and "already running" in again.stdout, again.stdout
    assert up.pids() == before


@pytest.mark.parametrize("service", ["apiserver", "iam"])
def test_a_killed_service_comes_back_by_itself_and_is_counted(up: Up, service: str) -> None:
    with up.client() as c:
        sb = c.create(image="busybox", cpu=0.2, memory_mb=64)
        try:
            old = up.pids()[service]
            os.kill(old, signal.SIGKILL)
            wait_for(lambda: up.pids()[service] not in (0, old), timeout_s=30)
            wait_for(lambda: _serving(up, service), timeout_s=60)
            out = up.dsec("status")
            line = next(x for x in out.stdout.splitlines() if x.startswith(service + " "))
            assert "restarts 1" in line, line
            _no_stale_pid(up, service, old)
            # the sandbox is untouched and works through the restarted tier
            wait_for(lambda: _running(c, sb.id), timeout_s=30)
        finally:
            sb.stop()


def _no_stale_pid(up: Up, service: str, old: int) -> None:
    """After supervisord restarted ``service`` (once ``old``): cluster.json names no PID (a
    recorded one goes stale at a restart and may come to name an unrelated process), and
    `dsec status --json` reports every service's live PID, the restarted one's new PID."""
    state = json.loads((up.home / "cluster.json").read_text())
    assert all("pid" not in s for s in state["services"].values()), state
    assert '"pid"' not in (up.home / "cluster.json").read_text()
    out = up.dsec("status", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    reported = {  # the cluster's own (host daemons it only checks are flagged "checked")
        row["name"]: row["pid"]
        for row in json.loads(out.stdout)["services"]
        if not row.get("checked")
    }
    live = up.pids()
    assert reported == live and set(reported) == set(SERVICES), (reported, live)
    assert live[service] not in (0, old)
    for name, pid in reported.items():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[1:3] == [b"-m", name.split("-")[0].encode()], (name, cmdline)


def test_up_on_a_partly_running_cluster_starts_only_what_is_down(up: Up) -> None:
    up.cluster().supervisor.stop_process("placement")
    before = up.pids()
    assert before["placement"] == 0
    out = up.dsec("up")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "starting placement (the rest is running)" in out.stdout, out.stdout
    after = up.pids()
    assert after["placement"] != 0
    assert {n: p for n, p in after.items() if n != "placement"} == {
        n: p for n, p in before.items() if n != "placement"
    }


def test_restart_keeps_sandboxes_and_background_commands(up: Up) -> None:
    with up.client() as c:
        sb = c.create(image="busybox", cpu=0.2, memory_mb=64)
        try:
            sb.files.write("/work/kept.txt", "before")
            bg = sb.start("for i in $(seq 1 40); do echo $i; sleep 0.25; done")
            edge_pid = up.pids()["edge-edge0"]
            out = up.dsec("restart", "edge-edge0", "apiserver")
            assert out.returncode == 0, out.stdout + out.stderr
            assert "edge-edge0" in out.stdout and "apiserver" in out.stdout
            assert up.pids()["edge-edge0"] != edge_pid
            wait_for(lambda: _running(c, sb.id), timeout_s=30)
            assert sb.files.read("/work/kept.txt") == b"before"
            done = sb.process(bg.exec_id).wait(timeout_s=60)
            assert done.exit is not None and done.exit.exit_code == 0
            text = b"".join(
                getattr(e, "data", b"") for e in sb.process(bg.exec_id).attach()
            ).decode()
            assert text.split() == [str(i) for i in range(1, 41)]  # nothing lost
            # a graceful restart is not a crash
            line = next(
                x for x in up.dsec("status").stdout.splitlines() if x.startswith("edge-edge0 ")
            )
            assert "restarts 0" in line, line
        finally:
            sb.stop()


def test_restart_of_an_unknown_service_names_the_services(up: Up) -> None:
    out = up.dsec("restart", "nope")
    assert out.returncode == 2
    assert "no service nope" in out.stderr
    for name in SERVICES:
        assert name in out.stderr
    bad = up.dsec("up", "--port-base", "65530")
    assert bad.returncode == 2 and "--port-base" in bad.stderr and "1024.." in bad.stderr, bad


def test_a_service_that_cannot_start_is_given_up_and_status_says_why(up: Up) -> None:
    c = up.cluster()
    env_file = c.supervisor.dir / "env" / "placement.json"
    good = env_file.read_text()
    spec = json.loads(good)
    spec["env"]["DSEC_PLACEMENT_BURST_THRESHOLD"] = "7"  # refused at start-up
    env_file.write_text(json.dumps(spec))
    try:
        os.kill(up.pids()["placement"], signal.SIGKILL)
        # back-off 1 + 2 + ... s between failed starts, then FATAL
        wait_for(
            lambda: up.cluster().supervised_processes()["placement"].state == "FATAL",
            timeout_s=30 + START_RETRIES * 8,
            interval_s=0.5,
        )
        out = up.dsec("status")
        assert out.returncode == 1
        assert "placement    FATAL" in out.stdout, out.stdout
        assert "BURST_THRESHOLD" in out.stdout, out.stdout  # the log's tail says why
        restarts = up.cluster().supervisor.restarts()["placement"]["restarts"]
        assert restarts == 1 + START_RETRIES, restarts  # after the kill, then the retries
    finally:
        env_file.write_text(good)
    out = up.dsec("up")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "starting placement" in out.stdout
    assert up.dsec("status").returncode == 0


def test_up_after_supervisord_died_replaces_what_it_left_running(up: Up) -> None:
    with up.client() as c:
        sb = c.create(image="busybox", cpu=0.2, memory_mb=64)
        sandbox_id = sb.id
    # a service supervisord restarted: its PID is not the one cluster.json holds
    old = up.pids()["placement"]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: up.pids()["placement"] not in (0, old), timeout_s=30)
    wait_for(lambda: _serving(up, "placement"), timeout_s=60)
    services = set(up.pids().values())
    os.kill(up.cluster().supervisor.pid(), signal.SIGKILL)
    wait_for(lambda: not up.cluster().supervisor.pid(), timeout_s=10)
    out = up.dsec("status")
    assert out.returncode == 1 and "supervisord is not running" in out.stdout, out.stdout
    out = up.dsec("up", "--port-base", str(_free_port_base()))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "stopping what is left of the previous cluster" in out.stdout
    alive = set(up.cluster_processes_alive())
    assert not services & alive, services & alive  # every old service was stopped
    assert up.dsec("status").returncode == 0
    with up.client() as c:
        wait_for(lambda: _running(c, sandbox_id), timeout_s=60)  # kept and re-adopted
        c.get(sandbox_id).stop()


def test_down_keep_sandboxes_then_up_readopts_then_down_ends_them(up: Up) -> None:
    with up.client() as c:
        sb = c.create(image="busybox", cpu=0.2, memory_mb=64)
        sb.files.write("/work/kept.txt", "kept")
        sandbox_id = sb.id
    out = up.dsec("down", "--keep-sandboxes")
    assert out.returncode == 0 and "sandboxes kept" in out.stdout, out.stdout + out.stderr
    assert not (up.home / "cluster.json").exists()
    assert not up.cluster_processes_alive()
    assert sandbox_id in up.runc_ids()  # the container runs on without its edge
    out = up.dsec("up", "--port-base", str(_free_port_base()))
    assert out.returncode == 0, out.stdout + out.stderr
    with up.client() as c:
        wait_for(lambda: _running(c, sandbox_id), timeout_s=60)
        assert c.get(sandbox_id).files.read("/work/kept.txt") == b"kept"
    out = up.dsec("down")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not up.cluster_processes_alive()
    assert sandbox_id not in up.runc_ids()
    assert str(up.home) not in Path("/proc/self/mountinfo").read_text()
    # the module fixture brings it up again for whatever runs after
    out = up.dsec("up", "--port-base", str(_free_port_base()))
    assert out.returncode == 0, out.stdout + out.stderr
