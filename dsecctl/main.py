"""The ``dsec`` command: run a local cluster and operate it.

    dsec up [--edges N] [--apiservers N] [--iam-database URL]
                                                     start iam, watcher, placement, edges, apiservers
                                                     under supervisord; on a running cluster, start
                                                     only what is down
    dsec status                                      health, supervisor state, restarts
    dsec restart [SERVICE...]                        one at a time; sandboxes keep running
    dsec down [--keep-sandboxes]                     stop sandboxes and services
    dsec deploy --ray ADDRESS [--layer-store PATH] [--iam-database URL] [--edge-env K=V]...
                                                     dsec on a Ray cluster: control plane on the
                                                     head, an edge per node (dsecctl/ray_deploy.py)
    dsec deploy --ray ADDRESS --status               each service: node, pid, restarts, health
    dsec undeploy --ray ADDRESS [--keep-sandboxes]   stop every service and sandbox of it
    dsec whoami
    dsec project create NAME [--parent P] [--cpu-millis N] [--memory-mb N] [--sandboxes N]
    dsec project list [--recursive] | dsec project show [ID] | dsec project quota ID [--sandboxes N ...]
    dsec project delete ID                           an empty one; its tokens are revoked
    dsec token create NAME [--project P] [--agent] [--admin] [--ttl-s N] [--e2b]
    dsec token list | dsec token revoke ID
    dsec sandbox create|list|show|exec|shell|cp|logs|ps|pause|resume|stop|watch|pack ...
                                                     see dsecctl/sandbox_cli.py and docs/CLI.md
    dsec task pause|resume|stop TASK_ID [--label k=v]... [--preempted] [--grace-s S] [--json]
                                                     every sandbox of a task: one line each
    dsec env list [PREFIX] | dsec env show NAME | dsec env layers | dsec env rm NAME
    dsec env import SOURCE [--name N] [--kind K] [--base B]   docker:REF, dir:/path, tar:/path
    dsec env compose NAME --base B [--workspace W] [--toolkit T]...
    dsec fncall -l LANG (-c CODE | -f FILE) [--stdin-file F | --cases GLOB]   short jobs in warm pools
    dsec grpc [ADDRESS] list [SERVICE] | describe SYMBOL | METHOD [-d JSON]
                                                     any service, over gRPC reflection
    dsec node list | dsec node drain NAME [--reason R] | dsec node undrain NAME
                                                     the cluster's nodes (operators)
    dsec top [--interval S] [--once] [--task T]      nodes, sandboxes per task, state changes,
                                                     terminations, refreshing (dsecctl/top.py)
    dsec demo                                        a short tour through libdsec

Every command that prints data takes --json; a failure exits non-zero with one line on stderr
naming the command and the error (docs/CLI.md is the reference).

The local cluster lives in $DSEC_HOME (default ~/.dsec): cluster.json (addresses and logs, no
PIDs: `dsec status --json` has the current ones), token (0600), logs/, and each service's state.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time
from typing import Any

from dsecctl.cli_common import (
    client,
    error_json,
    json_option,
    key_value,
    label_option,
    print_env,
    print_json,
    progress,
    run_command,
    size_text,
)
from dsecctl.cluster import EdgeSpec, LocalCluster, VipPlan
from dsecctl.fncall import add_parser as add_fncall_parser
from dsecctl.grpc_cli import add_parser as add_grpc_parser
from dsecctl.host_daemons import HostDaemonError, daemons_for_vm, vm_mode
from dsecctl.hosts import HostLabError
from dsecctl.node_cli import add_parser as add_node_parser
from dsecctl.node_cli import list_nodes, node_lines, node_row
from dsecctl.ray_home import forget_home, recorded_deployment, write_home
from dsecctl.sandbox_cli import add_parser as add_sandbox_parser
from dsecctl.supervisor import UP_STATES
from dsecctl.top import add_parser as add_top_parser
from dsecctl.vip_router import (
    LocalVip,
    VipRouterError,
    local_vip_state,
    next_hops_in,
    remove_local_vip,
)
from libdsec._config import dsec_home


def _refuse_ray_home(what: str) -> int:
    """`dsec up/down/restart` on a $DSEC_HOME that points at a Ray deployment: 2, with why
    (0: it does not)."""
    address = recorded_deployment(dsec_home())
    if not address:
        return 0
    print(
        f"dsec {what}: $DSEC_HOME ({dsec_home()}) points at the dsec deployed on the Ray cluster"
        f" at {address}, not a local cluster: `dsec deploy --ray {address} --status`,"
        f" `dsec undeploy --ray {address}`, or another DSEC_HOME",
        file=sys.stderr,
    )
    return 2


def cmd_up(args: argparse.Namespace) -> int:
    if _refuse_ray_home("up"):
        return 2
    home = dsec_home()
    running = LocalCluster.from_state(home)
    if running is not None and running.supervised and running.supervisor.pid():
        return _up_partial(running, args.timeout)
    if running is not None:
        # Left by an older dsec (unsupervised) or without its supervisord: stop what is left
        # of it; supervised edges keep their sandboxes, and the new edges re-adopt them.
        print("stopping what is left of the previous cluster ...", flush=True)
        running.stop(keep_sandboxes=True)
    # A few warm busybox sandboxes per edge (README "Warm sandboxes"); DSEC_EDGE_WARM_POOL
    # in the environment replaces this ("" for none).
    warm = {"DSEC_EDGE_WARM_POOL": os.environ.get("DSEC_EDGE_WARM_POOL", "busybox=4")}
    # Edges offering VMs (DSEC_EDGE_VM, default auto) need libvirtd and virtlogd: those not
    # running are started and supervised with the services (dsecctl/host_daemons.py).
    try:
        daemons = daemons_for_vm(vm_mode(os.environ), home / "daemons")
    except HostDaemonError as exc:
        print(f"dsec: {exc}", file=sys.stderr)
        return 2
    edges = [
        EdgeSpec(edge_id=f"edge{i}", runtime="container", extra_env=dict(warm))
        for i in range(args.edges)
    ]
    local_vip: LocalVip | None = None
    if args.vip:
        try:
            local_vip = LocalVip.start(home, args.apiservers)
        except (VipRouterError, HostLabError) as exc:
            print(f"dsec: cannot put the API servers behind a virtual IP: {exc}", file=sys.stderr)
            return 2
    cluster = LocalCluster(
        home,
        transport="tcp",
        fixed_ports=True,
        port_base=args.port_base,
        edges=edges,
        apiservers=args.apiservers,
        log_level=args.log_level,
        iam_database=args.iam_database,
        supervised=True,
        host_daemons=daemons,
        hosts=local_vip.hosts() if local_vip else None,
        vip=(
            VipPlan(local_vip.vip, local_vip.router.host.address, args.port_base)
            if local_vip
            else None
        ),
        bind=local_vip.bind if local_vip else "127.0.0.1",
    )
    print(f"starting dsec in {home} (services supervised by supervisord) ...", flush=True)
    try:
        cluster.start(timeout_s=args.timeout)
    except BaseException:
        remove_local_vip(home)
        raise
    _print_services(cluster)
    if local_vip is not None:
        hops = local_vip.router.wait_next_hops(
            local_vip.vip, {h.address for h in local_vip.hosts().values()}
        )
        print(
            f"\nvirtual IP {cluster.apiserver}: {args.apiservers} API servers announce it over"
            f" BGP to the router {local_vip.router.host.address} (FRR, ECMP; routes in"
            f" {hops:.1f} s)"
        )
    print(f"\nAPI server: {cluster.apiserver}\nadmin token: {cluster.token_file} (0600)\n")
    print("connect:  python -c 'from libdsec import Client; print(Client().whoami())'")
    if cluster.compat:
        print(
            f"e2b SDK:  export E2B_API_URL={cluster.compat_url} E2B_SANDBOX_URL={cluster.compat_url}"
            " E2B_API_KEY=$(dsec token create me --e2b)"
        )
        print(
            f"verl:     sandbox_fusion_url={cluster.sandbox_fusion_url}/t/$(dsec token create verl"
            " --agent)/run_code"
        )
    print("gRPC:     dsec grpc list   (any service: dsec grpc ADDRESS list; dsec grpc --help)")
    return 0


def _up_partial(cluster: LocalCluster, timeout_s: float) -> int:
    """``dsec up`` on a running cluster: starts only the services that are down (a FATAL
    one gets a fresh series of attempts); the others, and every sandbox, are left alone."""
    states = {name: info.state for name, info in cluster.supervised_processes().items()}
    down = [p for p in cluster.processes if states[p.name] not in UP_STATES]
    if not down:
        print(f"dsec is already running (home {cluster.home}); `dsec status` to see it")
        return 0
    print(f"starting {', '.join(p.name for p in down)} (the rest is running) ...", flush=True)
    cluster.start_services(down, timeout_s)
    _print_services(cluster)
    return 0


def _print_services(cluster: LocalCluster) -> None:
    for name, state in cluster.status().items():
        p = cluster.process(name)
        print(f"  {name:<12} {state:<10} {p.address:<22} pid {p.pid}  log {p.log_path}")
    for name, state in cluster.checked_status().items():
        p = next(c for c in cluster.checked if c.name == name)
        print(f"  {name:<12} {state:<10} {p.address:<22} pid {p.pid}  {_NOT_OURS}")


#: A host daemon the cluster found running (scripts/setup.sh's): checked, never stopped.
_NOT_OURS = "not started by dsec: checked only"


def cmd_down(args: argparse.Namespace) -> int:
    if _refuse_ray_home("down"):
        return 2
    cluster = LocalCluster.from_state(dsec_home())
    if cluster is None:
        if remove_local_vip(dsec_home()):
            print("removed the virtual IP's router and hosts a stopped cluster left")
        print("dsec is not running")
        return 0
    cluster.stop(keep_sandboxes=args.keep_sandboxes)
    remove_local_vip(dsec_home())  # dsec up --vip: the router and the instances' hosts
    kept = " (sandboxes kept: the next `dsec up` re-adopts them)" if args.keep_sandboxes else ""
    print(f"dsec stopped{kept}")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    if _refuse_ray_home("restart"):
        return 2
    cluster = LocalCluster.from_state(dsec_home())
    if cluster is None or not cluster.supervised_processes():
        print("dsec is not running under its supervisor: `dsec up` first", file=sys.stderr)
        return 1
    names = [p.name for p in cluster.processes]
    unknown = [n for n in args.services if n not in names]
    if unknown:
        print(
            f"dsec: no service {', '.join(unknown)}; the services are: {', '.join(names)}",
            file=sys.stderr,
        )
        return 2
    # One at a time, in start order, each SERVING before the next: sandboxes keep running.
    for name in args.services or names:
        t0 = time.monotonic()
        cluster.restart(name, timeout_s=args.timeout)
        if name.startswith("edge-"):
            cluster.wait_edges_registered(args.timeout)
        print(
            f"  {name:<12} restarted in {time.monotonic() - t0:.1f} s, pid {cluster.process(name).pid}"
        )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    address = recorded_deployment(dsec_home())
    if address:
        return _print_deployment(address, args.json)
    cluster = LocalCluster.from_state(dsec_home())
    if cluster is None:
        if args.json:
            print_json({"running": False, "services": []})
        else:
            print("dsec is not running (no cluster.json)")
        return 1
    bad = 0
    status = cluster.status()
    supervised = cluster.supervised_processes()
    restarts = cluster.supervisor.restarts() if supervised else {}
    supervisor_down = cluster.supervised and not supervised
    if supervisor_down and not args.json:
        print("supervisord is not running: crashed services will not be restarted (`dsec up`)")
    bad += supervisor_down
    services = []
    for name, state in status.items():
        p = cluster.process(name)
        address = f"http://{p.address}" if p.protocol == "http" else p.address
        row: dict[str, Any] = {"name": name, "state": state, "address": address, "pid": p.pid}
        extra = ""
        if name in supervised:
            info = supervised[name]
            n = restarts.get(name, {}).get("restarts", 0)
            # supervisord's description: "pid 12, uptime 0:01:02", "Exited too quickly ..."
            row["supervisor"] = info.description
            row["restarts"] = n
            extra = f"  {info.description.removeprefix(f'pid {info.pid}, ')}; restarts {n}"
        bad += state != "SERVING"
        details: list[str] = []
        if name.startswith("edge-") and state == "SERVING":
            details = _pool_lines(p.address)
        elif state not in ("SERVING", "DOWN") and (name in supervised or state == "NOT_SERVING"):
            # BACKOFF, FATAL, NOT_SERVING (e.g. its virtual IP's routing daemon cannot
            # start), ...: why, from the service's own log
            details = [f"last lines of {p.log_path}:"] + [
                f" {line}" for line in cluster.log_tail(p, lines=10).splitlines()
            ]
        if p.metrics:
            row["metrics"] = f"http://{p.metrics}/metrics"
            details = [*details, f"metrics {row['metrics']}"]
        row["details"] = details
        services.append(row)
        if not args.json:
            print(f"{name:<12} {state:<12} {address:<22} pid {p.pid}{extra}")
            for line in details:
                print(f"{'':<12} {line}")
    for name, state in cluster.checked_status().items():
        p = next(c for c in cluster.checked if c.name == name)
        bad += state != "SERVING"
        services.append(
            {"name": name, "state": state, "address": p.address, "pid": p.pid, "checked": True}
        )
        if not args.json:
            print(f"{name:<12} {state:<12} {p.address:<22} pid {p.pid}  {_NOT_OURS}")
    vip = _vip_status(cluster)
    if vip is not None:
        bad += not vip["next_hops"]
        if not args.json:
            hops = ", ".join(vip["next_hops"]) or "none: no instance announces it"
            print(f"virtual IP {vip['address']} via router {vip['router']}: next hops {hops}")
    nodes, nodes_error = _nodes(cluster)
    if not args.json:
        print("nodes (as the watcher knows them):")
        for line in node_lines(nodes) if nodes_error is None else [nodes_error]:
            print(f"  {line}")
    queue_line = _queue_status(cluster)
    if not args.json:
        print(f"create queue: {queue_line}")
    # A node the watcher counts UNHEALTHY is a failure; not being able to ask (the API server
    # or watcher down: already a failed service above; a token that is not an operator's) is not.
    bad += any(node_row(n)["health"] == "UNHEALTHY" for n in nodes)
    if args.json:
        print_json(
            {
                "running": True,
                "supervisor_running": not supervisor_down,
                "services": services,
                "nodes": [node_row(n) for n in nodes],
                "nodes_error": nodes_error,
                "queue": queue_line,
                "vip": vip,
            }
        )
    return 1 if bad else 0


def _vip_status(cluster: LocalCluster) -> dict[str, Any] | None:
    """``dsec up --vip``: the virtual IP and the instances its route spreads over now."""
    state = local_vip_state(cluster.home)
    if state is None or cluster.vip is None:
        return None
    return {
        "address": cluster.vip.target,
        "router": cluster.vip.peer,
        "next_hops": next_hops_in(str(state["router"]), cluster.vip.address),
    }


def cmd_queue(args: argparse.Namespace) -> int:
    """``dsec queue``: creates waiting for room, per project and task."""
    with client() as c:
        q = c.queue(include_entries=args.entries)
    if args.json:
        print_json(q)
        return 0
    for line in queue_lines(q, args.entries):
        print(line)
    return 0


def queue_lines(q: Any, entries: bool = False) -> list[str]:
    lines = [f"{q.waiting} creates waiting (served by {q.dispatcher or 'no API server yet'})"]
    for g in q.groups:
        task = g.task_id or "-"
        lines.append(
            f"  {g.project_id:<24} task {task:<20} waiting {g.waiting:<6}"
            f" oldest {g.oldest_wait_s:.1f} s  weight {g.share_weight:g}"
        )
    for e in q.entries if entries else []:
        assert e.queue is not None
        lines.append(f"  #{e.queue.position:<5} {e.id}  {e.project_id}  {e.queue.reason}")
    return lines


def _queue_status(cluster: LocalCluster) -> str:
    from libdsec import Client
    from libdsec.errors import DSecError

    try:
        with Client(cluster.apiserver, token=cluster.token) as c:
            return queue_lines(c.queue())[0]
    except DSecError as err:
        return f"cannot read the create queue: [{err.reason}] {err.message}"


def _nodes(cluster: LocalCluster) -> tuple[list[Any], str | None]:
    """Every node the watcher knows (not only this cluster.json's edges), or why not."""
    from libdsec.errors import DSecError

    try:
        return list(list_nodes(cluster.apiserver).nodes), None
    except DSecError as err:
        return [], f"cannot list nodes: {type(err).__name__} [{err.reason}]: {err.message}"


def cmd_deploy(args: argparse.Namespace) -> int:
    from dsecctl import ray_deploy  # Ray is imported only by the commands that use it

    if args.status:
        return _print_deployment(args.ray, args.json)
    home = dsec_home()
    if (home / "cluster.json").exists() and not recorded_deployment(home):
        print(
            f"dsec deploy: $DSEC_HOME ({home}) holds a local cluster (`dsec down` first, or"
            " deploy with another DSEC_HOME)",
            file=sys.stderr,
        )
        return 2
    settings = ray_deploy.DeploySettings(
        node_dir=args.node_dir,
        layer_store=args.layer_store,
        iam_database=args.iam_database,
        edge_env=dict(args.edge_env),
        log_level=args.log_level,
        compat=not args.no_compat,
        timeout_s=args.timeout,
        vip=args.vip,
        vip_router=args.vip_router,
        vip_asn=args.vip_asn,
        vip_router_asn=args.vip_router_asn,
    )
    if settings.vip_problem():
        print(f"dsec deploy: {settings.vip_problem()}", file=sys.stderr)
        return 2
    print(f"deploying dsec on the Ray cluster at {args.ray} ...", flush=True)
    t0 = time.monotonic()
    st = ray_deploy.deploy(args.ray, settings)
    write_home(home, args.ray, st)
    if args.json:
        print_json({k: v for k, v in st.items() if k != "token"})
        return 0
    _print_service_rows(st["services"])
    print(f"\ndeployed in {time.monotonic() - t0:.1f} s; API server {st['apiserver']}")
    print(f"$DSEC_HOME ({home}): cluster.json and token point at it (dsec sandbox ..., Client())")
    if "e2b_api_url" in st:
        print(f"e2b SDK:  E2B_API_URL={st['e2b_api_url']} E2B_SANDBOX_URL={st['e2b_api_url']}")
    return 0


def cmd_undeploy(args: argparse.Namespace) -> int:
    from dsecctl import ray_deploy

    t0 = time.monotonic()
    result = ray_deploy.undeploy(args.ray, keep_sandboxes=args.keep_sandboxes)
    forgot = forget_home(dsec_home(), args.ray)
    if args.json:
        print_json({**result, "home_cleared": forgot})
        return 0
    kept = " (sandboxes kept)" if args.keep_sandboxes else ""
    print(
        f"undeployed in {time.monotonic() - t0:.1f} s: {len(result['services'])} services"
        f" of {len(result['groups'])} actors stopped{kept}"
    )
    return 0


def _print_deployment(address: str, as_json: bool) -> int:
    """`dsec deploy --ray ADDRESS --status` (and `dsec status` on a Ray deployment's home)."""
    from dsecctl import ray_deploy

    st = ray_deploy.status(address)
    st.pop("token", None)
    bad = sum(s.get("health") != "SERVING" for s in st["services"])
    if as_json:
        print_json(st)
        return 1 if bad else 0
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(st["created_at"]))
    print(f"dsec on the Ray cluster at {address} since {since}; API server {st['apiserver']}")
    _print_service_rows(st["services"])
    for line in st["events"][-5:]:
        print(f"  event {line}")
    return 1 if bad else 0


def _print_service_rows(services: list[dict[str, Any]]) -> None:
    for s in services:
        if "error" in s:
            print(f"  {s['name']:<20} {s['state']:<10} {s['error']}")
            continue
        exit_ = f" (last exit {s['last_exit']})" if s.get("last_exit") is not None else ""
        print(
            f"  {s['name']:<20} {s['health']:<12} {s['state']:<8} {s['address']:<22}"
            f" node {s['node']:<15} pid {s['pid']:<7} restarts {s['restarts']}{exit_}"
        )


def _pool_lines(address: str) -> list[str]:
    """The edge's host controls (a line per state: enforced, disabled by the operator, absent),
    warm sandboxes (one line per image) and FnCall pools (one per environment), from
    GetNodeStatus."""
    import grpc

    from dsec.edge.v1 import edge_pb2, edge_pb2_grpc

    try:
        with grpc.insecure_channel(address) as ch:
            resp = edge_pb2_grpc.EdgeServiceStub(ch).GetNodeStatus(
                edge_pb2.GetNodeStatusRequest(), timeout=2
            )
    except grpc.RpcError as exc:
        # An edge that serves but cannot report its node (a bug): say what it answered.
        code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return [f"node status failed: {code}: {details}"]
    by_state: dict[str, list[str]] = {}
    for c in resp.controls:
        if c.state != "info":  # a fact about the host (kernel, cgroups): its own line below
            by_state.setdefault(c.state, []).append(c.name)
    controls = [f"controls {state}: {', '.join(names)}" for state, names in by_state.items()]
    # A line of their own for the controls that declare one (the host's kernel, cgroup layout
    # and Landlock ABI; the microVM backend's says which
    # accelerator runs guests, or why there are none; core scheduling's, whether
    # latency-sensitive sandboxes get cookies).
    detailed = [f"{c.name}: {c.detail}" for c in resp.controls if c.status_line]
    return (
        controls
        + detailed
        + _pause_line(resp.pause)
        + [
            f"warm {image}: {w.ready}/{w.target} ready, {w.claimed} claimed, {w.missed} missed"
            for image, w in sorted(resp.warm.items())
        ]
        + [
            f"fncall {env}: {p.workers}/{p.size} up ({p.idle} idle, {p.starting} starting),"
            f" {p.waiting} queued, {p.jobs} jobs, {p.recycled} recycled"
            for env, p in sorted(resp.fncall.items())
        ]
    )


def _pause_line(p: Any) -> list[str]:
    """What paused sandboxes gave back (edge_pb2.PauseStatus), and where container pauses put
    memory."""
    if p.swap_size_bytes:
        used, size = p.swap_used_bytes >> 20, p.swap_size_bytes >> 20
        where = f"swap area {used}/{size} MiB used ({p.swap_path})"
    else:
        where = f"freeze only ({p.frozen_only})" if p.frozen_only else "no container pause"
    return [
        f"pause: {p.paused} paused, {p.released_mb} MiB given back "
        f"({p.swapped_bytes >> 20} MiB swapped); {where}"
    ]


def cmd_whoami(args: argparse.Namespace) -> int:
    with client() as c:
        p = c.whoami()
        if args.json:
            print_json(p)
            return 0
        print(
            f"{p.name} ({p.kind.lower()}, {p.role.lower()}) in project {p.project_id}; token id {p.principal_id}"
        )
    return 0


def cmd_project(args: argparse.Namespace) -> int:
    from libdsec import Quota

    with client() as c:
        if args.action == "create":
            q = Quota(
                cpu_millis=args.cpu_millis,
                memory_mb=args.memory_mb,
                sandboxes=args.sandboxes,
                share_weight=args.share_weight,
            )
            p = c.create_project(args.name, parent=args.parent, quota=q, exist_ok=args.exist_ok)
            if args.json:
                print_json(p)
                return 0
            q = p.quota  # what it has (with --exist-ok, an existing project keeps its own)
            print(
                f"{p.project_id}  quota cpu_millis={q.cpu_millis} memory_mb={q.memory_mb} sandboxes={q.sandboxes}"
            )
        elif args.action == "quota":
            q = Quota(
                cpu_millis=args.cpu_millis,
                memory_mb=args.memory_mb,
                sandboxes=args.sandboxes,
                share_weight=args.share_weight,
            )
            _print_project(c.set_quota(args.project_id, q), args.json)
        elif args.action == "show":
            _print_project(c.get_project(args.project_id), args.json)
        elif args.action == "delete":
            c.delete_project(args.project_id)
            print(f"deleted {args.project_id}")
        else:
            projects = c.list_projects(args.parent, recursive=args.recursive)
            if args.json:
                print_json(projects)
                return 0
            for p in projects:
                print(
                    f"{p.project_id:<40} sandboxes {p.usage.sandboxes}/{p.quota.sandboxes or '-'}  "
                    f"cpu {p.usage.cpu_millis}/{p.quota.cpu_millis or '-'}  mem {p.usage.memory_mb}/{p.quota.memory_mb or '-'}"
                )
    return 0


def _print_project(p: Any, as_json: bool) -> None:
    if as_json:
        print_json(p)
        return
    print(p.project_id)
    for dim in ("sandboxes", "cpu_millis", "memory_mb"):
        limit = getattr(p.quota, dim)
        print(f"  {dim:<11} {getattr(p.usage, dim):>10} used of {limit or 'no own limit'}")
    for backend, n in sorted(p.usage.sandboxes_by_backend.items()):
        limit = p.quota.sandboxes_by_backend.get(backend)
        print(f"  {backend:<11} {n:>10} sandboxes" + (f" of {limit}" if limit else ""))


def cmd_token(args: argparse.Namespace) -> int:
    with client() as c:
        if args.action == "create":
            t = c.create_token(
                args.name,
                project=args.project,
                agent=args.agent,
                admin=args.admin,
                ttl_s=args.ttl_s,
                e2b=args.e2b,
            )
            if args.json:  # the secret too: it is shown once
                print_json(t)
                return 0
            print(t.secret)
            print(
                f"(token {t.info.token_id} for {t.info.project_id}, {t.info.kind.lower()}, {t.info.role.lower()}; "
                "shown once)",
                file=sys.stderr,
            )
        elif args.action == "list":
            tokens = c.list_tokens(args.project, include_revoked=True)
            if args.json:
                print_json(tokens)
                return 0
            for info in tokens:
                print(
                    f"{info.token_id}  {info.name:<24} {info.project_id:<30} {info.kind.lower():<6} {info.role.lower():<6}"
                    f"{' revoked' if info.revoked else ''}"
                )
        else:
            c.revoke_token(args.token_id)
            if args.json:
                print_json({"token_id": args.token_id, "revoked": True})
            else:
                print(f"revoked {args.token_id}")
    return 0


_TASK_DONE = {"pause": "paused", "resume": "resumed", "stop": "stopped"}


def cmd_task(args: argparse.Namespace) -> int:
    """A task-level operation: one line per sandbox (id and state, or the error's reason and
    message), one per edge that did not answer; exit 1 if anything failed."""
    labels = dict(args.label)
    with client() as c:
        if args.action == "pause":
            r = c.pause_task(args.task_id, labels=labels)
        elif args.action == "resume":
            r = c.resume_task(args.task_id, labels=labels)
        else:
            r = c.stop_task(
                args.task_id, preempted=args.preempted, grace_s=args.grace_s, labels=labels
            )
    for item in r.results:
        info, err = item.info, item.error
        if args.json:
            line = json.dumps(
                {
                    "id": item.sandbox_id,
                    "edge_id": item.edge_id,
                    "state": info.state if info else None,
                    "reason": info.termination_reason if info else None,
                    "labels": info.labels if info else None,
                    "error": error_json(err),
                }
            )
        elif err is not None:
            line = f"{item.sandbox_id}  error {err.reason}: {err.message}"
        else:
            assert info is not None
            reason = f" ({info.termination_reason})" if info.termination_reason else ""
            line = f"{item.sandbox_id}  {info.state}{reason}"
        print(line)
    for edge in r.edge_errors:
        if args.json:
            print(
                json.dumps({"id": None, "edge_id": edge.edge_id, "error": error_json(edge.error)})
            )
        else:
            print(f"edge {edge.edge_id}  error {edge.error.reason}: {edge.error.message}")
    done = len(r.results) - len(r.failed)
    summary = (
        f"{_TASK_DONE[args.action]} {done} of {len(r.results)} sandboxes of task {args.task_id}"
    )
    if r.failed:
        summary += f"; {len(r.failed)} failed"
    if r.edge_errors:
        summary += f"; {len(r.edge_errors)} edges did not answer"
    print(summary, file=sys.stderr)
    return 0 if r.ok else 1


def cmd_env(args: argparse.Namespace) -> int:
    with client() as c:
        if args.action == "list":
            envs = c.list_environments(args.prefix)
            if args.json:
                print_json(envs)
                return 0
            for env in envs:
                print(
                    f"{env.name:<48} {len(env.layers):>3} layers  {size_text(env.size_bytes):>10}"
                )
        elif args.action == "show":
            _show_env(c.get_environment(args.name), args.json)
        elif args.action == "layers":
            layers = c.list_layers()
            if args.json:
                print_json(layers)
                return 0
            for layer in layers:
                print(
                    f"{layer.digest}  {layer.kind.lower():<9} {size_text(layer.size_bytes):>10}  "
                    f"{layer.source}"
                )
        elif args.action == "import":
            # one call that says nothing until it is done: a spinner and the time on a terminal
            with progress(f"importing {args.source}"):
                env = c.import_image(
                    args.source, args.name, kind=args.kind, base=args.base, all_root=args.all_root
                )
            _show_env(env, args.json)
        elif args.action == "compose":
            with progress(f"composing {args.name}"):
                env = c.compose_environment(
                    args.name, base=args.base, workspace=args.workspace, toolkits=args.toolkit
                )
            _show_env(env, args.json)
        elif args.action == "rm":
            if not c.delete_environment(args.name):
                print(f"dsec env rm: no environment {args.name}", file=sys.stderr)
                return 1
            print("deleted")
    return 0


def _show_env(env: Any, as_json: bool) -> None:
    if as_json:
        print_json(env)
    else:
        print_env(env)


def cmd_demo(args: argparse.Namespace) -> int:
    from dsecctl.demo import run_demo

    return run_demo()


def _version() -> str:
    try:
        return importlib.metadata.version("dsec")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout not installed
        return "unknown (not installed)"


def _port_base(value: str) -> int:
    """--port-base: the cluster's ports are it and the 31 after it."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 1024 <= port <= 65535 - 31:
        raise argparse.ArgumentTypeError(f"{port}: must be in 1024..{65535 - 31}")
    return port


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsec", description="dsec: sandboxes for agentic RL")
    p.add_argument("--version", action="version", version=f"dsec {_version()}")
    sub = p.add_subparsers(dest="topic", required=True, metavar="COMMAND")
    _cluster_parsers(sub)
    sub.add_parser("demo", help="a short tour through libdsec").set_defaults(fn=cmd_demo)
    who = sub.add_parser("whoami", help="who the token is: name, kind, role, project")
    json_option(who, "print the principal as one JSON object")
    who.set_defaults(fn=cmd_whoami)
    _project_parsers(sub)
    _token_parsers(sub)
    add_sandbox_parser(sub)
    _task_parsers(sub)
    add_fncall_parser(sub)
    add_grpc_parser(sub)
    _env_parsers(sub)
    add_node_parser(sub)
    add_top_parser(sub)
    return p


def _cluster_parsers(sub: Any) -> None:
    up = sub.add_parser("up", help="start a local single-node cluster")
    up.add_argument("--edges", type=int, default=1, help="edges (container runtime) to start")
    up.add_argument(
        "--apiservers", type=int, default=1, help="API server instances (ports 7100, 7121, ...)"
    )
    up.add_argument(
        "--vip",
        action="store_true",
        help="put the API servers behind one virtual IP: each on a host of its own (a network"
        " namespace) announcing it over BGP to an FRR router that spreads connections (ECMP)",
    )
    up.add_argument(
        "--iam-database",
        default="",
        help="IAM storage: sqlite:<path> (default: in $DSEC_HOME) or postgresql://...",
    )
    up.add_argument(
        "--port-base",
        type=_port_base,
        default=7100,
        help="the API server's port; the others follow at fixed offsets (+1..+31)",
    )
    up.add_argument(
        "--log-level", default="INFO", help="the services' log level (DEBUG, INFO, WARNING)"
    )
    up.add_argument(
        "--timeout", type=float, default=120.0, help="seconds every service has to be SERVING"
    )
    up.set_defaults(fn=cmd_up)
    down = sub.add_parser(
        "down", help="stop the local cluster and its sandboxes; returns once all are gone"
    )
    down.add_argument(
        "--keep-sandboxes",
        action="store_true",
        help="leave the sandboxes running: the next `dsec up` re-adopts them",
    )
    down.set_defaults(fn=cmd_down)
    restart = sub.add_parser(
        "restart",
        help="restart services one at a time (default: all) without stopping sandboxes",
    )
    restart.add_argument(
        "services",
        nargs="*",
        help="service names as `dsec status` shows them (iam, edge-edge0, ...)",
    )
    restart.add_argument(
        "--timeout", type=float, default=120.0, help="seconds each service has to be SERVING"
    )
    restart.set_defaults(fn=cmd_restart)
    queue = sub.add_parser("queue", help="creates waiting for room (wait_s): per project and task")
    queue.add_argument("--entries", action="store_true", help="also each waiting create, in order")
    json_option(queue, "print the queue as one JSON object")
    queue.set_defaults(fn=cmd_queue)
    status = sub.add_parser("status", help="health, supervisor state and restarts of every service")
    json_option(status, "print the services as one JSON object")
    status.set_defaults(fn=cmd_status)

    deploy = sub.add_parser(
        "deploy", help="run dsec on a Ray cluster: control plane on the head, an edge per node"
    )
    _ray_address(deploy)
    deploy.add_argument(
        "--status",
        action="store_true",
        help="show the deployment: each service's node, pid, restarts and health",
    )
    deploy.add_argument(
        "--layer-store",
        default="",
        help="the shared layer store: a shared file system at this path on every node",
    )
    deploy.add_argument(
        "--iam-database",
        default="",
        help="IAM storage: postgresql://... (default: SQLite in --node-dir of the head node)",
    )
    deploy.add_argument(
        "--node-dir",
        default="/var/lib/dsec-ray",
        help="each node's own directory: logs, IAM's SQLite and token, edges/<edge id>/",
    )
    deploy.add_argument(
        "--edge-env",
        action="append",
        default=[],
        type=key_value,
        metavar="KEY=VALUE",
        help="one more DSEC_EDGE_* setting for every edge (repeatable)",
    )
    deploy.add_argument(
        "--vip",
        default="",
        help="put the API servers behind this virtual IP: each announces it over BGP (FRR's"
        " bgpd, on every node) to --vip-router while healthy",
    )
    deploy.add_argument(
        "--vip-router", default="", help="the nodes' BGP router (a top-of-rack switch) address"
    )
    deploy.add_argument("--vip-asn", type=int, default=65100, help="the API servers' AS number")
    deploy.add_argument("--vip-router-asn", type=int, default=65000, help="the router's AS number")
    deploy.add_argument("--no-compat", action="store_true", help="no E2B/SandboxFusion front end")
    deploy.add_argument(
        "--log-level", default="INFO", help="the services' log level (DEBUG, INFO, WARNING)"
    )
    deploy.add_argument(
        "--timeout", type=float, default=120.0, help="seconds each service has to be SERVING"
    )
    json_option(deploy, "print the deployment as one JSON object")
    deploy.set_defaults(fn=cmd_deploy)
    undeploy = sub.add_parser(
        "undeploy", help="stop the dsec deployed on a Ray cluster, its sandboxes and its actors"
    )
    _ray_address(undeploy)
    undeploy.add_argument(
        "--keep-sandboxes",
        action="store_true",
        help="leave the sandboxes running: the next deploy's edges re-adopt them",
    )
    json_option(undeploy, "print what was stopped as one JSON object")
    undeploy.set_defaults(fn=cmd_undeploy)


def _ray_address(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ray",
        required=True,
        metavar="ADDRESS",
        help="ray://HOST:PORT (Ray Client, from anywhere) or HOST:PORT (the GCS, from a Ray node)",
    )


def _quota_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cpu-millis", type=int, default=0, help="cores x 1000 at most (0: no own limit)"
    )
    p.add_argument(
        "--memory-mb", type=int, default=0, help="memory in MiB at most (0: no own limit)"
    )
    p.add_argument("--sandboxes", type=int, default=0, help="sandboxes at once (0: no own limit)")
    p.add_argument(
        "--share-weight",
        type=float,
        default=0.0,
        help="weight in the create queue's fair share among projects (0: 1)",
    )


def _project_parsers(sub: Any) -> None:
    proj = sub.add_parser("project", help="projects and quotas")
    psub = proj.add_subparsers(dest="action", required=True, metavar="ACTION")
    pc = psub.add_parser("create", help="a subproject (of the token's project by default)")
    pc.add_argument("name", help="its name (the id is PARENT/NAME)")
    pc.add_argument("--parent", default="", help="the parent project's id (default: the token's)")
    pc.add_argument(
        "--exist-ok",
        action="store_true",
        help="a project of that name that exists is fine (shown as it is, quota unchanged)",
    )
    _quota_options(pc)
    json_option(pc, "print the project as one JSON object")
    pl = psub.add_parser("list", help="projects below one, with usage and quota")
    pl.add_argument("--parent", default="", help="list below this project (default: the token's)")
    pl.add_argument("--recursive", action="store_true", help="every level below, not only children")
    json_option(pl, "print a JSON array of projects")
    ps = psub.add_parser("show", help="quota and usage of a project (default: the token's)")
    ps.add_argument("project_id", nargs="?", default="", help="the project's id (root/a/b)")
    json_option(ps, "print the project as one JSON object")
    pq = psub.add_parser("quota", help="set the quota of a subproject (0 = no own limit)")
    pq.add_argument("project_id", help="the project's id (root/a/b)")
    _quota_options(pq)
    json_option(pq, "print the project as one JSON object")
    pd = psub.add_parser(
        "delete", help="delete an empty project (no subprojects, no sandboxes); revokes its tokens"
    )
    pd.add_argument("project_id", help="the project's id (root/a/b)")
    proj.set_defaults(fn=cmd_project)


def _token_parsers(sub: Any) -> None:
    tok = sub.add_parser("token", help="tokens for humans and agents")
    tsub = tok.add_subparsers(dest="action", required=True, metavar="ACTION")
    tc = tsub.add_parser("create", help="a new token; prints its secret (shown once)")
    tc.add_argument("name", help="a name to recognise it by in `token list`")
    tc.add_argument("--project", default="", help="its project (default: the token's own)")
    tc.add_argument("--agent", action="store_true", help="an agent's token (not a human's)")
    tc.add_argument("--admin", action="store_true", help="role admin (default member)")
    tc.add_argument(
        "--ttl-s", type=int, default=0, help="expires after this many seconds (0: never)"
    )
    tc.add_argument(
        "--e2b",
        action="store_true",
        help="shaped as an E2B API key (e2b_<hex>): E2B's SDKs check a key's shape",
    )
    json_option(tc, "print the token, secret included, as one JSON object")
    tl = tsub.add_parser("list", help="tokens of a project, revoked ones too")
    tl.add_argument("--project", default="", help="this project's tokens (default: the token's)")
    json_option(tl, "print a JSON array of tokens")
    tr = tsub.add_parser("revoke", help="revoke a token at once")
    tr.add_argument("token_id", help="the token's id (as `token list` shows it)")
    json_option(tr, "print the outcome as one JSON object")
    tok.set_defaults(fn=cmd_token)


def _task_parsers(sub: Any) -> None:
    task = sub.add_parser(
        "task", help="pause, resume or stop every sandbox of a task (a preempted job's)"
    )
    tasksub = task.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, what in (
        ("pause", "pause every sandbox of the task (files and processes are kept)"),
        ("resume", "resume every paused sandbox of the task"),
        ("stop", "stop every sandbox of the task"),
    ):
        ta = tasksub.add_parser(action, help=what)
        ta.add_argument("task_id", help="the task id the sandboxes were created with")
        label_option(ta)
        ta.add_argument("--json", action="store_true", help="one JSON object per line")
        if action == "stop":
            ta.add_argument(
                "--preempted",
                action="store_true",
                help="end them with termination reason PREEMPTED (their job was preempted)",
            )
            ta.add_argument(
                "--grace-s", type=float, default=2.0, help="SIGTERM, then SIGKILL after this"
            )
    task.set_defaults(fn=cmd_task)


def _env_parsers(sub: Any) -> None:
    env = sub.add_parser("env", help="environments and layers of the layer store")
    esub = env.add_subparsers(dest="action", required=True, metavar="ACTION")
    el = esub.add_parser("list", help="environments, with layer count and size")
    el.add_argument("prefix", nargs="?", default="", help="only names starting with this")
    json_option(el, "print a JSON array of environments")
    es = esub.add_parser("show", help="an environment's layers and config")
    es.add_argument("name", help="the environment's name, e.g. busybox or my-env:v2")
    json_option(es, "print the environment as one JSON object")
    ely = esub.add_parser("layers", help="every layer of the store")
    json_option(ely, "print a JSON array of layers")
    ei = esub.add_parser("import", help="import docker:REF, dir:/path or tar:/path")
    ei.add_argument("source", help="docker:REPO:TAG, dir:/path or tar:/path.tar")
    ei.add_argument("--name", default="", help="the environment's name (docker: docker/REPO:TAG)")
    ei.add_argument(
        "--kind",
        default="",
        choices=["", "base", "workspace", "toolkit"],
        help="the layer's kind for dir: and tar: (default base)",
    )
    ei.add_argument("--base", default="", help="an environment this layer goes on top of")
    ei.add_argument("--all-root", action="store_true", help="every file owned by root (uid/gid 0)")
    json_option(ei, "print the environment as one JSON object")
    ec = esub.add_parser("compose", help="register base + workspace + toolkits as one environment")
    ec.add_argument("name", help="the new environment's name")
    ec.add_argument("--base", required=True, help="the base environment")
    ec.add_argument("--workspace", default="", help="a workspace environment on top")
    ec.add_argument(
        "--toolkit", action="append", default=[], help="a toolkit environment (repeatable)"
    )
    json_option(ec, "print the environment as one JSON object")
    er = esub.add_parser("rm", help="delete an environment (its layers stay while used)")
    er.add_argument("name", help="the environment's name")
    env.set_defaults(fn=cmd_env)


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
