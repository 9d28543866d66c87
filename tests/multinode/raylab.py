"""A Ray cluster on lab hosts (dsecctl.hosts): the head on one host, workers on others.

Every Ray process runs in its host's network namespace (``ray start`` through
:meth:`Host.command`, ``--node-ip-address`` the host's address), so the nodes reach each other
over the lab's bridge as separate machines would. They share this machine's file system, so
each node gets a temp dir of its own (its raylet's sockets must not collide), short enough for
a Unix socket path. The processes are stopped only through the lab (``Host.kill_all``: what
runs in its namespaces), never with ``ray stop``, which stops every Ray on the machine.

The nodes start with:

- ``PYTHONPATH`` = this checkout, so Ray's workers (the actors of ``dsec deploy --ray``) and the
  services they start run this tree's code, as the test process does;
- ``RAY_AUTH_MODE=disabled`` (the callers get the same environment, :attr:`RayLab.env`);
- health checks of 1 s, 3 failures: a node that leaves is dead to Ray in seconds;
- ``GRPC_ENABLE_FORK_SUPPORT=0``: Ray's client server forks a process per client, and gRPC's
  fork handlers make that process abort now and then (ray-project/ray#63202: "Starting Ray
  client server failed"); without them every connection here succeeded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsecctl.cluster import release_cgroup_parent
from dsecctl.hosts import Host
from dsecctl.ray_deploy import edge_id_for
from edge.runtime import cgroups

RAY = str(Path(sys.executable).parent / "ray")
REPO = Path(__file__).resolve().parents[2]
GCS_PORT = 6379
CLIENT_PORT = 10001


class RayLabError(RuntimeError):
    """A Ray node did not start."""


class RayLab:
    """A Ray cluster on lab hosts: :meth:`start_head`, then :meth:`add_worker` per node."""

    def __init__(self, object_store_mb: int = 80) -> None:
        self.object_store_mb = object_store_mb
        # Short: a raylet's socket path (temp dir + session name + sockets/plasma_store)
        # must fit in 107 bytes.
        self.temp_root = Path(tempfile.mkdtemp(prefix="dray", dir="/tmp"))
        self.head: Host | None = None
        self.nodes: list[Host] = []
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "GRPC_ENABLE_FORK_SUPPORT": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            # Said, not left to Ray: with RAY_AUTH_MODE unset, a node turns token auth on when
            # ~/.ray/auth_token happens to exist (any local ray.init() on the machine writes
            # one), and a worker started without it is then refused.
            "RAY_AUTH_MODE": "disabled",
            # A node whose raylet is killed is declared dead after ~3 s, not Ray's ~30 s.
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
        }

    @property
    def client_address(self) -> str:
        """The Ray Client address (from outside the cluster: the test's own namespace)."""
        assert self.head is not None
        return f"ray://{self.head.address}:{CLIENT_PORT}"

    @property
    def gcs_address(self) -> str:
        assert self.head is not None
        return f"{self.head.address}:{GCS_PORT}"

    def _start(self, host: Host, args: list[str]) -> float:
        t0 = time.monotonic()
        argv = [
            RAY,
            "start",
            *args,
            f"--node-ip-address={host.address}",
            "--num-cpus=1",
            f"--object-store-memory={self.object_store_mb * 1024 * 1024}",
            "--disable-usage-stats",
            f"--temp-dir={self.temp_root / host.name}",
        ]
        r = subprocess.run(
            host.command(argv), env=self.env, capture_output=True, text=True, timeout=180
        )
        if r.returncode != 0:
            raise RayLabError(f"ray start on {host.name}: {r.returncode}\n{r.stderr[-3000:]}")
        self.nodes.append(host)
        return time.monotonic() - t0

    def start_head(self, host: Host) -> float:
        """The head (GCS, client server) on ``host``; returns the seconds it took."""
        self.head = host
        return self._start(
            host,
            [
                "--head",
                f"--port={GCS_PORT}",
                f"--ray-client-server-port={CLIENT_PORT}",
                "--include-dashboard=false",
            ],
        )

    def add_worker(self, host: Host) -> float:
        """A worker node on ``host`` joining the head; returns the seconds it took."""
        return self._start(host, [f"--address={self.gcs_address}"])

    def close(self) -> None:
        """Kills every Ray process of the nodes (those in the lab's namespaces, by PID) and
        removes the temp dirs."""
        for host in self.nodes:
            host.kill_all()
        deadline = time.monotonic() + 10
        while any(h.pids() for h in self.nodes) and time.monotonic() < deadline:
            time.sleep(0.1)
        # An edge killed with its node (one that left) keeps its cgroup parent, and any
        # sandbox still in it: cgroups named after the node's edge id.
        for host in self.nodes:
            prefix = f"dsec-{edge_id_for(host.address)}-"
            for name in cgroups.children(""):
                if name.startswith(prefix):
                    release_cgroup_parent(name)
        shutil.rmtree(self.temp_root, ignore_errors=True)
