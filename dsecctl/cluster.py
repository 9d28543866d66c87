"""A local dsec cluster: every service as its own process on one machine.

Used by ``dsec up`` and by the integration test harness. Each service gets
its config through ``DSEC_<SVC>_*`` variables, logs to ``<home>/logs``, and
is tracked in ``<home>/cluster.json`` (addresses and logs, no PIDs: supervisord restarts a
service under another PID, so a recorded one goes stale and may come to name an unrelated
process; a service's current PID comes from supervisord or, without it, from the process
serving its address: ``dsec status --json``).

Two ways to run the processes:

- ``supervised=True`` (``dsec up``): under supervisord (:mod:`dsecctl.supervisor`), which
  restarts a service that dies. Edges keep their sandboxes when they stop (a restart, an
  upgrade): only :meth:`LocalCluster.stop` without ``keep_sandboxes`` stops them, through
  each edge's API, before the services go.
- unsupervised (the test harness's default): plain child processes; a dead service stays
  dead until :meth:`LocalCluster.restart`. Stopping sends SIGTERM to those PIDs only (never
  to anything this cluster did not start), then SIGKILL.

Host daemons (``host_daemons=``, what ``dsec up`` passes when edges may run VMs: libvirtd
and virtlogd, :mod:`dsecctl.host_daemons`): one whose socket does not answer at start is
started first, as one more (supervised) process of the cluster, and stopped with it; one
that answers is someone else's and only checked (:meth:`LocalCluster.checked_status`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import xmlrpc.client
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsecctl import host_daemons
from dsecctl.host_daemons import HostDaemon
from dsecctl.hosts import Host
from dsecctl.supervisor import UP_STATES, ProcessInfo, Program, Supervisor

SERVICES = ("iam", "watcher", "placement", "edge", "apiserver", "compat")


#: Ports free_port picks from: below the kernel's ephemeral range (net.ipv4.ip_local_port_range,
#: 32768-60999 by default). A port chosen when a cluster is planned is bound by its service a
#: moment later; one from the ephemeral range could meanwhile become any process's outgoing
#: connection, or the port bind(0) hands the next caller (a test's own listener): the service
#: then failed to start, "Address already in use".
_PORTS_FROM = 20000
#: Ports this process has handed out: never the same one twice.
_handed_out: set[int] = set()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback TCP port nothing listens on, outside the ephemeral range, not handed out
    before by this process."""
    top = _ephemeral_start() - 1
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(_PORTS_FROM, top) if top > _PORTS_FROM else 0
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {_PORTS_FROM}-{top}")


@dataclass
class ServiceProcess:
    name: str  # "iam", "edge-edge0", ...
    module: str
    address: str
    env: dict[str, str]
    log_path: Path
    pid: int = 0
    proc: subprocess.Popen[bytes] | None = None
    #: "grpc" (gRPC health), "http" (GET /health: the compatibility front end) or "socket"
    #: (a host daemon: its Unix socket, ``unix:<path>``, accepts a connection)
    protocol: str = "grpc"
    #: A host daemon: its command (instead of ``python -m module``) and the pid file that
    #: command names (how a PID is known to be ours).
    argv: tuple[str, ...] = ()
    pid_file: str = ""
    #: The lab host it runs on (its network namespace, :mod:`dsecctl.hosts`); None: here.
    host: Host | None = None
    #: An environment entry ("NAME=value") only this process has, to find its PID by; ""
    #: = its listen address (one that listens on 0.0.0.0, behind a virtual IP, needs one).
    marker: str = ""
    #: Its Prometheus endpoint, host:port serving GET /metrics ("": none; common/metrics.py).
    metrics: str = ""


#: Where each service serves its metrics in a fixed-port cluster (`dsec up`), moved with
#: ``port_base`` like every other port: API server i and compat i at the port + i, edge i
#: at 7180 + i.
METRICS_PORTS = {
    "iam": 7151,
    "placement": 7152,
    "watcher": 7153,
    "apiserver": 7160,
    "compat": 7170,
    "edge": 7180,
}


def env_prefix(p: ServiceProcess) -> str:
    """The ``DSEC_<SVC>_`` of ``p``'s variables (from its listen address's)."""
    return next(k for k in p.env if k.endswith("_LISTEN")).removesuffix("LISTEN")


def serve_metrics(p: ServiceProcess, address: str) -> ServiceProcess:
    """``p`` serving its metrics (GET /metrics) on ``address`` (host:port)."""
    p.metrics = address
    p.env[f"{env_prefix(p)}METRICS_ADDR"] = address
    return p


@dataclass(frozen=True)
class VipPlan:
    """Every API server (each on a lab host of its own) behind one virtual IP, announced over
    BGP to the router at ``peer`` (common/vip.py, dsecctl/vip_router.py)."""

    address: str
    peer: str
    port: int = 7100
    #: The instances' AS number and the router's (eBGP).
    asn: int = 65100
    peer_asn: int = 65000

    @property
    def target(self) -> str:
        """What clients dial: the virtual IP and the port every instance listens on."""
        return f"{self.address}:{self.port}"


@dataclass
class EdgeSpec:
    edge_id: str = "edge0"
    runtime: str = "container"
    labels: dict[str, str] = field(default_factory=dict)
    cpu_millis: int = 0
    memory_mb: int = 0
    max_sandboxes: int = 1000
    #: A local cluster going down takes its sandboxes with it (see EdgeConfig.on_shutdown).
    on_shutdown: str = "stop"
    extra_env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Wiring:
    """How a cluster's services are configured and reach each other: one place for the
    ``DSEC_<SVC>_*`` environment of every service, shared by :class:`LocalCluster` (one
    machine, lab hosts) and :mod:`dsecctl.ray_deploy` (a Ray cluster's nodes), which differ
    only in the addresses and directories they pass in."""

    iam: str
    watcher: str
    placement: str
    log_dir: Path
    log_level: str = "INFO"

    def service(
        self, name: str, module: str, prefix: str, address: str, env: dict[str, str]
    ) -> ServiceProcess:
        full = {
            f"DSEC_{prefix}_{k}": v
            for k, v in {"LOG_LEVEL": self.log_level, "LISTEN": address, **env}.items()
        }
        return ServiceProcess(name, module, address, full, self.log_dir / f"{name}.log")

    def control_plane(self, *, database: str, token_file: Path) -> list[ServiceProcess]:
        """IAM (``database``: sqlite:<path> or postgresql://...; the bootstrap admin token
        written to ``token_file``), the watcher and placement, in start order."""
        return [
            self.service(
                "iam",
                "iam",
                "IAM",
                self.iam,
                {"DATABASE": database, "BOOTSTRAP_TOKEN_FILE": str(token_file)},
            ),
            self.service(
                "watcher",
                "watcher",
                "WATCHER",
                self.watcher,
                {"PROBE_INTERVAL_S": "0.5", "IAM": self.iam},
            ),
            self.service(
                "placement", "placement", "PLACEMENT", self.placement, {"WATCHER": self.watcher}
            ),
        ]

    def edge(
        self,
        e: EdgeSpec,
        address: str,
        *,
        state_dir: Path,
        on_shutdown: str,
        cgroup_parent: str,
    ) -> ServiceProcess:
        """Edge ``e`` listening on ``address``; ``e.extra_env`` (full variable names) last."""
        env = {
            "EDGE_ID": e.edge_id,
            "RUNTIME": e.runtime,
            "STATE_DIR": str(state_dir),
            "WATCHER": self.watcher,
            "IAM": self.iam,
            "REGISTER_INTERVAL_S": "2",
            "MAX_SANDBOXES": str(e.max_sandboxes),
            "ON_SHUTDOWN": on_shutdown,
            "CGROUP_PARENT": cgroup_parent,
            **({"LABELS": ",".join(f"{k}={v}" for k, v in e.labels.items())} if e.labels else {}),
            **({"CPU_MILLIS": str(e.cpu_millis)} if e.cpu_millis else {}),
            **({"MEMORY_MB": str(e.memory_mb)} if e.memory_mb else {}),
        }
        edge = self.service(f"edge-{e.edge_id}", "edge", "EDGE", address, env)
        edge.env.update(e.extra_env)  # full variable names, e.g. DSEC_EDGE_IMAGE_DIR
        return edge

    def apiserver(self, name: str, address: str, *, viewer: str) -> ServiceProcess:
        """API server instance ``name`` ("apiserver", "apiserver1", ...); ``viewer``: the
        host:port of its live view (HTTP)."""
        return self.service(
            name,
            "apiserver",
            "APISERVER",
            address,
            {
                "IAM": self.iam,
                "PLACEMENT": self.placement,
                "WATCHER": self.watcher,
                "INSTANCE": name,
                "VIEWER_ADDR": viewer,
            },
        )

    @staticmethod
    def behind_vip(p: ServiceProcess, vip: VipPlan, state_dir: Path) -> ServiceProcess:
        """``p`` (an API server or a compat front end) announcing ``vip`` (common/vip.py):
        listening on every address (calls arrive for the virtual IP) at its port; its route
        agent's files in ``state_dir`` (also what finds its PID: ``marker``)."""
        prefix = "APISERVER" if p.module == "apiserver" else "COMPAT"
        port = p.address.rsplit(":", 1)[1]
        p.env.update(
            {
                f"DSEC_{prefix}_LISTEN": f"0.0.0.0:{port}",
                f"DSEC_{prefix}_VIP": vip.address,
                f"DSEC_{prefix}_VIP_PEER": vip.peer,
                f"DSEC_{prefix}_VIP_ASN": str(vip.asn),
                f"DSEC_{prefix}_VIP_PEER_ASN": str(vip.peer_asn),
                f"DSEC_{prefix}_VIP_STATE_DIR": str(state_dir),
            }
        )
        if prefix == "COMPAT":  # the SandboxFusion listener takes the virtual IP's calls too
            fusion_port = p.env["DSEC_COMPAT_SANDBOX_FUSION_LISTEN"].rsplit(":", 1)[1]
            p.env["DSEC_COMPAT_SANDBOX_FUSION_LISTEN"] = f"0.0.0.0:{fusion_port}"
        p.marker = f"DSEC_{prefix}_VIP_STATE_DIR={state_dir}"
        return p

    def compat(
        self, address: str, *, fusion: str, apiserver: str, name: str = "compat"
    ) -> ServiceProcess:
        """The compatibility front ends: E2B on ``address``, SandboxFusion on ``fusion``."""
        compat = self.service(
            name,
            "compat",
            "COMPAT",
            address,
            {"APISERVER": apiserver, "SANDBOX_FUSION_LISTEN": fusion},
        )
        compat.protocol = "http"
        return compat


class LocalCluster:
    """Starts, checks and stops the services of one single-machine cluster.

    ``transport="tcp"`` uses loopback ports (fixed defaults for ``dsec up``,
    free ports otherwise); ``"unix"`` puts sockets under ``<home>/sock``.
    """

    def __init__(
        self,
        home: Path,
        *,
        transport: str = "tcp",
        fixed_ports: bool = False,
        port_base: int = 7100,
        edges: list[EdgeSpec] | None = None,
        apiservers: int = 1,
        log_level: str = "INFO",
        extra_env: dict[str, str] | None = None,
        iam_database: str = "",
        compat: bool = True,
        supervised: bool = False,
        host_daemons: list[HostDaemon] | None = None,
        hosts: dict[str, Host] | None = None,
        vip: VipPlan | None = None,
        bind: str = "127.0.0.1",
        compats: int = 1,
        compat_vip: VipPlan | None = None,
        metrics: bool = True,
    ) -> None:
        self.home = home
        #: Every service measures itself and serves /metrics (False: instruments are no-ops
        #: and no service listens for scrapes: the benchmarks' baseline).
        self.metrics = metrics
        #: The address services not on a lab host listen on (with TCP): loopback, or this
        #: machine's address on a lab network whose hosts must reach them (dsec up --vip).
        self.bind = bind
        self.transport = transport
        self.fixed_ports = fixed_ports
        #: With fixed ports: the API server's; the others are at fixed offsets from it.
        self.port_base = port_base
        self.edges = edges or [EdgeSpec()]
        self.apiservers = apiservers
        self.log_level = log_level
        self.extra_env = extra_env or {}
        #: DSEC_IAM_DATABASE ("" = SQLite under the cluster's home).
        self.iam_database = iam_database
        #: Start the E2B-compatible front end (``python -m compat``, HTTP on loopback).
        self.compat = compat
        self.processes: list[ServiceProcess] = []
        #: Run the services under supervisord (restarted when they die); see the module doc.
        self.supervised = supervised
        self.supervisor = Supervisor(home)
        self.token_file = home / "token"
        #: host:port of the compat process's SandboxFusion listener ("" = none).
        self.sandbox_fusion_address = ""
        #: Host daemons the cluster needs (started if not answering, see the module doc).
        self.host_daemons = host_daemons or []
        #: Those that answered at start: someone else's, only checked.
        self.checked: list[ServiceProcess] = []
        #: Which lab host runs a service, by service name ("iam", "watcher", "placement",
        #: "edge-<id>", "apiserver", "apiserver<i>", "compat"; :mod:`dsecctl.hosts`). A
        #: service on a host listens on the host's address at its fixed port (each host has
        #: ports of its own); one not named runs here, as in a one-machine cluster.
        self.hosts = hosts or {}
        #: The API servers behind a virtual IP (None: each at its own address).
        self.vip = vip
        #: Compatibility front end instances ("compat", "compat1", ...), and the virtual IP
        #: they are behind (needed for more than one: port 7130 and 7131 of one address).
        self.compats = compats if compat else 0
        self.compat_vip = compat_vip
        if compat_vip is not None:
            names = ["compat"] + [f"compat{i}" for i in range(1, self.compats)]
            placed = [self.hosts.get(n) for n in names]
            if None in placed or len({h.name for h in placed if h}) != len(names):
                raise ValueError("behind a virtual IP, every front end runs on a host of its own")
        elif self.compats > 1:
            raise ValueError("several compat front ends need a virtual IP (compat_vip)")
        if vip is not None:
            names = ["apiserver"] + [f"apiserver{i}" for i in range(1, apiservers)]
            placed = [self.hosts.get(n) for n in names]
            if None in placed or len({h.name for h in placed if h}) != len(names):
                raise ValueError("behind a virtual IP, every API server runs on a host of its own")
        self.wiring: Wiring | None = None

    # ----------------------------------------------------------- addresses

    def _address(self, name: str, default_port: int) -> str:
        host = self.hosts.get(name)
        if host is not None:
            return f"{host.address}:{default_port}"
        if self.transport == "unix":
            return f"unix:{self.home / 'sock' / (name + '.sock')}"
        return f"{self.bind}:{self._port(default_port)}"

    def _port(self, default_port: int) -> int:
        """``default_port`` (7100 + offset) moved to ``port_base``, or a free one."""
        return default_port - 7100 + self.port_base if self.fixed_ports else free_port()

    def plan(self) -> list[ServiceProcess]:
        """The processes to start, in dependency order, with their configuration."""
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        (self.home / "sock").mkdir(parents=True, exist_ok=True)
        wiring = Wiring(
            iam=self._address("iam", 7101),
            watcher=self._address("watcher", 7103),
            placement=self._address("placement", 7102),
            log_dir=self.home / "logs",
            log_level=self.log_level,
        )
        daemons = host_daemons.plan(self.host_daemons)
        self.checked = [self._daemon_process(d) for d in daemons.checked]
        plan = [self._daemon_process(d) for d in daemons.start]
        control = wiring.control_plane(
            database=self.iam_database or f"sqlite:{self.home / 'iam' / 'iam.db'}",
            token_file=self.token_file,
        )
        for p in control:
            self._serve_metrics(p, METRICS_PORTS[p.name])
        plan += control
        for i, e in enumerate(self.edges):
            plan.append(
                self._serve_metrics(
                    wiring.edge(
                        e,
                        self._address(f"edge-{e.edge_id}", 7110 + i),
                        state_dir=self.home / "edges" / e.edge_id,
                        # Supervised, an edge's stop is a restart or an upgrade: its
                        # sandboxes stay.
                        on_shutdown="keep" if self.supervised else e.on_shutdown,
                        # An edge treats every child of its cgroup parent as its own (orphan
                        # cleanup): clusters sharing this machine must not share a parent.
                        cgroup_parent=f"dsec-{e.edge_id}-{hashlib.sha1(str(self.home).encode()).hexdigest()[:8]}",
                    ),
                    METRICS_PORTS["edge"] + i,
                )
            )
        self.wiring = wiring
        plan += [self._apiserver_process(i) for i in range(self.apiservers)]
        apiserver = next(p for p in plan if p.name == "apiserver").address
        for i in range(self.compats):
            plan.append(self._compat_process(i, self.vip.target if self.vip else apiserver))
        if self.compats:
            # HTTP clients (the e2b SDK) need a URL: loopback TCP even in a Unix-socket cluster.
            first = next(p for p in plan if p.name == "compat")
            self.sandbox_fusion_address = (
                f"{self.compat_vip.address}:7131"
                if self.compat_vip
                else first.env["DSEC_COMPAT_SANDBOX_FUSION_LISTEN"]
            )
        for p in plan:
            p.host = self.hosts.get(p.name)
        return plan

    def _apiserver_process(self, i: int) -> ServiceProcess:
        """API server instance ``i`` ("apiserver", "apiserver1", ...)."""
        assert self.wiring is not None
        name = "apiserver" if i == 0 else f"apiserver{i}"
        vip = self.vip
        p = self.wiring.apiserver(
            name,
            # Behind a virtual IP every instance listens on the same port (of its own host).
            self._address(name, vip.port if vip else 7100 if i == 0 else 7120 + i),
            # The live view (HTTP: loopback TCP even in a Unix-socket cluster).
            viewer=self._http_address(name, 7104 if i == 0 else 7140 + i),
        )
        host = self.hosts.get(name)
        if vip is not None and host is not None:
            Wiring.behind_vip(p, vip, host.local("vip", name))
        p.host = host
        return self._serve_metrics(p, METRICS_PORTS["apiserver"] + i)

    def _compat_process(self, i: int, apiserver: str) -> ServiceProcess:
        """Compatibility front end instance ``i`` ("compat", "compat1", ...)."""
        assert self.wiring is not None
        name = "compat" if i == 0 else f"compat{i}"
        p = self.wiring.compat(
            self._http_address(name, 7130),
            fusion=self._http_address(name, 7131),
            apiserver=apiserver,
            name=name,
        )
        host = self.hosts.get(name)
        if self.compat_vip is not None and host is not None:
            Wiring.behind_vip(p, self.compat_vip, host.local("vip", name))
        p.host = host
        return self._serve_metrics(p, METRICS_PORTS["compat"] + i)

    def add_apiserver(self, host: Host, timeout_s: float = 60.0) -> ServiceProcess:
        """One more API server instance, on ``host``, started and SERVING (behind the
        virtual IP, if the cluster has one, it takes traffic once its route is in)."""
        i = sum(1 for p in self.processes if p.module == "apiserver")
        self.hosts[f"apiserver{i}"] = host
        p = self._apiserver_process(i)
        self.processes.append(p)
        self.apiservers += 1
        self.start_services([p], timeout_s)
        return p

    def _serve_metrics(self, p: ServiceProcess, default_port: int) -> ServiceProcess:
        """``p`` serving its metrics (GET /metrics) on an HTTP port of its host (with metrics
        off: not measuring at all)."""
        if not self.metrics:
            p.env[f"{env_prefix(p)}METRICS"] = "off"
            return p
        return serve_metrics(p, self._http_address(p.name, default_port))

    def _http_address(self, name: str, default_port: int) -> str:
        """An HTTP listener of service ``name``: on its host, else loopback TCP."""
        host = self.hosts.get(name)
        if host is not None:
            return f"{host.address}:{default_port}"
        return f"{self.bind}:{self._port(default_port)}"

    def _daemon_process(self, d: HostDaemon) -> ServiceProcess:
        d.pid_file.parent.mkdir(parents=True, exist_ok=True)
        return ServiceProcess(
            d.name,
            d.name,
            f"unix:{d.socket}",
            dict(d.env),
            self.home / "logs" / f"{d.name}.log",
            protocol="socket",
            argv=d.argv,
            pid_file=str(d.pid_file),
        )

    # ------------------------------------------------------------ start/stop

    def start(self, timeout_s: float = 60.0) -> None:
        """Starts every service and waits until all report SERVING; stops all on failure."""
        self.processes = self.plan()
        try:
            if self.supervised:
                env = {**os.environ, **self.extra_env}
                self.supervisor.write_config(
                    (
                        Program(
                            p.name,
                            p.module,
                            p.env,
                            p.log_path,
                            # on a lab host: in its network namespace
                            argv=p.argv
                            or (
                                tuple(p.host.command([sys.executable, "-m", p.module]))
                                if p.host is not None
                                else ()
                            ),
                        )
                        for p in self.processes
                    ),
                    env,
                )
                self.supervisor.start(env)
            self.start_services(self.processes, timeout_s)
        except BaseException:
            self.stop()
            raise

    def start_services(self, procs: list[ServiceProcess], timeout_s: float = 60.0) -> None:
        """Starts ``procs`` (in plan order, IAM first if among them) and waits until they
        report SERVING and every edge is healthy in the watcher; records the cluster."""
        for p in procs:
            self._spawn(p)
            if p.name == "iam" or p.argv:
                # The bootstrap token must exist before anyone uses the cluster; an edge
                # connects to libvirtd when it starts.
                self.wait_serving([p], timeout_s)
        self.wait_serving(procs, timeout_s)
        self.wait_edges_registered(timeout_s)
        self.write_state()

    def _spawn(self, p: ServiceProcess) -> None:
        if self.supervised:
            self.supervisor.start_process(p.name)
            p.pid = self._supervised_pid(p.name)
            return
        env = {**os.environ, **self.extra_env, **p.env, "PYTHONUNBUFFERED": "1"}
        log = open(p.log_path, "ab")
        argv = list(p.argv) or [sys.executable, "-m", p.module]
        p.proc = subprocess.Popen(
            p.host.command(argv) if p.host is not None else argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C in the terminal must not kill the cluster
        )
        log.close()
        p.pid = p.proc.pid

    def wait_serving(self, procs: list[ServiceProcess], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(procs)
        while pending:
            supervised = self.supervisor.processes() if self.supervised else {}
            for p in list(pending):
                if p.proc is not None and p.proc.poll() is not None:
                    raise RuntimeError(
                        f"{p.name} exited with {p.proc.returncode}:\n{self.log_tail(p)}"
                    )
                if self.supervised:
                    info = supervised[p.name]
                    if info.state == "FATAL":
                        raise RuntimeError(
                            f"{p.name} could not start ({info.description}):\n{self.log_tail(p)}"
                        )
                    p.pid = info.pid or p.pid
                if service_health(p, timeout_s=1.0) == "SERVING":
                    pending.remove(p)
            if pending and time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                tails = "\n".join(f"--- {p.name}\n{self.log_tail(p)}" for p in pending)
                raise TimeoutError(f"not SERVING after {timeout_s:.0f} s: {names}\n{tails}")
            if pending:
                time.sleep(0.05)

    def wait_edges_registered(self, timeout_s: float) -> None:
        """Until the watcher has probed every edge healthy (placement can then use them)."""
        watcher = next(p for p in self.processes if p.name == "watcher")
        wait_edges_healthy(watcher.address, {e.edge_id for e in self.edges}, timeout_s)

    def stop(self, grace_s: float = 30.0, keep_sandboxes: bool = False) -> None:
        """Stops every service and returns once they are gone.

        Supervised: the front ends first (no new work), then, unless ``keep_sandboxes``, every
        sandbox through its edge's API, then the rest in reverse order, and supervisord.
        Unsupervised: SIGTERM to every started PID (reverse order), then SIGKILL what is left
        (edges with ``on_shutdown=stop`` end their sandboxes themselves)."""
        if self.supervised:
            self._stop_supervised(keep_sandboxes)
        else:
            self._stop_processes(grace_s)
            keep_sandboxes = keep_sandboxes or any(e.on_shutdown != "stop" for e in self.edges)
        if not keep_sandboxes:
            # With sandboxes left, their mounts and paused pages stay for the next edge.
            self.release_cgroups()
            self.release_mounts()
            self.release_swaps()
        state = self.home / "cluster.json"
        if state.exists():
            state.unlink()

    def _stop_supervised(self, keep_sandboxes: bool) -> None:
        if not self.supervisor.pid():
            # supervisord is gone (killed): what it left running, found by address
            for p in self.processes:
                p.pid = find_service_pid(p)
            self._stop_processes(30.0)
            return
        for name, info in self.supervisor.processes().items():  # the current PIDs
            self.process(name).pid = info.pid
        front = [p for p in self.processes if p.module in ("compat", "apiserver")]
        for p in reversed(front):
            self.supervisor.stop_process(p.name)
        if not keep_sandboxes:
            self.stop_sandboxes()
        for p in reversed(self.processes):
            if p not in front:
                self.supervisor.stop_process(p.name)
        self.supervisor.shutdown()

    def stop_sandboxes(self, grace_s: float = 2.0) -> int:
        """Stops every live sandbox of the cluster's edges through each edge's API; returns
        how many. An edge that does not answer is skipped (its sandboxes keep running)."""
        return sum(
            stop_edge_sandboxes(p.address, grace_s)
            for p in self.processes
            if p.module == "edge" and _alive(p)
        )

    def _stop_processes(self, grace_s: float) -> None:
        """SIGTERM to every started PID (reverse order), then SIGKILL what is left."""
        for p in reversed(self.processes):
            if p.pid and _alive(p):
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for p in reversed(self.processes):
            while p.pid and _alive(p) and time.monotonic() < deadline:
                time.sleep(0.05)
            if p.pid and _alive(p):
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                if p.proc is not None:
                    p.proc.wait(timeout=5)

    def release_mounts(self) -> list[str]:
        """Unmounts whatever is still mounted under the cluster's home, and under each edge's
        state directory set outside it, once its processes are gone (an edge killed mid-start
        can leave a toolkit mount)."""
        return [t for root in self._own_roots() for t in release_mounts(Path(root))]

    def release_cgroups(self) -> list[str]:
        """Kills what is left in each edge's cgroup parent and removes its cgroups (see
        :func:`release_cgroup_parent`); only parents this cluster planned (a cluster read
        back from cluster.json knows none)."""
        return [
            d
            for p in self.processes
            if p.module == "edge"
            for d in release_cgroup_parent(p.env.get("DSEC_EDGE_CGROUP_PARENT", ""))
        ]

    def _own_roots(self) -> tuple[str, ...]:
        """The cluster's home and every edge's state directory set outside it (a lab host's
        own directory): where its mounts and swap areas are."""
        roots = {str(self.home.resolve()) + "/"}
        for e in self.edges:
            state = e.extra_env.get("DSEC_EDGE_STATE_DIR")
            if state:
                roots.add(str(Path(state).resolve()) + "/")
        return tuple(sorted(roots))

    def release_swaps(self) -> list[str]:
        """Turns off and removes the swap areas of the cluster's edges that an edge killed
        before its shutdown left active (an edge removes its own when it stops)."""
        return [p for root in self._own_roots() for p in release_swaps(Path(root))]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to a service (supervised: supervisord starts it again if it dies)."""
        p = self.process(name)
        if self.supervised:
            p.pid = self._supervised_pid(name)
        os.kill(p.pid, sig)
        if p.proc is not None:
            p.proc.wait(timeout=10)

    def restart(self, name: str, timeout_s: float = 60.0) -> None:
        """Stops one service gracefully (an edge keeps its sandboxes if it is configured
        to: always when supervised), starts it again and waits until it is SERVING."""
        p = self.process(name)
        if self.supervised:
            self.supervisor.stop_process(name)
        elif _alive(p):
            os.kill(p.pid, signal.SIGTERM)
            if p.proc is not None:
                p.proc.wait(timeout=30)
        self._spawn(p)
        self.wait_serving([p], timeout_s)
        self.write_state()

    def _supervised_pid(self, name: str) -> int:
        return self.supervisor.processes()[name].pid

    # --------------------------------------------------------------- state

    def process(self, name: str) -> ServiceProcess:
        return next(p for p in self.processes if p.name == name)

    @property
    def apiserver(self) -> str:
        """Where clients reach the API: the virtual IP if there is one, else the first
        instance."""
        return self.vip.target if self.vip else self.process("apiserver").address

    @property
    def viewer_url(self) -> str:
        """Base URL of the first API server's live view (add ``/view/<sandbox id>?token=``)."""
        return "http://" + self.process("apiserver").env["DSEC_APISERVER_VIEWER_ADDR"]

    @property
    def compat_url(self) -> str:
        """Base URL of the E2B-compatible API (E2B_API_URL and E2B_SANDBOX_URL)."""
        if self.compat_vip is not None:
            return f"http://{self.compat_vip.address}:7130"
        return "http://" + self.process("compat").address

    @property
    def sandbox_fusion_url(self) -> str:
        """Base URL of the SandboxFusion-compatible API (add ``/t/<token>/run_code``)."""
        return "http://" + self.sandbox_fusion_address

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    def write_state(self) -> None:
        state = {
            "apiserver": self.apiserver,
            "supervised": self.supervised,
            **({"vip": dataclasses.asdict(self.vip)} if self.vip else {}),
            **({"compat_vip": dataclasses.asdict(self.compat_vip)} if self.compat_vip else {}),
            **(
                {"e2b_api_url": self.compat_url, "sandbox_fusion_url": self.sandbox_fusion_url}
                if any(p.name == "compat" for p in self.processes)
                else {}
            ),
            "services": {
                # No PID: it would go stale at the first restart (see the module doc).
                p.name: {
                    "address": p.address,
                    "log": str(p.log_path),
                    "protocol": p.protocol,
                    **({"command": list(p.argv), "pid_file": p.pid_file} if p.argv else {}),
                    **({"marker": p.marker} if p.marker else {}),
                    **({"metrics": f"http://{p.metrics}/metrics"} if p.metrics else {}),
                }
                for p in self.processes
            },
            # Host daemons someone else runs: only checked (`dsec status`).
            "checked": {p.name: {"address": p.address} for p in self.checked},
        }
        path = self.home / "cluster.json"
        path.write_text(json.dumps(state, indent=2))

    @classmethod
    def from_state(cls, home: Path) -> LocalCluster | None:
        """The cluster recorded in ``<home>/cluster.json``, each service with its current PID
        (0: not running): supervisord's, or without it the process serving its address."""
        path = home / "cluster.json"
        if not path.exists():
            return None
        state = json.loads(path.read_text())
        edges = [
            EdgeSpec(edge_id=n.removeprefix("edge-"))
            for n in state["services"]
            if n.startswith("edge-")
        ]
        c = cls(home, supervised=bool(state.get("supervised")), edges=edges)
        c.sandbox_fusion_address = state.get("sandbox_fusion_url", "").removeprefix("http://")
        if "vip" in state:
            c.vip = VipPlan(**state["vip"])
        if "compat_vip" in state:
            c.compat_vip = VipPlan(**state["compat_vip"])
        for name, s in state["services"].items():
            module = name.split("-")[0].rstrip("0123456789")  # "apiserver1" -> "apiserver"
            c.processes.append(
                ServiceProcess(
                    name,
                    module,
                    s["address"],
                    {},
                    Path(s["log"]),
                    protocol=s.get("protocol", "grpc"),
                    argv=tuple(s.get("command", ())),
                    pid_file=s.get("pid_file", ""),
                    marker=s.get("marker", ""),
                    metrics=s.get("metrics", "").removeprefix("http://").removesuffix("/metrics"),
                )
            )
        for name, s in state.get("checked", {}).items():
            c.checked.append(
                ServiceProcess(name, name, s["address"], {}, Path(), protocol="socket")
            )
        try:
            supervised = c.supervised_processes()
        except (OSError, xmlrpc.client.Error):  # supervisord is going away: by address then
            supervised = {}
        for p in c.processes:
            info = supervised.get(p.name)
            p.pid = info.pid if info is not None else find_service_pid(p)
        return c

    def log_tail(self, p: ServiceProcess, lines: int = 30) -> str:
        return log_tail(p.log_path, lines)

    def status(self) -> dict[str, str]:
        """Each service's health: SERVING, NOT_SERVING, UNREACHABLE, or DOWN (no process);
        supervised, also supervisord's state when the service is not up (BACKOFF, FATAL...)."""
        procs = self.supervised_processes()
        out = {}
        for p in self.processes:
            info = procs.get(p.name)
            if info is not None:
                p.pid = info.pid  # 0: no process now
                if info.state not in UP_STATES:
                    out[p.name] = info.state if info.state != "STOPPED" else "DOWN"
                    continue
            out[p.name] = service_health(p, timeout_s=1.0) if _alive(p) else "DOWN"
        return out

    def checked_status(self) -> dict[str, str]:
        """The host daemons this cluster did not start: SERVING when their socket answers,
        else UNREACHABLE; each one's ``pid`` set to the process of that name (0: none)."""
        out = {}
        for p in self.checked:
            p.pid = host_daemons.pid_by_name(p.name)
            out[p.name] = service_health(p, timeout_s=1.0)
        return out

    def supervised_processes(self) -> dict[str, ProcessInfo]:
        """supervisord's view of the services ({} when unsupervised or supervisord is gone)."""
        if not self.supervised or not self.supervisor.pid():
            return {}
        return self.supervisor.processes()


def wait_edges_healthy(watcher: str, want: set[str], timeout_s: float) -> None:
    """Until the watcher at ``watcher`` has probed every edge of ``want`` healthy."""
    from dsec.watcher.v1 import watcher_pb2, watcher_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(watcher) as ch:
        stub = watcher_pb2_grpc.WatcherServiceStub(ch)
        while True:
            snap = stub.GetClusterSnapshot(
                watcher_pb2.GetClusterSnapshotRequest(), timeout=2
            ).snapshot
            healthy = {
                e.info.edge_id
                for e in snap.edges
                if e.health == watcher_pb2.EDGE_HEALTH_HEALTHY and e.HasField("last_probe_at")
            }
            if want <= healthy:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"edges not healthy in the watcher: {sorted(want - healthy)}")
            time.sleep(0.1)


def stop_edge_sandboxes(address: str, grace_s: float = 2.0) -> int:
    """Stops every live sandbox of the edge at ``address`` through its API; returns how
    many. An edge that does not answer is skipped (its sandboxes keep running)."""
    from dsec.edge.v1 import edge_pb2, edge_pb2_grpc

    stopped = 0
    with grpc.insecure_channel(address) as ch:
        stub = edge_pb2_grpc.EdgeServiceStub(ch)
        try:
            live = stub.ListSandboxes(edge_pb2.ListSandboxesRequest(), timeout=10)
        except grpc.RpcError:
            return 0
        calls = [
            stub.StopSandbox.future(
                edge_pb2.StopSandboxRequest(sandbox_id=sb.id, grace_s=grace_s),
                timeout=grace_s + 30,
            )
            for sb in live.sandboxes
        ]
        for call in calls:
            try:
                call.result()
                stopped += 1
            except grpc.RpcError:
                pass
    return stopped


def release_mounts(root: Path) -> list[str]:
    """Unmounts whatever is still mounted under ``root`` (an edge's state, a cluster's home)
    once its processes are gone (an edge killed mid-start can leave a toolkit mount)."""
    prefix = str(root.resolve()) + "/"
    targets = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            target = line.split()[4].replace("\\040", " ")
            if target.startswith(prefix):
                targets.append(target)
    for target in sorted(targets, key=len, reverse=True):
        if subprocess.run(["umount", target], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", target], capture_output=True)
    return targets


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` of a service's log ("(no log)" when there is none)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def release_cgroup_parent(parent: str) -> list[str]:
    """Kills what is left under an edge's cgroup parent and removes its cgroups: the
    sandboxes of an edge that died before it could stop them (a lost node's, whose processes
    outlive it in namespaces of their own). Returns the directories removed."""
    if not parent:
        return []
    from edge.runtime import cgroups

    for child in cgroups.children(parent):
        cgroups.thaw(f"{parent}/{child}")  # frozen tasks ignore SIGKILL
    return [str(d) for d in cgroups.remove(parent)]


def release_edge(p: ServiceProcess) -> None:
    """What a stopped edge whose sandboxes were meant to end may leave: processes in its
    cgroups, mounts and swap areas under its state directory."""
    release_cgroup_parent(p.env.get("DSEC_EDGE_CGROUP_PARENT", ""))
    state = p.env.get("DSEC_EDGE_STATE_DIR")
    if state:
        release_mounts(Path(state))
        release_swaps(Path(state))


def release_swaps(root: Path) -> list[str]:
    """Turns off and removes the swap areas under ``root`` that an edge killed before its
    shutdown left active (an edge removes its own when it stops)."""
    prefix = str(root.resolve()) + "/"
    left = []
    with open("/proc/swaps") as fh:
        for line in fh.read().splitlines()[1:]:
            path = line.split()[0].replace("\\040", " ")
            if path.startswith(prefix):
                left.append(path)
    for path in left:
        subprocess.run(["swapoff", path], capture_output=True)
        Path(path).unlink(missing_ok=True)
    return left


def _alive(p: ServiceProcess) -> bool:
    if p.proc is not None:
        return p.proc.poll() is None
    if p.pid <= 0:  # not running (0 would signal our own process group)
        return False
    try:
        os.kill(p.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A PID found earlier may have been reused since: check it is one of our services.
    try:
        cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if p.pid_file:
        return host_daemons.is_ours(cmdline, Path(p.pid_file))
    return b"-m" in cmdline and p.module.encode() in cmdline


def find_service_pid(p: ServiceProcess) -> int:
    """The PID of the process running ``p`` (``python -m <module>`` listening on its address,
    as its environment says; a host daemon: the one its pid file names), or 0."""
    if p.pid_file:
        return host_daemons.pid_from_file(Path(p.pid_file))
    listen = (p.marker.encode() if p.marker else b"_LISTEN=" + p.address.encode()) + b"\0"
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes().split(b"\0")
            if b"-m" in cmdline and p.module.encode() in cmdline:
                if listen in (d / "environ").read_bytes():
                    return int(d.name)
        except OSError:
            continue
    return 0


def service_health(p: ServiceProcess, timeout_s: float = 2.0) -> str:
    """A service's health by its protocol: gRPC health, or GET /health for HTTP ones."""
    if p.protocol == "http":
        return http_health(p.address, timeout_s)
    if p.protocol == "socket":
        answers = host_daemons.socket_answers(Path(p.address.removeprefix("unix:")), timeout_s)
        return "SERVING" if answers else "UNREACHABLE"
    return health(p.address, timeout_s=timeout_s)


def http_health(address: str, timeout_s: float = 2.0) -> str:
    """ "SERVING" when ``GET http://address/health`` answers 200, else "UNREACHABLE"."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout_s) as resp:
            return "SERVING" if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as err:
        # 503: up, but not to be given traffic (e.g. its virtual IP cannot be announced)
        return "NOT_SERVING" if err.code == 503 else f"HTTP {err.code}"
    except (OSError, urllib.error.URLError):
        return "UNREACHABLE"


def health(address: str, timeout_s: float = 2.0, service: str = "") -> str:
    """The gRPC health status of a service ("SERVING", ...), or "UNREACHABLE"."""
    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
    except grpc.RpcError:
        return "UNREACHABLE"
