"""The ``dsec`` command: run a local cluster and operate it.

    dsec up [--edges N] [--apiservers N] [--iam-database URL]
                                                     start iam, watcher, placement, edges, apiservers
                                                     under supervisord; on a running cluster, start
                                                     only what is down
    dsec status                                      health, supervisor state, restarts
    dsec restart [SERVICE...]                        one at a time; sandboxes keep running
    dsec down [--keep-sandboxes]                     stop sandboxes and services
    dsec whoami
    dsec project create NAME [--parent P] [--cpu-millis N] [--memory-mb N] [--sandboxes N]
    dsec project list [--recursive] | dsec project show [ID] | dsec project quota ID [--sandboxes N ...]
    dsec token create NAME [--project P] [--agent] [--admin] [--ttl-s N]
    dsec token list | dsec token revoke ID
    dsec sandbox create [--image I] [--cpu C] [--memory-mb M] [--ttl-s T] [--label k=v] [--task T]
                        [--count N]
    dsec sandbox list [--task T] | dsec sandbox exec ID -- CMD... | dsec sandbox stop ID|--task T
    dsec sandbox watch [--task T] [--label k=v]... [--json]   one line per change, until Ctrl-C
    dsec sandbox pack ID NAME [--exclude GLOB]... [--no-default-excludes]
    dsec task pause|resume|stop TASK_ID [--label k=v]... [--preempted] [--grace-s S] [--json]
                                                     every sandbox of a task: one line each
    dsec env list [PREFIX] | dsec env show NAME | dsec env layers | dsec env rm NAME
    dsec env import SOURCE [--name N] [--kind K] [--base B]   docker:REF, dir:/path, tar:/path
    dsec env compose NAME --base B [--workspace W] [--toolkit T]...
    dsec fncall -l LANG (-c CODE | -f FILE) [--stdin-file F | --cases GLOB]   short jobs in warm pools
    dsec demo                                        a short tour through libdsec

The local cluster lives in $DSEC_HOME (default ~/.dsec): cluster.json,
token (0600), logs/, and each service's state.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shlex
import signal
import sys
import time
from typing import Any

from dsecctl.cluster import EdgeSpec, LocalCluster
from dsecctl.fncall import add_parser as add_fncall_parser
from dsecctl.supervisor import UP_STATES
from libdsec._config import dsec_home
from libdsec.errors import DSecError


def cmd_up(args: argparse.Namespace) -> int:
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
    edges = [
        EdgeSpec(edge_id=f"edge{i}", runtime="container", extra_env=dict(warm))
        for i in range(args.edges)
    ]
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
    )
    print(f"starting dsec in {home} (services supervised by supervisord) ...", flush=True)
    cluster.start(timeout_s=args.timeout)
    _print_services(cluster)
    print(f"\nAPI server: {cluster.apiserver}\nadmin token: {cluster.token_file} (0600)\n")
    print("connect:  python -c 'from libdsec import Client; print(Client().whoami())'")
    if cluster.compat:
        print(
            f"e2b SDK:  export E2B_API_URL={cluster.compat_url} E2B_SANDBOX_URL={cluster.compat_url}"
            " E2B_API_KEY=$(dsec token create me)"
        )
        print(
            f"verl:     sandbox_fusion_url={cluster.sandbox_fusion_url}/t/$(dsec token create verl"
            " --agent)/run_code"
        )
    print(
        f'grpcurl:  grpcurl -plaintext -H "authorization: Bearer $(cat {cluster.token_file})" '
        f"{cluster.apiserver} list"
    )
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


def cmd_down(args: argparse.Namespace) -> int:
    cluster = LocalCluster.from_state(dsec_home())
    if cluster is None:
        print("dsec is not running")
        return 0
    cluster.stop(keep_sandboxes=args.keep_sandboxes)
    kept = " (sandboxes kept: the next `dsec up` re-adopts them)" if args.keep_sandboxes else ""
    print(f"dsec stopped{kept}")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
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
    cluster = LocalCluster.from_state(dsec_home())
    if cluster is None:
        print("dsec is not running (no cluster.json)")
        return 1
    bad = 0
    status = cluster.status()
    supervised = cluster.supervised_processes()
    restarts = cluster.supervisor.restarts() if supervised else {}
    if cluster.supervised and not supervised:
        print("supervisord is not running: crashed services will not be restarted (`dsec up`)")
        bad += 1
    for name, state in status.items():
        p = cluster.process(name)
        address = f"http://{p.address}" if p.protocol == "http" else p.address
        extra = ""
        if name in supervised:
            info = supervised[name]
            n = restarts.get(name, {}).get("restarts", 0)
            # supervisord's description: "pid 12, uptime 0:01:02", "Exited too quickly ..."
            extra = f"  {info.description.removeprefix(f'pid {info.pid}, ')}; restarts {n}"
        print(f"{name:<12} {state:<12} {address:<22} pid {p.pid}{extra}")
        bad += state != "SERVING"
        if name.startswith("edge-") and state == "SERVING":
            for line in _pool_lines(p.address):
                print(f"{'':<12} {line}")
        elif state not in ("SERVING", "DOWN") and name in supervised:
            # BACKOFF, FATAL, ...: why, from the service's own log
            print(f"{'':<12} last lines of {p.log_path}:")
            for line in cluster.log_tail(p, lines=10).splitlines():
                print(f"{'':<14}{line}")
    return 1 if bad else 0


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
    except grpc.RpcError:
        return []
    by_state: dict[str, list[str]] = {}
    for c in resp.controls:
        by_state.setdefault(c.state, []).append(c.name)
    controls = [f"controls {state}: {', '.join(names)}" for state, names in by_state.items()]
    # The microVM backend's line says which accelerator runs guests, or why there are none;
    # core scheduling's, whether latency-sensitive sandboxes get cookies, or why not.
    microvm = [
        f"{c.name}: {c.detail}" for c in resp.controls if c.name in ("microvm", "core_scheduling")
    ]
    return (
        controls
        + microvm
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


def _client() -> Any:
    from libdsec import Client

    return Client()


def cmd_whoami(args: argparse.Namespace) -> int:
    with _client() as c:
        p = c.whoami()
        print(
            f"{p.name} ({p.kind.lower()}, {p.role.lower()}) in project {p.project_id}; token id {p.principal_id}"
        )
    return 0


def cmd_project(args: argparse.Namespace) -> int:
    from libdsec import Quota

    with _client() as c:
        if args.action == "create":
            q = Quota(
                cpu_millis=args.cpu_millis, memory_mb=args.memory_mb, sandboxes=args.sandboxes
            )
            p = c.create_project(args.name, parent=args.parent, quota=q)
            print(
                f"created {p.project_id}  quota cpu_millis={q.cpu_millis} memory_mb={q.memory_mb} sandboxes={q.sandboxes}"
            )
        elif args.action == "quota":
            q = Quota(
                cpu_millis=args.cpu_millis, memory_mb=args.memory_mb, sandboxes=args.sandboxes
            )
            _print_project(c.set_quota(args.project_id, q))
        elif args.action == "show":
            _print_project(c.get_project(args.project_id))
        else:
            for p in c.list_projects(args.parent, recursive=args.recursive):
                print(
                    f"{p.project_id:<40} sandboxes {p.usage.sandboxes}/{p.quota.sandboxes or '-'}  "
                    f"cpu {p.usage.cpu_millis}/{p.quota.cpu_millis or '-'}  mem {p.usage.memory_mb}/{p.quota.memory_mb or '-'}"
                )
    return 0


def _print_project(p: Any) -> None:
    print(p.project_id)
    for dim in ("sandboxes", "cpu_millis", "memory_mb"):
        limit = getattr(p.quota, dim)
        print(f"  {dim:<11} {getattr(p.usage, dim):>10} used of {limit or 'no own limit'}")
    for backend, n in sorted(p.usage.sandboxes_by_backend.items()):
        limit = p.quota.sandboxes_by_backend.get(backend)
        print(f"  {backend:<11} {n:>10} sandboxes" + (f" of {limit}" if limit else ""))


def cmd_token(args: argparse.Namespace) -> int:
    with _client() as c:
        if args.action == "create":
            t = c.create_token(
                args.name,
                project=args.project,
                agent=args.agent,
                admin=args.admin,
                ttl_s=args.ttl_s,
            )
            print(t.secret)
            print(
                f"(token {t.info.token_id} for {t.info.project_id}, {t.info.kind.lower()}, {t.info.role.lower()}; "
                "shown once)",
                file=sys.stderr,
            )
        elif args.action == "list":
            for t in c.list_tokens(args.project, include_revoked=True):
                print(
                    f"{t.token_id}  {t.name:<24} {t.project_id:<30} {t.kind.lower():<6} {t.role.lower():<6}"
                    f"{' revoked' if t.revoked else ''}"
                )
        else:
            c.revoke_token(args.token_id)
            print(f"revoked {args.token_id}")
    return 0


def _label_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--label",
        action="append",
        default=[],
        type=_label,
        metavar="KEY=VALUE",
        help="only sandboxes with this label (repeatable: all must match)",
    )


def _label(item: str) -> tuple[str, str]:
    """A ``--label`` argument: ``KEY=VALUE`` (the value may be empty, the key not)."""
    key, eq, value = item.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {item!r}")
    return key, value


def _labels(items: list[tuple[str, str]]) -> dict[str, str]:
    return dict(items)


def _watch(c: Any, args: argparse.Namespace) -> int:
    """One line per change of the matching sandboxes until Ctrl-C (exit 0) or the stream ends.
    Text: ``time id state reason``; ``--json``: one object per line."""
    try:
        with c.watch(task_id=args.task, labels=_labels(args.label)) as changes:
            # on stderr (stdout stays one change per line): from here on, nothing is missed
            print("watching (Ctrl-C to stop)", file=sys.stderr, flush=True)
            for info in changes:
                now = datetime.datetime.now(datetime.UTC)
                if args.json:
                    line = json.dumps(
                        {
                            "time": now.isoformat(timespec="milliseconds"),
                            "id": info.id,
                            "state": info.state,
                            "reason": info.termination_reason,
                            "message": info.termination_message,
                            "task_id": info.task_id,
                            "labels": info.labels,
                            "edge_id": info.edge_id,
                            "image": info.image,
                        }
                    )
                else:
                    reason = info.termination_reason or "-"
                    line = f"{now.isoformat(timespec='milliseconds')}  {info.id}  {info.state:<10} {reason}"
                print(line, flush=True)
    except KeyboardInterrupt:
        return 0
    return 0


def cmd_sandbox(args: argparse.Namespace) -> int:
    with _client() as c:
        if args.action == "create":
            options = dict(
                image=args.image,
                cpu=args.cpu,
                memory_mb=args.memory_mb,
                ttl_s=args.ttl_s,
                labels=_labels(args.label),
                task_id=args.task,
                backend=args.backend,
            )
            if args.count > 1:  # one CreateSandboxes call, one line per sandbox or error
                failed = 0
                for r in c.create_many(args.count, **options):
                    if isinstance(r, DSecError):
                        failed += 1
                        print(f"error {type(r).__name__} [{r.reason}]: {r.message}")
                    else:
                        print(r.id)
                return 1 if failed else 0
            sb = c.create(**options)
            print(sb.id)
        elif args.action == "watch":
            return _watch(c, args)
        elif args.action == "list":
            for s in c.list(task_id=args.task):
                reason = f" ({s.termination_reason})" if s.termination_reason else ""
                print(
                    f"{s.id}  {s.state:<10}{reason} {s.image:<16} task={s.task_id or '-'} edge={s.edge_id}"
                )
        elif args.action == "exec":
            cmd = args.command
            if cmd and cmd[0] == "--":
                cmd = cmd[1:]
            r = c.get(args.sandbox_id).run(shlex.join(cmd), timeout_s=args.timeout_s)
            sys.stdout.buffer.write(r.stdout)
            sys.stderr.buffer.write(r.stderr)
            if r.timed_out:
                print(f"dsec: timed out after {args.timeout_s} s", file=sys.stderr)
                return 124
            return r.exit_code
        elif args.action == "stop":
            if args.sandbox_id:
                info = c.get(args.sandbox_id).stop()
                print(f"{info.id} {info.state} ({info.termination_reason})")
            elif args.task:
                stopped = c.stop_all(task_id=args.task)
                print(f"stopped {len(stopped)} sandboxes of task {args.task}")
            else:
                print("dsec: give a sandbox id or --task", file=sys.stderr)
                return 2
        elif args.action == "pack":
            env = c.get(args.sandbox_id).pack_diff(
                args.name, exclude=args.exclude, default_excludes=not args.no_default_excludes
            )
            _print_env(env)
    return 0


_TASK_DONE = {"pause": "paused", "resume": "resumed", "stop": "stopped"}


def cmd_task(args: argparse.Namespace) -> int:
    """A task-level operation: one line per sandbox (id and state, or the error's reason and
    message), one per edge that did not answer; exit 1 if anything failed."""
    labels = _labels(args.label)
    with _client() as c:
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
                    "error": _error_json(err),
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
                json.dumps({"id": None, "edge_id": edge.edge_id, "error": _error_json(edge.error)})
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


def _error_json(err: DSecError | None) -> dict[str, Any] | None:
    if err is None:
        return None
    return {
        "code": err.code.name,
        "reason": err.reason,
        "message": err.message,
        "metadata": err.metadata,
    }


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _print_env(env: Any) -> None:
    print(f"{env.name}  {len(env.layers)} layers, {_size(env.size_bytes)}")
    for layer in env.layers:
        print(
            f"  {layer.kind.lower():<9} {layer.digest[:19]}  {_size(layer.size_bytes):>10}"
            f"  (metadata {_size(layer.meta_bytes)})  {layer.source}"
        )
    for k, v in sorted(env.config.items()):
        print(f"  {k}={v}")


def cmd_env(args: argparse.Namespace) -> int:
    with _client() as c:
        if args.action == "list":
            for env in c.list_environments(args.prefix):
                print(f"{env.name:<48} {len(env.layers):>3} layers  {_size(env.size_bytes):>10}")
        elif args.action == "show":
            _print_env(c.get_environment(args.name))
        elif args.action == "layers":
            for layer in c.list_layers():
                print(
                    f"{layer.digest}  {layer.kind.lower():<9} {_size(layer.size_bytes):>10}  "
                    f"{layer.source}"
                )
        elif args.action == "import":
            _print_env(
                c.import_image(
                    args.source, args.name, kind=args.kind, base=args.base, all_root=args.all_root
                )
            )
        elif args.action == "compose":
            _print_env(
                c.compose_environment(
                    args.name, base=args.base, workspace=args.workspace, toolkits=args.toolkit
                )
            )
        elif args.action == "rm":
            if not c.delete_environment(args.name):
                print(f"dsec: no environment {args.name}", file=sys.stderr)
                return 1
            print("deleted")
    return 0


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
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start a local single-node cluster")
    up.add_argument("--edges", type=int, default=1)
    up.add_argument(
        "--apiservers", type=int, default=1, help="API server instances (ports 7100, 7121, ...)"
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
    up.add_argument("--log-level", default="INFO")
    up.add_argument("--timeout", type=float, default=120.0)
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
    sub.add_parser(
        "status", help="health, supervisor state and restarts of every service"
    ).set_defaults(fn=cmd_status)
    sub.add_parser("whoami", help="who the token is").set_defaults(fn=cmd_whoami)
    sub.add_parser("demo", help="a short tour through libdsec").set_defaults(fn=cmd_demo)

    proj = sub.add_parser("project", help="projects and quotas")
    psub = proj.add_subparsers(dest="action", required=True)
    pc = psub.add_parser("create")
    pc.add_argument("name")
    pc.add_argument("--parent", default="")
    pc.add_argument("--cpu-millis", type=int, default=0)
    pc.add_argument("--memory-mb", type=int, default=0)
    pc.add_argument("--sandboxes", type=int, default=0)
    pl = psub.add_parser("list")
    pl.add_argument("--parent", default="")
    pl.add_argument("--recursive", action="store_true")
    ps = psub.add_parser("show", help="quota and usage of a project (default: the token's)")
    ps.add_argument("project_id", nargs="?", default="")
    pq = psub.add_parser("quota", help="set the quota of a subproject (0 = no own limit)")
    pq.add_argument("project_id")
    pq.add_argument("--cpu-millis", type=int, default=0)
    pq.add_argument("--memory-mb", type=int, default=0)
    pq.add_argument("--sandboxes", type=int, default=0)
    proj.set_defaults(fn=cmd_project)

    tok = sub.add_parser("token", help="tokens for humans and agents")
    tsub = tok.add_subparsers(dest="action", required=True)
    tc = tsub.add_parser("create")
    tc.add_argument("name")
    tc.add_argument("--project", default="")
    tc.add_argument("--agent", action="store_true")
    tc.add_argument("--admin", action="store_true")
    tc.add_argument("--ttl-s", type=int, default=0)
    tl = tsub.add_parser("list")
    tl.add_argument("--project", default="")
    tr = tsub.add_parser("revoke")
    tr.add_argument("token_id")
    tok.set_defaults(fn=cmd_token)

    sb = sub.add_parser("sandbox", help="sandboxes")
    ssub = sb.add_subparsers(dest="action", required=True)
    sc = ssub.add_parser("create")
    sc.add_argument("--backend", default="container")
    sc.add_argument("--image", default="")
    sc.add_argument("--cpu", type=float, default=None)
    sc.add_argument("--memory-mb", type=int, default=None)
    sc.add_argument("--ttl-s", type=int, default=None)
    sc.add_argument("--label", action="append", default=[], type=_label, metavar="KEY=VALUE")
    sc.add_argument("--task", default="")
    sc.add_argument("--count", type=int, default=1, help="create this many in one call")
    sl = ssub.add_parser("list")
    sl.add_argument("--task", default="")
    sw = ssub.add_parser("watch", help="one line per change (time id state reason) until Ctrl-C")
    sw.add_argument("--task", default="", help="only this task's sandboxes")
    _label_option(sw)
    sw.add_argument("--json", action="store_true", help="one JSON object per line")
    se = ssub.add_parser("exec")
    se.add_argument("sandbox_id")
    se.add_argument("--timeout-s", type=float, default=600.0)
    se.add_argument("command", nargs=argparse.REMAINDER)
    ss = ssub.add_parser("stop", help="one sandbox, or every sandbox of --task")
    ss.add_argument("sandbox_id", nargs="?", default="")
    ss.add_argument("--task", default="")
    sp = ssub.add_parser("pack", help="checkpoint the writable layer as a new environment")
    sp.add_argument("sandbox_id")
    sp.add_argument("name")
    sp.add_argument("--exclude", action="append", default=[])
    sp.add_argument("--no-default-excludes", action="store_true")
    sb.set_defaults(fn=cmd_sandbox)

    task = sub.add_parser(
        "task", help="pause, resume or stop every sandbox of a task (a preempted job's)"
    )
    tasksub = task.add_subparsers(dest="action", required=True)
    for action, what in (
        ("pause", "pause every sandbox of the task (files and processes are kept)"),
        ("resume", "resume every paused sandbox of the task"),
        ("stop", "stop every sandbox of the task"),
    ):
        ta = tasksub.add_parser(action, help=what)
        ta.add_argument("task_id")
        _label_option(ta)
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

    add_fncall_parser(sub)

    env = sub.add_parser("env", help="environments and layers of the layer store")
    esub = env.add_subparsers(dest="action", required=True)
    el = esub.add_parser("list")
    el.add_argument("prefix", nargs="?", default="")
    esub.add_parser("show").add_argument("name")
    esub.add_parser("layers")
    ei = esub.add_parser("import", help="docker:REF, dir:/path or tar:/path")
    ei.add_argument("source")
    ei.add_argument("--name", default="")
    ei.add_argument("--kind", default="", choices=["", "base", "workspace", "toolkit"])
    ei.add_argument("--base", default="")
    ei.add_argument("--all-root", action="store_true")
    ec = esub.add_parser("compose")
    ec.add_argument("name")
    ec.add_argument("--base", required=True)
    ec.add_argument("--workspace", default="")
    ec.add_argument("--toolkit", action="append", default=[])
    esub.add_parser("rm").add_argument("name")
    env.set_defaults(fn=cmd_env)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.fn(args))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (`dsec sandbox list | head`): stop quietly, as a tool killed by
        # SIGPIPE would (exit 141); stdout is pointed at /dev/null so that Python's own flush
        # at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except DSecError as err:
        print(f"dsec: {type(err).__name__} [{err.reason}]: {err.message}", file=sys.stderr)
        return 2
    except (TimeoutError, RuntimeError) as err:
        print(f"dsec: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
