"""The ``dsec`` command: run a local cluster and operate it.

    dsec up [--runtime container|null] [--edges N]   start iam, watcher, placement, edges, apiserver
    dsec status                                      health of every service
    dsec down                                        stop them (by PID)
    dsec whoami
    dsec project create NAME [--parent P] [--cpu-millis N] [--memory-mb N] [--sandboxes N]
    dsec project list [--recursive]
    dsec token create NAME [--project P] [--agent] [--admin] [--ttl-s N]
    dsec token list | dsec token revoke ID
    dsec sandbox create [--image I] [--cpu C] [--memory-mb M] [--ttl-s T] [--label k=v] [--task T]
    dsec sandbox list [--task T] | dsec sandbox exec ID -- CMD... | dsec sandbox stop ID
    dsec demo                                        a short tour through libdsec

The local cluster lives in $DSEC_HOME (default ~/.dsec): cluster.json,
token (0600), logs/, and each service's state.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec._config import dsec_home
from libdsec.errors import DSecError


def cmd_up(args: argparse.Namespace) -> int:
    home = dsec_home()
    running = LocalCluster.from_state(home)
    if running is not None and all(s == "SERVING" for s in running.status().values()):
        print(
            f"dsec is already running (home {home}); `dsec status` to see it, `dsec down` to stop it"
        )
        return 0
    if running is not None:
        running.stop()
    edges = [EdgeSpec(edge_id=f"edge{i}", runtime=args.runtime) for i in range(args.edges)]
    cluster = LocalCluster(
        home, transport="tcp", fixed_ports=True, edges=edges, log_level=args.log_level
    )
    print(f"starting dsec in {home} ...", flush=True)
    cluster.start(timeout_s=args.timeout)
    for name, state in cluster.status().items():
        p = cluster.process(name)
        print(f"  {name:<12} {state:<10} {p.address:<22} pid {p.pid}  log {p.log_path}")
    print(f"\nAPI server: {cluster.apiserver}\nadmin token: {cluster.token_file} (0600)\n")
    print("connect:  python -c 'from libdsec import Client; print(Client().whoami())'")
    print(
        f'grpcurl:  grpcurl -plaintext -H "authorization: Bearer $(cat {cluster.token_file})" '
        f"{cluster.apiserver} list"
    )
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    cluster = LocalCluster.from_state(dsec_home())
    if cluster is None:
        print("dsec is not running")
        return 0
    cluster.stop()
    print("dsec stopped")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    cluster = LocalCluster.from_state(dsec_home())
    if cluster is None:
        print("dsec is not running (no cluster.json)")
        return 1
    bad = 0
    for name, state in cluster.status().items():
        p = cluster.process(name)
        print(f"{name:<12} {state:<12} {p.address:<22} pid {p.pid}")
        bad += state != "SERVING"
    return 1 if bad else 0


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
        else:
            for p in c.list_projects(args.parent, recursive=args.recursive):
                print(
                    f"{p.project_id:<40} sandboxes {p.usage.sandboxes}/{p.quota.sandboxes or '-'}  "
                    f"cpu {p.usage.cpu_millis}/{p.quota.cpu_millis or '-'}  mem {p.usage.memory_mb}/{p.quota.memory_mb or '-'}"
                )
    return 0


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


def _labels(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        k, _, v = item.partition("=")
        out[k] = v
    return out


def cmd_sandbox(args: argparse.Namespace) -> int:
    with _client() as c:
        if args.action == "create":
            sb = c.create(
                image=args.image,
                cpu=args.cpu,
                memory_mb=args.memory_mb,
                ttl_s=args.ttl_s,
                labels=_labels(args.label),
                task_id=args.task,
                backend=args.backend,
            )
            print(sb.id)
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
            info = c.get(args.sandbox_id).stop()
            print(f"{info.id} {info.state} ({info.termination_reason})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from dsecctl.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsec", description="dsec: sandboxes for agentic RL")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start a local single-node cluster")
    up.add_argument("--runtime", default="container", choices=["container", "null"])
    up.add_argument("--edges", type=int, default=1)
    up.add_argument("--log-level", default="INFO")
    up.add_argument("--timeout", type=float, default=120.0)
    up.set_defaults(fn=cmd_up)
    sub.add_parser("down", help="stop the local cluster").set_defaults(fn=cmd_down)
    sub.add_parser("status", help="health of every service").set_defaults(fn=cmd_status)
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
    sc.add_argument("--label", action="append", default=[])
    sc.add_argument("--task", default="")
    sl = ssub.add_parser("list")
    sl.add_argument("--task", default="")
    se = ssub.add_parser("exec")
    se.add_argument("sandbox_id")
    se.add_argument("--timeout-s", type=float, default=600.0)
    se.add_argument("command", nargs=argparse.REMAINDER)
    ss = ssub.add_parser("stop")
    ss.add_argument("sandbox_id")
    sb.set_defaults(fn=cmd_sandbox)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except DSecError as err:
        print(f"dsec: {type(err).__name__} [{err.reason}]: {err.message}", file=sys.stderr)
        return 2
    except (TimeoutError, RuntimeError) as err:
        print(f"dsec: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
