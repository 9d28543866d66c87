"""dsec on a Ray cluster: ``dsec deploy --ray ADDRESS`` / ``dsec undeploy --ray ADDRESS``.

A Ray cluster already knows its machines (nodes join and leave, each with its IP) and runs
long-lived processes pinned to a node (detached actors). dsec uses it for exactly that and for
nothing else: no dsec request goes through Ray. Every actor lives in the Ray namespace
``dsec``, asks for no CPU (``num_cpus=0``: it only supervises) and is pinned to its node with
``NodeAffinitySchedulingStrategy(soft=False)``:

- ``dsec-deployment`` (on the head node): the deployment. It chooses the nodes, starts the
  other actors, and every second compares ``ray.nodes()`` with its edges: a node that joins
  gets an edge actor, the actor of a node that left is dropped (the dsec watcher then declares
  that edge lost, as it does for any edge that stops answering).
- ``dsec-control`` (head node): IAM, the watcher, placement, the first API server and the
  compatibility front ends (compat).
- ``dsec-apiserver1`` (the second node, when there is one): a second API server, so the API
  survives the loss of one of the two nodes.
- ``dsec-edge-<id>`` (every node): that node's edge.

Each of those actors owns its service processes (``python -m <svc>``, configured by the same
:class:`dsecctl.cluster.Wiring` as ``dsec up``): it starts them in order and waits until they
report SERVING, restarts one that exits (back-off 1, 2, 4 ... 30 s; a process that ran 30 s
starts again at 1 s; each restart counted), and on undeploy stops them with SIGTERM, then
SIGKILL after a grace. Edges run with ``on_shutdown=keep``: a restarted edge (same node, same
edge id, same state directory) re-adopts its sandboxes; undeploy stops the sandboxes through
each edge's API first unless asked to keep them. Every actor has ``max_restarts=-1``: one that
Ray restarts (its worker died) takes over, a group stopping a process still serving its address
and starting its services again, the deployment finding its groups again by name.

Addresses: every service listens on its node's IP at a fixed port (the API server 7100, IAM
7101, placement 7102, the watcher 7103, the live view 7104, an edge 7110, the second API
server 7121 and its view 7141, compat 7130 and SandboxFusion 7131). An edge's id is derived
from its node's IP (``n010001002003`` for 10.1.2.3), so it is the same after any restart, and
its node-local directories (state, network claims, eBPF pins) are keyed by that id: several
Ray nodes sharing one machine's file system (a test's lab) never collide. The layer store
(``--layer-store``) is a shared file system mounted at the same path on every node.

ADDRESS is a Ray Client address ``ray://host:port`` (the head's client server, 10001 by
default: works from any machine that reaches the head) or a GCS address ``host:port`` (6379 by
default: the caller must itself be a Ray node, whose object store the driver uses). It is
checked with a bounded TCP connection before ``ray.init``, which can hang on an address that
does not answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dsecctl.cluster import (
    METRICS_PORTS,
    EdgeSpec,
    ServiceProcess,
    VipPlan,
    Wiring,
    find_service_pid,
    log_tail,
    release_edge,
    serve_metrics,
    service_health,
    stop_edge_sandboxes,
    wait_edges_healthy,
)
from libdsec.errors import AlreadyExists, DSecError, InvalidArgument, NotFound, Unavailable

log = logging.getLogger(__name__)

NAMESPACE = "dsec"
DEPLOYMENT = "dsec-deployment"
CONTROL = "dsec-control"
SECOND_APISERVER = "dsec-apiserver1"
EDGE_PREFIX = "dsec-edge-"

#: The fixed ports of the services on their node's IP (``dsec up``'s defaults).
PORTS = {
    "apiserver": 7100,
    "iam": 7101,
    "placement": 7102,
    "watcher": 7103,
    "viewer": 7104,
    "edge": 7110,
    "apiserver1": 7121,
    "viewer1": 7141,
    "compat": 7130,
    "sandbox_fusion": 7131,
}

#: How long the reachability check of ADDRESS may take before ``ray.init``.
CONNECT_TIMEOUT_S = 3.0
#: Back-off of a service that exits: doubled per quick exit up to the cap; a process that ran
#: ``BACKOFF_RESET_S`` starts again at the first step.
BACKOFF_FIRST_S, BACKOFF_MAX_S, BACKOFF_RESET_S = 1.0, 30.0, 30.0
#: How often the deployment compares the Ray nodes with its edges.
NODE_POLL_S = 1.0
#: SIGTERM to SIGKILL when a service is stopped (an edge with on_shutdown=keep ends at once).
STOP_GRACE_S = 30.0

# Variables Ray sets in its workers for their own scheduling (and every RAY_*): not the
# services' business (an edge looks for GPUs itself).
_RAY_ONLY_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "NEURON_RT_VISIBLE_CORES",
    "TPU_VISIBLE_CHIPS",
    "ONEAPI_DEVICE_SELECTOR",
    "OMP_NUM_THREADS",
)


@dataclass(frozen=True)
class DeploySettings:
    """What ``dsec deploy --ray`` was asked for (the CLI's options)."""

    #: Node-local root of every node: logs/, iam/ (SQLite, token), edges/<edge id>/.
    node_dir: str = "/var/lib/dsec-ray"
    #: The shared layer store, the same path on every node ("" = each edge's default).
    layer_store: str = ""
    #: IAM storage ("" = SQLite under the head node's node_dir; or postgresql://...).
    iam_database: str = ""
    #: More DSEC_EDGE_* for every edge (full names), applied last.
    edge_env: dict[str, str] = field(default_factory=dict)
    log_level: str = "INFO"
    compat: bool = True
    #: Seconds each group of services has to be SERVING (and edges healthy in the watcher).
    timeout_s: float = 120.0
    #: The API servers behind this virtual IP, announced over BGP to ``vip_router`` (the
    #: nodes' top-of-rack router; common/vip.py); "" = each at its node's address.
    vip: str = ""
    vip_router: str = ""
    vip_asn: int = 65100
    vip_router_asn: int = 65000

    def vip_problem(self) -> str:
        """Why the virtual IP settings cannot work ("" = they can, or there is none)."""
        if not self.vip and not self.vip_router:
            return ""
        try:
            ipaddress.IPv4Address(self.vip)
            ipaddress.IPv4Address(self.vip_router)
        except ValueError:
            return (
                f"--vip and --vip-router go together, each an IPv4 address"
                f" (got {self.vip!r} and {self.vip_router!r})"
            )
        return ""

    def vip_plan(self) -> VipPlan | None:
        if not self.vip:
            return None
        return VipPlan(
            self.vip, self.vip_router, PORTS["apiserver"], self.vip_asn, self.vip_router_asn
        )


def edge_id_for(ip: str) -> str:
    """The edge id of the node at ``ip`` (``[a-z0-9]{1,16}``, stable across restarts):
    ``n`` and the four octets as three digits each; an IPv6 node, ``n`` and 15 hex digits of
    its address's hash."""
    addr = ipaddress.ip_address(ip)
    if addr.version == 4:
        return "n" + "".join(f"{int(o):03d}" for o in str(addr).split("."))
    return "n" + hashlib.sha256(addr.packed).hexdigest()[:15]


# ------------------------------------------------------------------ the caller's side


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of ADDRESS: ``ray://host[:port]`` (port 10001 by default) or
    ``host:port``; InvalidArgument otherwise."""
    client = address.startswith("ray://")
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep:
        host, port = rest, "10001" if client else ""
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(
            f"Ray address {address!r}: expected ray://HOST:PORT (Ray Client) or HOST:PORT (GCS)",
            reason="BAD_RAY_ADDRESS",
            metadata={"address": address},
        )
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Unavailable (RAY_UNREACHABLE) unless a TCP connection to ADDRESS opens within
    ``timeout_s``: ``ray.init`` on an address that does not answer can hang for minutes."""
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as exc:
        what = "Ray Client server" if address.startswith("ray://") else "Ray GCS"
        raise Unavailable(
            f"cannot reach the {what} at {address}: {exc.strerror or exc}"
            f" (checked with a {timeout_s:.0f} s TCP connect; nothing was started)",
            reason="RAY_UNREACHABLE",
            metadata={"address": address},
        ) from None


#: How long ``ray.init`` may take once the address answers (something that accepts TCP but is
#: not Ray, e.g. a proxy, makes Ray's own GCS client retry for 20 s and more).
INIT_TIMEOUT_S = 15.0


@contextlib.contextmanager
def connected(address: str) -> Iterator[None]:
    """``ray.init`` on ADDRESS in the namespace ``dsec`` (after :func:`check_reachable`,
    bounded by INIT_TIMEOUT_S), ``ray.shutdown`` on exit. A Ray Client connection whose server
    process dies while it starts (ray-project/ray#63202, a gRPC fork race in the client
    proxier) is tried again."""
    check_reachable(address)
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "error")  # no GCS retry lines on stderr
    for attempt in range(3):
        failure = _init_bounded(address)
        if failure is None:
            break
        if not isinstance(failure, ConnectionAbortedError) or attempt == 2:
            raise Unavailable(
                f"cannot connect to the Ray cluster at {address}: {failure}",
                reason="RAY_CONNECT_FAILED",
                metadata={"address": address},
            ) from failure
        time.sleep(1.0)
    try:
        yield
    finally:
        ray.shutdown()


def _init_bounded(address: str) -> BaseException | None:
    """``ray.init`` in a thread, waited for INIT_TIMEOUT_S: None when connected, else what
    went wrong (a hung init is left behind in its daemon thread; the CLI exits)."""
    outcome: list[BaseException | None] = []

    def init() -> None:
        try:
            ray.init(
                address=address,
                namespace=NAMESPACE,
                logging_level=logging.ERROR,
                log_to_driver=False,
            )
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=init, daemon=True)
    t.start()
    t.join(INIT_TIMEOUT_S)
    if not outcome:
        return TimeoutError(f"ray.init did not return within {INIT_TIMEOUT_S:.0f} s")
    return outcome[0]


def _actor_options(name: str, node_id: str) -> dict[str, Any]:
    """Every dsec actor: named in dsec's namespace, detached (outlives the deploying driver),
    asking for no CPU, restarted by Ray on its node whenever its worker dies."""
    return {
        "name": name,
        "namespace": NAMESPACE,
        "lifetime": "detached",
        "num_cpus": 0,
        "max_concurrency": 8,
        "max_restarts": -1,
        "scheduling_strategy": _pinned(node_id),
    }


def _get_actor(name: str) -> Any:
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def deploy(address: str, settings: DeploySettings) -> dict[str, Any]:
    """Deploys dsec on the Ray cluster at ``address``; returns the deployment's status (with
    ``token``: the bootstrap admin token). AlreadyExists when dsec is deployed there."""
    with connected(address):
        existing = _get_actor(DEPLOYMENT)
        if existing is not None:
            raise _already(address, _get(existing.info.remote(), timeout_s=30))
        try:
            dep: Any = (
                ray.remote(Deployment)
                .options(**_actor_options(DEPLOYMENT, _head_node()["NodeID"]))
                .remote(asdict(settings), address, time.time())
            )
        except ValueError:  # another deploy created it between the check and here
            raise _already(address, {}) from None
        try:
            return dict(_get(dep.deploy.remote(), timeout_s=settings.timeout_s * 4))
        except BaseException:
            # Nothing half-deployed stays: what started is stopped, every actor killed.
            with contextlib.suppress(Exception):
                ray.get(dep.undeploy.remote(False), timeout=120)
            ray.kill(dep, no_restart=True)
            raise


def _get(ref: Any, timeout_s: float) -> Any:
    """``ray.get``, with what a remote call raised re-raised as itself (a service that did not
    start: RuntimeError or TimeoutError with its log's tail) rather than Ray's wrapper with
    the actor's traceback; Ray's own failures (an actor that died) as RuntimeError."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, DSecError | TimeoutError | RuntimeError | OSError):
            raise cause from None
        raise RuntimeError(f"{type(cause).__name__}: {cause}") from None
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"no answer from the deployment within {timeout_s:.0f} s") from None
    except ray.exceptions.RayError as exc:
        raise RuntimeError(str(exc).splitlines()[0]) from None


def _already(address: str, info: dict[str, Any]) -> AlreadyExists:
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info.get("created_at", 0)))
    what = (
        f" (since {since}; API server {info.get('apiserver', '?')}, edges"
        f" {', '.join(info.get('edges', [])) or 'none'})"
        if info
        else ""
    )
    return AlreadyExists(
        f"dsec is already deployed on the Ray cluster at {address}{what}:"
        f" `dsec undeploy --ray {address}` first",
        reason="ALREADY_DEPLOYED",
        metadata={"address": address, "deployment": f"{NAMESPACE}/{DEPLOYMENT}"},
    )


def _not_deployed(address: str) -> NotFound:
    return NotFound(
        f"dsec is not deployed on the Ray cluster at {address}"
        f" (no actor {DEPLOYMENT} in the Ray namespace {NAMESPACE})",
        reason="NOT_DEPLOYED",
        metadata={"address": address},
    )


def undeploy(address: str, keep_sandboxes: bool = False) -> dict[str, Any]:
    """Stops every service and actor of the deployment on ``address``; NotFound when there
    is none. Returns what was stopped."""
    with connected(address):
        dep = _get_actor(DEPLOYMENT)
        if dep is None:
            raise _not_deployed(address)
        try:
            result = dict(_get(dep.undeploy.remote(keep_sandboxes), timeout_s=600))
        finally:
            ray.kill(dep, no_restart=True)
        # Actors of ours the deployment did not know (its own restart lost track of one).
        for name in ray.util.list_named_actors():
            if name.startswith("dsec-"):
                handle = _get_actor(name)
                if handle is not None:
                    with contextlib.suppress(Exception):
                        ray.get(handle.stop.remote(None, keep_sandboxes), timeout=120)
                    ray.kill(handle, no_restart=True)
        return result


def status(address: str) -> dict[str, Any]:
    """The deployment's status: its services, each with node, pid, restarts and health."""
    with connected(address):
        dep = _get_actor(DEPLOYMENT)
        if dep is None:
            raise _not_deployed(address)
        return dict(_get(dep.status.remote(), timeout_s=60))


# ------------------------------------------------------------------ nodes


def _alive_nodes() -> list[dict[str, Any]]:
    """Ray's live nodes, by IP."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return sorted(nodes, key=lambda n: ipaddress.ip_address(n["NodeManagerAddress"]))


def _head_node() -> dict[str, Any]:
    nodes = _alive_nodes()
    if not nodes:
        raise Unavailable("the Ray cluster has no live node", reason="RAY_NO_NODES")
    heads = [n for n in nodes if "node:__internal_head__" in n.get("Resources", {})]
    return (heads or nodes)[0]


def _pinned(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


# ------------------------------------------------------------------ supervision


@dataclass
class _Supervised:
    """One service process and its history under a :class:`ServiceGroup`."""

    spec: ServiceProcess
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    #: When a process that exited is started again (0: not waiting).
    restart_at: float = 0.0
    backoff_s: float = BACKOFF_FIRST_S
    last_exit: int | None = None
    stopped: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else 0


class ServiceGroup:
    """A Ray actor (threaded) owning the service processes of one group on its node (module
    doc): started in order, restarted when they exit, stopped on request."""

    def __init__(self, group: str, specs: list[ServiceProcess]) -> None:
        self.group = group
        self.node_ip = ray.util.get_node_ip_address()
        self.services = [_Supervised(s) for s in specs]
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        for s in specs:
            s.log_path.parent.mkdir(parents=True, exist_ok=True)
        if ray.get_runtime_context().was_current_actor_reconstructed:
            # Ray restarted this actor (its worker died): take the services over again.
            threading.Thread(target=self._restart_all, daemon=True).start()

    def _restart_all(self) -> None:
        try:
            self.start(STOP_GRACE_S * 4)
        except Exception:
            log.exception("%s: services not taken over after the actor's restart", self.group)

    def start(self, timeout_s: float) -> list[dict[str, Any]]:
        """Starts every service (a process still serving its address is stopped first) and
        waits until all are SERVING; IAM first, before the others start."""
        with self._lock:
            for s in self.services:
                self._take_over(s.spec)
                self._spawn(s)
                if s.spec.module == "iam":
                    self._wait_serving([s], timeout_s)
            self._wait_serving(self.services, timeout_s)
            if self._monitor is None:
                self._monitor = threading.Thread(target=self._supervise, daemon=True)
                self._monitor.start()
        return self.status()

    def _take_over(self, spec: ServiceProcess) -> None:
        pid = find_service_pid(spec)
        if pid and pid != os.getpid():
            log.warning("%s: stopping pid %d left serving %s", spec.name, pid, spec.address)
            _terminate(pid, STOP_GRACE_S)

    def _spawn(self, s: _Supervised) -> None:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in _RAY_ONLY_ENV and not k.startswith("RAY_")
        }
        env.update(s.spec.env)
        env["PYTHONUNBUFFERED"] = "1"
        with open(s.spec.log_path, "ab") as log_fh:
            s.proc = subprocess.Popen(
                [sys.executable, "-m", s.spec.module],
                env=env,
                stdout=log_fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        s.started_at = time.monotonic()
        s.restart_at = 0.0
        s.stopped = False

    def _wait_serving(self, services: list[_Supervised], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(services)
        while pending:
            for s in list(pending):
                if s.proc is not None and s.proc.poll() is not None:
                    raise RuntimeError(
                        f"{s.spec.name} on {self.node_ip} exited with {s.proc.returncode}:\n"
                        + log_tail(s.spec.log_path)
                    )
                if service_health(s.spec, timeout_s=1.0) == "SERVING":
                    pending.remove(s)
            if pending and time.monotonic() > deadline:
                names = ", ".join(s.spec.name for s in pending)
                tails = "\n".join(
                    f"--- {s.spec.name}\n{log_tail(s.spec.log_path)}" for s in pending
                )
                raise TimeoutError(f"not SERVING after {timeout_s:.0f} s: {names}\n{tails}")
            if pending:
                time.sleep(0.1)

    def _supervise(self) -> None:
        """Restarts a service that exited, after its back-off; until the group stops."""
        while not self._stopping.wait(0.2):
            with self._lock:
                now = time.monotonic()
                for s in self.services:
                    if s.stopped or s.proc is None:
                        continue
                    code = s.proc.poll()
                    if code is None:
                        continue
                    if not s.restart_at:
                        ran = now - s.started_at
                        s.backoff_s = (
                            BACKOFF_FIRST_S
                            if ran >= BACKOFF_RESET_S or not s.restarts
                            else min(s.backoff_s * 2, BACKOFF_MAX_S)
                        )
                        s.last_exit = code
                        s.restart_at = now + s.backoff_s
                        log.warning(
                            "%s exited with %s after %.1f s; restarting in %.0f s",
                            s.spec.name,
                            code,
                            ran,
                            s.backoff_s,
                        )
                    elif now >= s.restart_at:
                        self._spawn(s)
                        s.restarts += 1

    def status(self) -> list[dict[str, Any]]:
        """Each service: name, node, address, pid, restarts, state, health, log."""
        rows = []
        for s in self.services:
            if s.stopped:
                state = "STOPPED"
            elif s.restart_at:
                state = "BACKOFF"
            else:
                state = "RUNNING" if s.pid else "STARTING"
            rows.append(
                {
                    "name": s.spec.name,
                    "group": self.group,
                    "node": self.node_ip,
                    "actor_pid": os.getpid(),
                    "address": s.spec.address,
                    "protocol": s.spec.protocol,
                    **({"metrics": f"http://{s.spec.metrics}/metrics"} if s.spec.metrics else {}),
                    "pid": s.pid,
                    "restarts": s.restarts,
                    "state": state,
                    "health": service_health(s.spec, timeout_s=1.0) if s.pid else "DOWN",
                    "last_exit": s.last_exit,
                    "log": str(s.spec.log_path),
                }
            )
        return rows

    def token(self) -> str:
        """The bootstrap admin token IAM wrote (this group runs IAM)."""
        iam = next(s for s in self.services if s.spec.module == "iam")
        return Path(iam.spec.env["DSEC_IAM_BOOTSTRAP_TOKEN_FILE"]).read_text().strip()

    def stop(self, names: list[str] | None, keep_sandboxes: bool) -> list[dict[str, Any]]:
        """Stops the services ``names`` (None: all, and the supervision), in reverse start
        order: SIGTERM, SIGKILL after a grace. An edge's sandboxes are stopped first through
        its API unless ``keep_sandboxes``; then what the edge left (cgroups, mounts) is released."""
        if names is None:
            self._stopping.set()
        with self._lock:
            chosen = [s for s in self.services if names is None or s.spec.name in names]
            for s in reversed(chosen):
                s.stopped = True
                if s.spec.module == "edge" and not keep_sandboxes and s.pid:
                    stop_edge_sandboxes(s.spec.address)
                if s.proc is not None and s.proc.poll() is None:
                    s.proc.terminate()
                    try:
                        s.proc.wait(timeout=STOP_GRACE_S)
                    except subprocess.TimeoutExpired:
                        s.proc.kill()
                        s.proc.wait()
                if s.spec.module == "edge" and not keep_sandboxes:
                    release_edge(s.spec)
                    _remove_claim_dir(Path(s.spec.env["DSEC_EDGE_NET_CLAIM_DIR"]))
            return self.status()


def _remove_claim_dir(claims: Path) -> None:
    """The network claim directory of an edge that stopped with its sandboxes: nothing in it
    is live any more, and /run should not collect one per edge id ever deployed. A claim left
    in it (a directory shared with another edge through --edge-env) keeps the directory."""
    with contextlib.suppress(OSError):
        (claims / ".lock").unlink(missing_ok=True)
        claims.rmdir()


def _terminate(pid: int, grace_s: float) -> None:
    """SIGTERM to ``pid`` (not our child: a process a previous supervisor left), SIGKILL when
    it is still there after ``grace_s``."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or _zombie(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


# ------------------------------------------------------------------ the deployment


class Deployment:
    """The deployment actor (module doc): places the groups, adds and drops edges as nodes
    join and leave, reports status, undeploys."""

    def __init__(self, settings: dict[str, Any], address: str, created_at: float) -> None:
        # Ray passes the same arguments again when it restarts this actor.
        self.settings = DeploySettings(**settings)
        self.address = address
        self.created_at = created_at
        self.node_dir = Path(self.settings.node_dir)
        #: Group actor name -> (handle, node id).
        self.groups: dict[str, tuple[Any, str]] = {}
        self.wiring: Wiring | None = None
        self.apiserver = ""
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None
        #: Nodes whose edge failed to start, with when it is tried again.
        self._retry_at: dict[str, float] = {}
        self.events: list[str] = []
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._recover()

    # ---- placement

    def _wiring(self, head_ip: str) -> Wiring:
        return Wiring(
            iam=f"{head_ip}:{PORTS['iam']}",
            watcher=f"{head_ip}:{PORTS['watcher']}",
            placement=f"{head_ip}:{PORTS['placement']}",
            log_dir=self.node_dir / "logs",
            log_level=self.settings.log_level,
        )

    def _edge_process(self, ip: str) -> ServiceProcess:
        assert self.wiring is not None
        edge_id = edge_id_for(ip)
        extra = {
            "DSEC_EDGE_NET_CLAIM_DIR": f"/run/dsec/ray/{edge_id}",
            "DSEC_EDGE_BPF_PIN_DIR": f"/sys/fs/bpf/dsec-ray/{edge_id}",
            # A shared store: each layer hashed once for the cluster, not on every node
            # (edge.layers.node, verify="store"); --edge-env may say otherwise.
            **(
                {
                    "DSEC_EDGE_LAYER_STORE": self.settings.layer_store,
                    "DSEC_EDGE_LAYER_VERIFY": "store",
                }
                if self.settings.layer_store
                else {}
            ),
            **self.settings.edge_env,
        }
        # Labelled with its id: a create can ask for this node (node_selector={"node": id}).
        spec = EdgeSpec(
            edge_id=edge_id, runtime="container", labels={"node": edge_id}, extra_env=extra
        )
        home = hashlib.sha1(str(self.node_dir).encode()).hexdigest()[:8]
        edge = self.wiring.edge(
            spec,
            f"{ip}:{PORTS['edge']}",
            state_dir=self.node_dir / "edges" / edge_id,
            # A stop is a restart or a node leaving: the sandboxes stay (undeploy stops them).
            on_shutdown="keep",
            cgroup_parent=f"dsec-{edge_id}-{home}",
        )
        return serve_metrics(edge, f"{ip}:{METRICS_PORTS['edge']}")

    def _behind_vip(self, p: ServiceProcess) -> ServiceProcess:
        """An API server announcing the deployment's virtual IP, if it has one."""
        vip = self.settings.vip_plan()
        return Wiring.behind_vip(p, vip, self.node_dir / "vip" / p.name) if vip else p

    def _group(self, name: str, node_id: str, specs: list[ServiceProcess]) -> Any:
        handle = (
            ray.remote(ServiceGroup).options(**_actor_options(name, node_id)).remote(name, specs)
        )
        self.groups[name] = (handle, node_id)
        return handle

    def deploy(self) -> dict[str, Any]:
        """Starts the control plane, the second API server and one edge per node; waits until
        every edge is healthy in the watcher; then watches the nodes."""
        t = self.settings.timeout_s
        with self._lock:
            nodes = _alive_nodes()
            head = _head_node()
            head_ip = head["NodeManagerAddress"]
            self.wiring = w = self._wiring(head_ip)
            vip = self.settings.vip_plan()
            first = f"{head_ip}:{PORTS['apiserver']}"
            self.apiserver = vip.target if vip else first
            control = w.control_plane(
                database=self.settings.iam_database or f"sqlite:{self.node_dir / 'iam' / 'iam.db'}",
                token_file=self.node_dir / "iam" / "token",
            )
            for p in control:
                serve_metrics(p, f"{head_ip}:{METRICS_PORTS[p.name]}")
            control.append(
                serve_metrics(
                    self._behind_vip(
                        w.apiserver("apiserver", first, viewer=f"{head_ip}:{PORTS['viewer']}")
                    ),
                    f"{head_ip}:{METRICS_PORTS['apiserver']}",
                )
            )
            if self.settings.compat:
                control.append(
                    serve_metrics(
                        w.compat(
                            f"{head_ip}:{PORTS['compat']}",
                            fusion=f"{head_ip}:{PORTS['sandbox_fusion']}",
                            apiserver=self.apiserver,
                        ),
                        f"{head_ip}:{METRICS_PORTS['compat']}",
                    )
                )
            ray.get(self._group(CONTROL, head["NodeID"], control).start.remote(t))
            starts = []
            others = [n for n in nodes if n["NodeID"] != head["NodeID"]]
            if others:
                ip = others[0]["NodeManagerAddress"]
                # Behind a virtual IP every instance listens on the same port.
                port = PORTS["apiserver"] if vip else PORTS["apiserver1"]
                second = serve_metrics(
                    self._behind_vip(
                        w.apiserver("apiserver1", f"{ip}:{port}", viewer=f"{ip}:{PORTS['viewer1']}")
                    ),
                    f"{ip}:{METRICS_PORTS['apiserver'] + 1}",
                )
                starts.append(
                    self._group(SECOND_APISERVER, others[0]["NodeID"], [second]).start.remote(t)
                )
            for n in nodes:
                ip = n["NodeManagerAddress"]
                group = self._group(
                    EDGE_PREFIX + edge_id_for(ip), n["NodeID"], [self._edge_process(ip)]
                )
                starts.append(group.start.remote(t))
            ray.get(starts)
            wait_edges_healthy(w.watcher, {edge_id_for(n["NodeManagerAddress"]) for n in nodes}, t)
            self._watch = threading.Thread(target=self._watch_nodes, daemon=True)
            self._watch.start()
        return self.status()

    def _recover(self) -> None:
        """After Ray restarted this actor: the groups are found again by name, and the
        watch goes on."""
        for name in ray.util.list_named_actors():
            if name.startswith(EDGE_PREFIX) or name in (CONTROL, SECOND_APISERVER):
                handle = _get_actor(name)
                if handle is None:
                    continue
                rows = ray.get(handle.status.remote(), timeout=30)
                node = next(
                    (
                        n["NodeID"]
                        for n in _alive_nodes()
                        if n["NodeManagerAddress"] == rows[0]["node"]
                    ),
                    "",
                )
                self.groups[name] = (handle, node)
                if name == CONTROL:
                    head_ip = rows[0]["node"]
                    self.wiring = self._wiring(head_ip)
                    vip = self.settings.vip_plan()
                    self.apiserver = vip.target if vip else f"{head_ip}:{PORTS['apiserver']}"
        self._watch = threading.Thread(target=self._watch_nodes, daemon=True)
        self._watch.start()

    def _watch_nodes(self) -> None:
        while not self._stopping.wait(NODE_POLL_S):
            try:
                self._reconcile_nodes()
            except Exception:  # a GCS hiccup: next round
                log.exception("node watch")

    def _reconcile_nodes(self) -> None:
        alive = {n["NodeID"]: n for n in _alive_nodes()}
        joined: list[tuple[str, str, Any]] = []
        with self._lock:
            if self._stopping.is_set():
                return
            for name, (handle, node_id) in list(self.groups.items()):
                if node_id not in alive:
                    # Its node left: the actor is gone with it (the watcher declares the edge
                    # lost once it stops answering).
                    del self.groups[name]
                    with contextlib.suppress(Exception):
                        ray.kill(handle, no_restart=True)
                    self._event(f"node of {name} left; actor dropped")
            have = {node for name, (_, node) in self.groups.items() if name.startswith(EDGE_PREFIX)}
            for node_id, n in alive.items():
                if node_id in have or self._retry_at.get(node_id, 0) > time.monotonic():
                    continue
                ip = n["NodeManagerAddress"]
                name = EDGE_PREFIX + edge_id_for(ip)
                self._event(f"node {ip} joined: starting {name}")
                joined.append((name, node_id, self._group(name, node_id, [self._edge_process(ip)])))
        # Outside the lock: status answers while a new edge starts.
        for name, node_id, group in joined:
            try:
                ray.get(group.start.remote(self.settings.timeout_s))
                assert self.wiring is not None
                wait_edges_healthy(
                    self.wiring.watcher,
                    {name.removeprefix(EDGE_PREFIX)},
                    self.settings.timeout_s,
                )
                self._retry_at.pop(node_id, None)
                self._event(f"{name} SERVING, healthy in the watcher")
            except Exception as exc:
                self._event(f"{name} failed to start: {exc}")
                with self._lock:
                    self.groups.pop(name, None)
                with contextlib.suppress(Exception):
                    ray.get(group.stop.remote(None, True), timeout=60)
                ray.kill(group, no_restart=True)
                self._retry_at[node_id] = time.monotonic() + 30

    def _event(self, text: str) -> None:
        log.info("%s", text)
        self.events = [*self.events[-49:], f"{time.strftime('%H:%M:%S')} {text}"]

    # ---- reports

    def info(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "created_at": self.created_at,
            "actor_pid": os.getpid(),
            "apiserver": self.apiserver,
            "edges": sorted(
                n.removeprefix(EDGE_PREFIX) for n in self.groups if n.startswith(EDGE_PREFIX)
            ),
            "settings": asdict(self.settings),
        }

    def status(self) -> dict[str, Any]:
        """The deployment and each service (``services``), with the admin token."""
        groups = list(self.groups.copy().items())
        refs = {name: handle.status.remote() for name, (handle, _) in groups}
        services: list[dict[str, Any]] = []
        for name, ref in refs.items():
            try:
                services += ray.get(ref, timeout=30)
            except Exception as exc:
                services.append(
                    {"name": name, "group": name, "state": "UNREACHABLE", "error": str(exc)}
                )
        token = ""
        if CONTROL in self.groups:
            with contextlib.suppress(Exception):
                token = ray.get(self.groups[CONTROL][0].token.remote(), timeout=30)
        control = [s for s in services if s.get("group") == CONTROL]
        compat = next((s for s in control if s["name"] == "compat"), None)
        return {
            **self.info(),
            "token": token,
            "services": services,
            "events": list(self.events),
            **(
                {
                    "e2b_api_url": f"http://{compat['address']}",
                    "sandbox_fusion_url": "http://{}:{}".format(
                        compat["address"].rsplit(":", 1)[0], PORTS["sandbox_fusion"]
                    ),
                }
                if compat
                else {}
            ),
        }

    def undeploy(self, keep_sandboxes: bool) -> dict[str, Any]:
        """Front ends first (no new work), then the edges (their sandboxes first unless
        ``keep_sandboxes``), then the control plane; every group actor is killed."""
        self._stopping.set()
        with self._lock:
            stopped: list[dict[str, Any]] = []
            control = self.groups.get(CONTROL)
            second = self.groups.get(SECOND_APISERVER)
            front = []
            if control is not None:
                front.append(control[0].stop.remote(["compat", "apiserver"], keep_sandboxes))
            if second is not None:
                front.append(second[0].stop.remote(None, keep_sandboxes))
            results = _get_all(front)
            if second is not None:
                stopped += results[-1]  # the control group's rows come with its full stop
            edges = [h for n, (h, _) in self.groups.items() if n.startswith(EDGE_PREFIX)]
            for rows in _get_all([h.stop.remote(None, keep_sandboxes) for h in edges]):
                stopped += rows
            if control is not None:
                stopped += _get_all([control[0].stop.remote(None, keep_sandboxes)])[0] or []
            for handle, _ in self.groups.values():
                with contextlib.suppress(Exception):
                    ray.kill(handle, no_restart=True)
            names = sorted(self.groups)
            self.groups.clear()
        return {"groups": names, "services": stopped}


def _get_all(refs: list[Any], timeout_s: float = 300.0) -> list[Any]:
    """Each ref's value, or [] for one whose actor is gone."""
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=timeout_s))
        except Exception as exc:
            log.warning("undeploy: %s", exc)
            out.append([])
    return out
