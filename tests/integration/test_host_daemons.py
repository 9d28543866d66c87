"""Host daemons under the local cluster's supervisor (dsecctl/host_daemons.py): a real
virtlogd that was not running is started with the cluster, restarted by supervisord when it
is killed, and stopped with the cluster; a daemon that was already running (the system's
libvirtd, scripts/setup.sh's) is only checked — `dsec status` shows it — and outlives the
cluster.

The virtlogd is a private one: run as nobody with XDG_RUNTIME_DIR in a directory of its own,
libvirt's daemons put their socket and pid file there instead of /run, so the machine's
virtlogd and libvirtd (other users of this host rely on them) are never touched. (It refuses
root's clients: its log says so at each readiness check, a connect that it accepts first.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsecctl import host_daemons
from dsecctl.cluster import EdgeSpec, LocalCluster
from dsecctl.host_daemons import HostDaemon
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith

pytestmark = pytest.mark.timeout(300)

NOBODY = 65534
NAME = "virtlogd-test"


@pytest.fixture(scope="module")
def private_virtlogd() -> Iterator[HostDaemon]:
    binary = shutil.which("virtlogd")
    setpriv = shutil.which("setpriv")
    if binary is None or setpriv is None:
        pytest.fail("virtlogd (libvirt-daemon-system) or setpriv missing: run scripts/setup.sh")
    # Not under pytest's tmp_path: its parents are 0700, nobody could not reach the socket.
    run_dir = Path(tempfile.mkdtemp(prefix="dsec-virtlogd-", dir="/tmp"))
    os.chown(run_dir, NOBODY, NOBODY)
    pid_file = run_dir / "virtlogd.pid"
    env = {"XDG_RUNTIME_DIR": str(run_dir), "HOME": str(run_dir)}
    env |= {"XDG_CONFIG_HOME": str(run_dir / "config"), "XDG_CACHE_HOME": str(run_dir / "cache")}
    argv = (setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
    yield HostDaemon(
        NAME,
        (*argv, binary, "--pid-file", str(pid_file)),
        run_dir / "libvirt" / "virtlogd-sock",
        pid_file,
        env,
    )
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def system_libvirtd(tmp_path_factory: pytest.TempPathFactory) -> HostDaemon:
    daemons = host_daemons.libvirt_daemons(tmp_path_factory.mktemp("daemons"))
    libvirtd = next((d for d in daemons if d.name == "libvirtd"), None)
    if libvirtd is None or not host_daemons.socket_answers(libvirtd.socket):
        pytest.fail("the system's libvirtd is not running: run scripts/setup.sh")
    return libvirtd


@pytest.fixture(scope="module")
def cluster(
    cluster_with: ClusterWith, private_virtlogd: HostDaemon, system_libvirtd: HostDaemon
) -> Iterator[LocalCluster]:
    with cluster_with(
        "hostd",
        edges=[EdgeSpec(edge_id="hostd", runtime="null")],
        compat=False,
        supervised=True,
        host_daemons=[private_virtlogd, system_libvirtd],
    ) as c:
        yield c


def test_a_daemon_not_running_is_started_and_supervised_one_running_only_checked(
    cluster: LocalCluster, private_virtlogd: HostDaemon, system_libvirtd: HostDaemon
) -> None:
    names = [p.name for p in cluster.processes]
    assert names[0] == NAME  # before the services: an edge connects to it at start
    assert "libvirtd" not in names
    assert [p.name for p in cluster.checked] == ["libvirtd"]
    # RUNNING once it has lived supervisord's START_S (as a service)
    info = wait_for(
        lambda: (i := cluster.supervised_processes()[NAME]).state == "RUNNING" and i, timeout_s=10
    )
    assert host_daemons.pid_from_file(private_virtlogd.pid_file) == info.pid
    assert host_daemons.socket_answers(private_virtlogd.socket)
    assert cluster.status()[NAME] == "SERVING"

    status = subprocess.run(
        [sys.executable, "-m", "dsecctl", "status", "--json"],
        env={**os.environ, "DSEC_HOME": str(cluster.home)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    rows = {r["name"]: r for r in json.loads(status.stdout)["services"]}
    assert rows[NAME]["state"] == "SERVING" and rows[NAME]["pid"] == info.pid
    assert rows["libvirtd"]["state"] == "SERVING" and rows["libvirtd"].get("checked") is True
    assert rows["libvirtd"]["pid"] == host_daemons.pid_by_name("libvirtd") != 0


def test_a_killed_daemon_is_restarted_like_a_service(
    cluster: LocalCluster, private_virtlogd: HostDaemon
) -> None:
    old = cluster.supervised_processes()[NAME].pid
    os.kill(old, signal.SIGKILL)

    def restarted() -> int:
        info = cluster.supervised_processes()[NAME]
        ok = info.state == "RUNNING" and info.pid not in (0, old)
        return info.pid if ok and host_daemons.socket_answers(private_virtlogd.socket) else 0

    new = wait_for(restarted, timeout_s=30)
    assert host_daemons.pid_from_file(private_virtlogd.pid_file) == new
    wait_for(lambda: cluster.supervisor.restarts().get(NAME, {}).get("restarts", 0) >= 1)


def test_down_stops_the_daemon_it_started_and_never_one_it_found(
    cluster: LocalCluster,
    cluster_with: ClusterWith,
    private_virtlogd: HostDaemon,
    system_libvirtd: HostDaemon,
) -> None:
    libvirtd_pid = host_daemons.pid_by_name("libvirtd")
    with cluster_with(
        "hostdown",
        edges=[EdgeSpec(edge_id="hostdown", runtime="null")],
        compat=False,
        supervised=True,
        host_daemons=[private_virtlogd, system_libvirtd],
    ) as other:
        # The module's cluster runs this virtlogd: a second cluster only checks it ...
        assert [p.name for p in other.checked] == [NAME, "libvirtd"]
        assert other.checked_status() == {NAME: "SERVING", "libvirtd": "SERVING"}
    # ... and leaves it running when it goes.
    ours = host_daemons.pid_from_file(private_virtlogd.pid_file)
    assert ours and host_daemons.socket_answers(private_virtlogd.socket)

    # The cluster that started it stops it (the fixture's own stop then finds nothing left).
    cluster.stop()
    assert host_daemons.pid_from_file(private_virtlogd.pid_file) == 0
    assert not host_daemons.socket_answers(private_virtlogd.socket)
    with pytest.raises(ProcessLookupError):
        os.kill(ours, 0)
    assert host_daemons.pid_by_name("libvirtd") == libvirtd_pid
