"""``dsec sandbox create|pause|resume|stop|watch|pack``: a sandbox's life, from its create
(with every option of the SDK's) to its end, and its writable layer packed as an environment."""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from typing import Any

from dsecctl.cli_common import (
    client,
    json_option,
    key_value,
    label_option,
    print_env,
    print_json,
    print_json_line,
    progress,
)
from libdsec.errors import DSecError

# ----------------------------------------------------------------- parser


def add_create_parser(ssub: Any) -> None:
    """``dsec sandbox create`` and its options (those of the SDK's create)."""
    sc = ssub.add_parser(
        "create",
        help="create sandboxes (every option of the SDK's create); prints their ids",
        description=(
            "Creates a sandbox (or --count of them in one call) and waits until it accepts "
            "commands; prints its id. Unset options take the platform's defaults."
        ),
    )
    sc.add_argument(
        "--backend",
        default="container",
        choices=["container", "microvm", "vm", "fncall"],
        help="where it runs (default container)",
    )
    sc.add_argument("--image", default="", help="environment name, e.g. busybox (default: edge's)")
    sc.add_argument("--cpu", type=float, default=None, help="cores, fractions allowed (default 1)")
    sc.add_argument("--memory-mb", type=int, default=None, help="memory limit in MiB (default 512)")
    sc.add_argument(
        "--pids-max", type=int, default=None, help="processes and threads at most (default 512)"
    )
    sc.add_argument(
        "--disk-mb", type=int, default=None, help="writable-layer limit in MB (default: edge's)"
    )
    sc.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="whole GPUs, exclusive (default 0; no backend attaches GPUs yet: refused)",
    )
    sc.add_argument(
        "--ttl-s", type=int, default=None, help="ended this many seconds after creation (3600)"
    )
    sc.add_argument(
        "--idle-timeout-s",
        type=int,
        default=None,
        help="ended after this many seconds without a call (default never)",
    )
    label_option(sc, "a label to list, watch or stop by (repeatable)")
    sc.add_argument("--task", default="", help="the RL task it belongs to")
    sc.add_argument(
        "--env",
        action="append",
        default=[],
        type=key_value,
        metavar="KEY=VALUE",
        help="an environment variable of every command (repeatable)",
    )
    sc.add_argument("--workdir", default="", help="working directory of commands")
    sc.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="RULE",
        help="egress allowed to host[:port[-port]][/tcp|/udp] (repeatable; default: no network)",
    )
    sc.add_argument(
        "--deny",
        action="append",
        default=[],
        metavar="RULE",
        help="egress denied to this rule; wins over --allow (repeatable)",
    )
    sc.add_argument(
        "--open-network", action="store_true", help="egress anywhere except the --deny rules"
    )
    sc.add_argument(
        "--max-blocked-connects",
        type=int,
        default=0,
        help="end the sandbox (POLICY_VIOLATION) after more blocked connects (0: only count)",
    )
    sc.add_argument(
        "--best-effort",
        action="store_true",
        help="best-effort QoS (may be throttled first) instead of latency-sensitive",
    )
    sc.add_argument(
        "--node-selector",
        action="append",
        default=[],
        type=key_value,
        metavar="KEY=VALUE",
        help="only edges with this label (repeatable: all must match)",
    )
    sc.add_argument(
        "--toolkit",
        action="append",
        default=[],
        metavar="NAME",
        help="a toolkit environment mounted read-only beside the image (repeatable)",
    )
    sc.add_argument(
        "--sudo-user",
        action="append",
        default=[],
        metavar="ACCOUNT",
        help="an account of the sandbox that may sudo without a password (repeatable; containers)",
    )
    sc.add_argument(
        "--idempotency-key",
        default="",
        help="a retried create with the same key returns the first one's sandbox (with "
        "--count: KEY-0, KEY-1, ...)",
    )
    sc.add_argument("--count", type=int, default=1, help="create this many in one call")
    sc.add_argument(
        "--wait-s",
        type=float,
        default=0.0,
        help="when the cluster is full, wait up to this many seconds in the create queue"
        " (fair share; QUEUE_TIMEOUT after) instead of being refused at once",
    )
    sc.add_argument(
        "--priority", type=int, default=0, help="order among the project's queued creates"
    )
    sc.add_argument(
        "--no-wait", action="store_true", help="return once created, before they are running"
    )
    json_option(sc, "print the sandbox (with --count: an array of sandboxes or errors) as JSON")
    sc.set_defaults(fn=cmd_create)


# ----------------------------------------------------------------- create


def _create_options(args: argparse.Namespace) -> dict[str, Any]:
    from libdsec import NetworkPolicy

    options: dict[str, Any] = {
        "backend": args.backend,
        "image": args.image,
        "cpu": args.cpu,
        "memory_mb": args.memory_mb,
        "pids_max": args.pids_max,
        "disk_mb": args.disk_mb,
        "gpus": args.gpus,
        "ttl_s": args.ttl_s,
        "idle_timeout_s": args.idle_timeout_s,
        "labels": dict(args.label),
        "task_id": args.task,
        "env": dict(args.env),
        "workdir": args.workdir,
        "best_effort": args.best_effort,
        "node_selector": dict(args.node_selector),
        "toolkits": list(args.toolkit),
        "sudo_users": list(args.sudo_user),
    }
    if args.allow or args.deny or args.open_network or args.max_blocked_connects:
        options["network"] = NetworkPolicy(
            allow=list(args.allow),
            deny=list(args.deny),
            open=args.open_network,
            max_blocked_connects=args.max_blocked_connects,
        )
    return options


def cmd_create(args: argparse.Namespace) -> int:
    if args.count < 1:
        print("dsec sandbox create: --count must be at least 1", file=sys.stderr)
        return 2
    options = _create_options(args)
    with client() as c:
        if args.count == 1:
            if args.idempotency_key:
                options["idempotency_key"] = args.idempotency_key
            sb = c.create(
                wait=not args.no_wait, wait_s=args.wait_s, priority=args.priority, **options
            )
            if args.json:
                print_json(sb.info)
            else:
                print(sb.id)
            return 0
        results = _create_many(c, args, options)
    if args.json:
        print_json(results)
    else:
        for r in results:
            if isinstance(r, DSecError):
                print(f"error {type(r).__name__} [{r.reason}]: {r.message}")
            else:
                print(r.id)
    return 1 if any(isinstance(r, DSecError) for r in results) else 0


def _create_many(c: Any, args: argparse.Namespace, options: dict[str, Any]) -> list[Any]:
    """One CreateSandboxes call for ``--count``: in order, each sandbox's info or its error.
    On a terminal, a progress bar counts them up to RUNNING (created without waiting, then
    polled), as the call alone says nothing until all are up."""
    key = args.idempotency_key

    def create(wait: bool) -> list[Any]:
        if key:
            specs = [{**options, "idempotency_key": f"{key}-{i}"} for i in range(args.count)]
            made = c.create_many(specs=specs, wait=wait, wait_s=args.wait_s, priority=args.priority)
        else:
            made = c.create_many(
                args.count, wait=wait, wait_s=args.wait_s, priority=args.priority, **options
            )
        return [r if isinstance(r, DSecError) else r.info for r in made]

    with progress(f"creating {args.count} sandboxes", total=args.count) as bar:
        if args.no_wait or not bar.live:
            return create(not args.no_wait)
        return _wait_running(c, args, create(False), bar)


def _wait_running(c: Any, args: argparse.Namespace, made: list[Any], bar: Any) -> list[Any]:
    """``made`` (infos and errors) once every sandbox is RUNNING; one that ended while
    starting, or is not up after 600 s, becomes its error."""
    from libdsec.errors import DeadlineExceeded, SandboxTerminated

    out = list(made)
    pending = {r.id: i for i, r in enumerate(made) if not isinstance(r, DSecError)}
    bar.update(completed=len(made) - len(pending))
    deadline = time.monotonic() + 600
    while pending:
        for info in c.list(task_id=args.task, labels=dict(args.label)):
            i = pending.get(info.id)
            if i is None or info.state in ("PENDING", "STARTING"):
                continue
            del pending[info.id]
            out[i] = info
            if info.state != "RUNNING":
                out[i] = SandboxTerminated(
                    f"{info.id} ended while starting: {info.termination_message}",
                    reason=info.termination_reason or info.state,
                )
            bar.update(advance=1)
        if pending and time.monotonic() > deadline:
            for sandbox_id, i in pending.items():
                out[i] = DeadlineExceeded(f"{sandbox_id} not running after 600 s")
            break
        if pending:
            time.sleep(0.2)
    return out


# ------------------------------------------------------- lifecycle, watch


def cmd_pause_resume(args: argparse.Namespace) -> int:
    with client() as c:
        sb = c.get(args.sandbox_id)
        info = sb.pause() if args.action == "pause" else sb.resume()
    if args.json:
        print_json(info)
    else:
        print(f"{info.id} {info.state}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    if bool(args.sandbox_id) == bool(args.task):
        print("dsec sandbox stop: give a sandbox id or --task (not both)", file=sys.stderr)
        return 2
    with client() as c:
        if args.sandbox_id:
            info = c.get(args.sandbox_id).stop(grace_s=args.grace_s)
            if args.json:
                print_json(info)
            else:
                print(f"{info.id} {info.state} ({info.termination_reason})")
            return 0
        stopped = c.stop_all(task_id=args.task)
    if args.json:
        print_json({"task_id": args.task, "stopped": stopped})
    else:
        print(f"stopped {len(stopped)} sandboxes of task {args.task}")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    """One line per change of the matching sandboxes until Ctrl-C (exit 0) or the stream ends.
    Text: ``time id state reason``; ``--json``: one object per line."""
    with client() as c:
        try:
            with c.watch(task_id=args.task, labels=dict(args.label)) as changes:
                # on stderr (stdout stays one change per line): from here on, nothing is missed
                print("watching (Ctrl-C to stop)", file=sys.stderr, flush=True)
                for info in changes:
                    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")
                    if args.json:
                        print_json_line(
                            {
                                "time": now,
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
                        print(f"{now}  {info.id}  {info.state:<10} {reason}", flush=True)
        except KeyboardInterrupt:
            return 0
    return 0


def cmd_fork(args: argparse.Namespace) -> int:
    """One line per child (its id, or its error), then the kind and the source's stall on
    stderr; exit 1 if any child failed."""
    with client() as c:
        group = c.get(args.sandbox_id).fork(
            args.count,
            labels=dict(args.label),
            task_id=args.task,
            ttl_s=args.ttl_s,
            require_memory=args.require_memory,
        )
    children = [r if isinstance(r, DSecError) else r.info for r in group]
    if args.json:
        print_json({"kind": group.kind, "stall_s": group.stall_s, "children": children})
    else:
        for r in children:
            if isinstance(r, DSecError):
                print(f"error {type(r).__name__} [{r.reason}]: {r.message}")
            else:
                print(r.id)
        print(
            f"forked {len(group.sandboxes)} of {len(group)} ({group.kind}); the source stood "
            f"still {group.stall_s * 1000:.0f} ms",
            file=sys.stderr,
        )
    return 1 if group.errors else 0


def cmd_pack(args: argparse.Namespace) -> int:
    with client() as c:
        env = c.get(args.sandbox_id).pack_diff(
            args.name, exclude=args.exclude, default_excludes=not args.no_default_excludes
        )
    if args.json:
        print_json(env)
    else:
        print_env(env)
    return 0
