"""``dsec sandbox``: a person's day with running sandboxes, from the shell.

    dsec sandbox create --image busybox --cpu 0.5 --memory-mb 256 --label stage=eval
    dsec sandbox list --state RUNNING --label stage=eval [--json]
    dsec sandbox show ID [--json]                 everything about one sandbox
    dsec sandbox exec ID [-i] [--env K=V] [--cwd D] -- cmd args...   like `docker exec`
    dsec sandbox shell ID                         an interactive terminal (a PTY)
    dsec sandbox cp ./local ID:/work/f  |  dsec sandbox cp ID:/work/f -   (one file, streamed)
    dsec sandbox logs ID [EXEC_ID] [-f]           output of its background commands
    dsec sandbox ps ID                            its commands (exec ids for logs)
    dsec sandbox pause|resume|stop ID
    dsec sandbox watch [--task T] [--label K=V]   one line per change until Ctrl-C
    dsec sandbox pack ID NAME                     its writable layer as a new environment

Every command that prints data takes ``--json``. A failure exits non-zero with one line on
stderr naming the command and the error; ``exec`` and ``shell`` exit with the command's own
status (128+N when signal N killed it, 124 when it timed out).
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from dsecctl.cli_common import (
    client,
    json_option,
    key_value,
    label_option,
    plain,
    print_env,
    print_json,
    print_json_line,
    progress,
)
from libdsec.errors import DSecError

MIB = 1024 * 1024
STATES = ("PENDING", "STARTING", "RUNNING", "PAUSED", "STOPPING", "TERMINATED")
#: What ``exec`` forwards of a command's output by default (the platform's own default is
#: 1 MiB; the in-sandbox agent holds up to this much per stream while it forwards).
EXEC_OUTPUT_BYTES = 16 * MIB
EXIT_TIMED_OUT = 124  # as timeout(1)
#: `exec`/`shell`: dsec itself failed (the sandbox is gone, the cluster unreachable, ...), so
#: the command's status is unknown: docker exec's 125, never a code a command could give.
EXIT_DSEC_FAILED = 125
EXIT_INTERRUPTED = 128 + signal.SIGINT


# ------------------------------------------------------------------ parser


def add_parser(sub: Any) -> None:
    """``dsec sandbox ...``: every subcommand below, each with its own ``fn``."""
    sb = sub.add_parser(
        "sandbox",
        help="create, inspect, use and stop sandboxes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ssub = sb.add_subparsers(dest="action", required=True, metavar="ACTION")
    _create_parser(ssub)

    sl = ssub.add_parser("list", help="sandboxes of the project, newest state first")
    sl.add_argument("--task", default="", help="only this task's sandboxes")
    label_option(sl)
    sl.add_argument(
        "--state",
        action="append",
        default=[],
        type=str.upper,
        choices=STATES,
        help="only sandboxes in this state (repeatable: any of them)",
    )
    json_option(sl, "print a JSON array of sandboxes")
    sl.set_defaults(fn=cmd_list)

    sh = ssub.add_parser("show", help="everything about one sandbox: state, spec, times, usage")
    sh.add_argument("sandbox_id", help="the sandbox's id (sb-...)")
    json_option(sh, "print the sandbox as one JSON object")
    sh.set_defaults(fn=cmd_show)

    se = ssub.add_parser(
        "exec",
        help="run a command (an argv, no shell) and exit with its status",
        description=(
            "Runs CMD ARGS... in the sandbox as an argv (no shell: write `sh -c '...'` for one), "
            "streams its stdout/stderr to this process's as they arrive, and exits with its "
            "status (128+N when killed by signal N, 124 when --timeout-s ran out). Stdin is "
            "forwarded when it is not a terminal (a pipe or a file) or with -i. Options after "
            "the sandbox id need `--` before the command."
        ),
    )
    se.add_argument("sandbox_id", help="the sandbox's id (sb-...)")
    _exec_options(se)
    se.add_argument(
        "argv",
        nargs=argparse.REMAINDER,
        metavar="-- CMD ARGS",
        help="the command and its arguments, passed as they are",
    )
    se.set_defaults(fn=cmd_exec)

    ssh = ssub.add_parser(
        "shell",
        help="an interactive shell in a terminal (PTY); exits with the shell's status",
        description=(
            "Opens a shell under a pseudo-terminal in the sandbox: this terminal is put in raw "
            "mode (restored on exit), its size follows window changes, and the exit status is "
            "the shell's. Stdin must be a terminal (for pipes: `dsec sandbox exec -i ID -- sh`)."
        ),
    )
    ssh.add_argument("sandbox_id", help="the sandbox's id (sb-...)")
    ssh.add_argument(
        "--shell",
        default="",
        help="the shell to run (default: /bin/bash if the sandbox has it, else /bin/sh)",
    )
    ssh.add_argument("--cwd", default="", help="start in this directory (default: the workdir)")
    ssh.add_argument(
        "--env",
        action="append",
        default=[],
        type=key_value,
        metavar="KEY=VALUE",
        help="an environment variable of the shell (repeatable); TERM is passed on",
    )
    ssh.set_defaults(fn=cmd_shell)

    scp = ssub.add_parser(
        "cp",
        help="copy one file into or out of a sandbox (ID:/path on one side), streamed",
        description=(
            "docker-style: `dsec sandbox cp SRC DST` where exactly one side is ID:/path. "
            "A local side `-` is stdin (upload) or stdout (download). A destination that is "
            "a directory (or ends with /) gets the source's file name. The file's mode is "
            "kept. A progress bar goes to stderr when it is a terminal."
        ),
    )
    scp.add_argument("src", help="LOCAL_PATH, - (stdin) or ID:/path")
    scp.add_argument("dst", help="ID:/path, LOCAL_PATH or - (stdout)")
    scp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    scp.set_defaults(fn=cmd_cp)

    slg = ssub.add_parser(
        "logs",
        help="output of the sandbox's background commands (replayed, then followed with -f)",
        description=(
            "Prints what the sandbox's background commands (sb.start, stream(background=True)) "
            "and the commands running now wrote to stdout and stderr, as their sandbox holds "
            "it: everything when it fits the command's output cap (max_output_bytes, 1 MiB per "
            "stream by default), else its head and tail. Without EXEC_ID every such command "
            "in start order, under a `==> EXEC_ID: COMMAND <==` header when there are several "
            "(as tail does). Without -f it ends once the held output is printed; -f follows "
            "until every command exited (or Ctrl-C). stdout goes to stdout, stderr to stderr."
        ),
    )
    slg.add_argument("sandbox_id", help="the sandbox's id (sb-...)")
    slg.add_argument("exec_id", nargs="?", default="", help="only this command (see `ps`)")
    slg.add_argument(
        "-f", "--follow", action="store_true", help="keep printing new output until they exit"
    )
    json_option(slg, "one JSON object per output chunk: exec_id, stream, offset, data")
    slg.set_defaults(fn=cmd_logs)

    sps = ssub.add_parser("ps", help="the sandbox's commands: exec id, state, command")
    sps.add_argument("sandbox_id", help="the sandbox's id (sb-...)")
    json_option(sps, "print a JSON array of commands")
    sps.set_defaults(fn=cmd_ps)

    for action, what in (
        ("pause", "freeze it and give its memory back to the node (files and processes kept)"),
        ("resume", "thaw a paused sandbox"),
    ):
        sp = ssub.add_parser(action, help=what)
        sp.add_argument("sandbox_id", help="the sandbox's id (sb-...)")
        json_option(sp, "print the sandbox as one JSON object")
        sp.set_defaults(fn=cmd_pause_resume)

    ss = ssub.add_parser("stop", help="stop one sandbox, or every sandbox of --task")
    ss.add_argument("sandbox_id", nargs="?", default="", help="the sandbox's id (sb-...)")
    ss.add_argument("--task", default="", help="stop every sandbox of this task instead")
    ss.add_argument(
        "--grace-s", type=float, default=2.0, help="SIGTERM, then SIGKILL after this many seconds"
    )
    json_option(ss, "print the stopped sandbox (or the ids of --task) as JSON")
    ss.set_defaults(fn=cmd_stop)

    sw = ssub.add_parser("watch", help="one line per change (time id state reason) until Ctrl-C")
    sw.add_argument("--task", default="", help="only this task's sandboxes")
    label_option(sw)
    sw.add_argument("--json", action="store_true", help="one JSON object per line")
    sw.set_defaults(fn=cmd_watch)

    sp = ssub.add_parser("pack", help="checkpoint the writable layer as a new environment")
    sp.add_argument("sandbox_id", help="the sandbox's id (sb-...)")
    sp.add_argument("name", help="the new environment's name, e.g. my-env:v2")
    sp.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="also leave out these absolute path globs (repeatable)",
    )
    sp.add_argument(
        "--no-default-excludes",
        action="store_true",
        help="keep build residue too (/tmp, caches, shell history, ...)",
    )
    json_option(sp, "print the environment as one JSON object")
    sp.set_defaults(fn=cmd_pack)


def _create_parser(ssub: Any) -> None:
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
        "--idempotency-key",
        default="",
        help="a retried create with the same key returns the first one's sandbox (with "
        "--count: KEY-0, KEY-1, ...)",
    )
    sc.add_argument("--count", type=int, default=1, help="create this many in one call")
    sc.add_argument(
        "--no-wait", action="store_true", help="return once created, before they are running"
    )
    json_option(sc, "print the sandbox (with --count: an array of sandboxes or errors) as JSON")
    sc.set_defaults(fn=cmd_create)


def _exec_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-i",
        "--interactive",
        action="store_true",
        help="forward stdin also when it is a terminal (a pipe or file always is)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        type=key_value,
        metavar="KEY=VALUE",
        help="an environment variable of the command (repeatable)",
    )
    p.add_argument("--cwd", default="", help="working directory (default: the sandbox's)")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=0.0,
        help="kill the command after this many seconds and exit 124 (default: no limit)",
    )
    p.add_argument(
        "--max-output-bytes",
        type=int,
        default=EXEC_OUTPUT_BYTES,
        help=f"forward at most this much of each stream (default {EXEC_OUTPUT_BYTES // MIB} MiB;"
        " the platform allows up to 64 MiB)",
    )


def _split_command(args: argparse.Namespace) -> list[str]:
    """The command of ``exec`` (what follows ``--``); exec's options written between the
    sandbox id and ``--`` (argparse leaves them in the remainder) are parsed here."""
    rest = list(args.argv)
    if "--" not in rest:
        return rest
    cut = rest.index("--")
    if cut:
        options = argparse.ArgumentParser(prog="dsec sandbox exec ID", add_help=False)
        _exec_options(options)
        options.parse_args(rest[:cut], namespace=args)
    return rest[cut + 1 :]


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
            sb = c.create(wait=not args.no_wait, **options)
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
            made = c.create_many(specs=specs, wait=wait)
        else:
            made = c.create_many(args.count, wait=wait, **options)
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


# -------------------------------------------------------------- list, show


def cmd_list(args: argparse.Namespace) -> int:
    with client() as c:
        infos = c.list(task_id=args.task, labels=dict(args.label), states=args.state)
    if args.json:
        print_json(infos)
        return 0
    for s in infos:
        reason = f" ({s.termination_reason})" if s.termination_reason else ""
        print(
            f"{s.id}  {s.state:<10}{reason} {s.image:<16} task={s.task_id or '-'} edge={s.edge_id}"
        )
    return 0


def sandbox_record(c: Any, sandbox_id: str) -> dict[str, Any]:
    """Everything GetSandbox says about a sandbox (the SDK's SandboxInfo with its spec, start
    and last-activity times and creator), as JSON-ready data."""
    return dict(plain(c.get(sandbox_id).info))


def cmd_show(args: argparse.Namespace) -> int:
    with client() as c:
        record = sandbox_record(c, args.sandbox_id)
    if args.json:
        print_json(record)
        return 0
    spec = record["spec"]
    rows = [
        ("state", record["state"]),
        (
            "reason",
            f"{record['termination_reason']}: {record['termination_message']}"
            if record["termination_reason"]
            else "-",
        ),
        ("backend", record["backend"]),
        ("image", record["image"] + "".join(f" + {t}" for t in spec["toolkits"])),
        ("edge", record["edge_id"] or "-"),
        ("project", record["project_id"]),
        ("task", record["task_id"] or "-"),
        ("labels", _pairs(record["labels"])),
        (
            "resources",
            f"cpu {spec['cpu'] or 'default'}, memory {_unit(spec['memory_mb'], 'MiB')}, "
            f"pids {spec['pids_max'] or 'default'}, disk {_unit(spec['disk_mb'], 'MB')}, "
            f"gpus {spec['gpus']}",
        ),
        ("qos", "best-effort" if spec["best_effort"] else "latency-sensitive"),
        ("network", _network_text(spec["network"])),
        ("env", _pairs(spec["env"])),
        ("workdir", spec["workdir"] or "-"),
        ("node selector", _pairs(spec["node_selector"])),
        ("created", record["created_at"] or "-"),
        ("started", record["started_at"] or "-"),
        ("last active", record["last_active_at"] or "-"),
        ("expires", f"{record['expires_at'] or '-'} (ttl {spec['ttl_s']} s)"),
        ("idle timeout", f"{spec['idle_timeout_s']} s" if spec["idle_timeout_s"] else "never"),
        ("memory", _memory_text(record["memory"])),
        (
            "violations",
            _pairs({k: v for k, v in record["violations"].items() if isinstance(v, int) and v}),
        ),
        ("blocked names", _pairs(record["violations"]["blocked_names"])),
        ("created by", record["principal_id"] or "-"),
    ]
    print(record["id"])
    for name, value in rows:
        print(f"  {name:<14}{value}")
    return 0


def _unit(value: int, unit: str) -> str:
    return f"{value} {unit}" if value else "default"


def _pairs(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(d.items())) or "-"


def _network_text(net: dict[str, Any]) -> str:
    parts = ["open" if net["open"] else "allowlist" if net["allow"] else "none"]
    if net["allow"]:
        parts.append("allow " + " ".join(net["allow"]))
    if net["deny"]:
        parts.append("deny " + " ".join(net["deny"]))
    if net["max_blocked_connects"]:
        parts.append(f"ends after {net['max_blocked_connects']} blocked connects")
    return "; ".join(parts)


def _memory_text(m: dict[str, Any] | None) -> str:
    if m is None:
        return "not measured"
    text = (
        f"{m['resident_bytes'] / MIB:.1f} MiB resident, {m['swapped_bytes'] / MIB:.1f} MiB swapped"
    )
    if m["released_mb"] or m["frozen_only"]:
        text += f"; pause gave back {m['released_mb']} MiB in {m['pause_s']:.2f} s"
        if m["frozen_only"]:
            text += f" (only frozen: {m['frozen_only']})"
    return text


# -------------------------------------------------------------------- exec


class _InputPump(threading.Thread):
    """Forwards a local file descriptor to a command's stdin (``Process.send_stdin``), chunk
    by chunk as it is read, then closes it at end of input. A daemon: a read still blocked
    when the command has exited is abandoned with the process. ``on_wake`` runs (on this
    thread) each time a byte arrives on ``wake_fd``: the shell's window-size changes."""

    def __init__(
        self,
        process: Any,
        fd: int,
        *,
        wake_fd: int = -1,
        on_wake: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name="dsec-stdin", daemon=True)
        self.process = process
        self.fd = fd
        self.wake_fd = wake_fd
        self.on_wake = on_wake

    def run(self) -> None:
        try:
            self._pump()
        except Exception:  # the command exited or the client closed: nothing left to feed
            return

    def _pump(self) -> None:
        fds = [self.fd] + ([self.wake_fd] if self.wake_fd >= 0 else [])
        while True:
            ready, _, _ = select.select(fds, [], []) if len(fds) > 1 else (fds, [], [])
            if self.wake_fd in ready:
                os.read(self.wake_fd, 512)
                if self.on_wake is not None:
                    self.on_wake()
            if self.fd not in ready:
                continue
            data = os.read(self.fd, 65536)
            if not data:
                self.process.close_stdin()
                return
            self.process.send_stdin(data)


def _stdin_is_terminal() -> bool:
    try:
        return os.isatty(sys.stdin.fileno())
    except (AttributeError, ValueError, OSError):  # no stdin at all
        return False


def _exit_status(status: Any, what: str, timeout_s: float) -> int:
    """The shell convention for a command's end: its code, 128+N for signal N, 124 for a
    timeout; why it could not run (or was truncated) goes to stderr."""
    if status is None:
        print(f"{what}: the command's stream ended without an exit status", file=sys.stderr)
        return EXIT_DSEC_FAILED
    if status.stdout_truncated or status.stderr_truncated:
        print(
            f"{what}: output beyond --max-output-bytes was not forwarded "
            "(a larger limit, or `dsec sandbox cp`, gets all of it)",
            file=sys.stderr,
        )
    if status.timed_out:
        print(f"{what}: timed out after {timeout_s:g} s", file=sys.stderr)
        return EXIT_TIMED_OUT
    if status.error:
        print(f"{what}: {status.error}", file=sys.stderr)
    if status.signal:
        return 128 + status.signal
    return status.exit_code if status.exit_code >= 0 else 1


@contextmanager
def _closing(events: Iterator[Any]) -> Iterator[Iterator[Any]]:
    """Ends an SDK event stream before its client closes, also when the loop over it stopped
    early (a closed pipe): the stream is cancelled while its loop still runs."""
    try:
        yield events
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            with suppress(RuntimeError):  # interrupted mid-read: the client's close ends it
                close()


class _Interrupts:
    """Ctrl-C during ``exec``: the first is sent to the command (SIGINT to its process
    group; it ends by itself, usually with 130); a second, or one before it started, ends
    dsec at once with 130 (its stream closes with the process, which kills the command)."""

    def __init__(self) -> None:
        self.process: Any = None
        self.sent = False

    def __enter__(self) -> _Interrupts:
        self._old = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._old)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.process is None or self.sent:
            with suppress(OSError, ValueError):
                sys.stdout.flush()
            os._exit(EXIT_INTERRUPTED)
        self.sent = True
        threading.Thread(
            target=self._forward, args=(self.process,), name="dsec-sigint", daemon=True
        ).start()

    @staticmethod
    def _forward(process: Any) -> None:
        with suppress(Exception):  # it exited meanwhile
            process.kill(signal.SIGINT)


def _dsec_failure_is_125(what: str) -> Callable[[Callable[[Any], int]], Callable[[Any], int]]:
    """For commands whose other exit statuses are a command's own (exec, shell): dsec's own
    failure is one error line and EXIT_DSEC_FAILED."""

    def wrap(fn: Callable[[Any], int]) -> Callable[[Any], int]:
        def run(args: Any) -> int:
            try:
                return fn(args)
            except DSecError as err:
                print(
                    f"{what}: {type(err).__name__} [{err.reason}]: {err.message}", file=sys.stderr
                )
                return EXIT_DSEC_FAILED

        return run

    return wrap


@_dsec_failure_is_125("dsec sandbox exec")
def cmd_exec(args: argparse.Namespace) -> int:
    from libdsec.types import Exited, Output, Started

    argv = _split_command(args)
    if not argv:
        print("dsec sandbox exec: give the command after --", file=sys.stderr)
        return 2
    forward = args.interactive or not _stdin_is_terminal()
    status = None
    with client() as c, _Interrupts() as interrupts:
        sb = c.get(args.sandbox_id)
        events = sb.stream(
            argv,
            cwd=args.cwd or None,
            env=dict(args.env),
            timeout_s=args.timeout_s or None,
            stdin_open=forward,
            max_output_bytes=args.max_output_bytes,
        )
        with _closing(events):
            for ev in events:
                if isinstance(ev, Started):
                    interrupts.process = sb.process(ev.exec_id)
                    if forward:
                        _InputPump(interrupts.process, sys.stdin.fileno()).start()
                elif isinstance(ev, Output):
                    out = sys.stdout.buffer if ev.stream == "stdout" else sys.stderr.buffer
                    out.write(ev.data)
                    out.flush()
                elif isinstance(ev, Exited):
                    status = ev.status
    return _exit_status(status, "dsec sandbox exec", args.timeout_s)


# ------------------------------------------------------------------- shell


@_dsec_failure_is_125("dsec sandbox shell")
def cmd_shell(args: argparse.Namespace) -> int:
    import termios
    import tty

    from libdsec.types import Exited, Output, Started

    if not _stdin_is_terminal():
        print(
            "dsec sandbox shell: stdin is not a terminal; for piped input use "
            f"`dsec sandbox exec -i {args.sandbox_id} -- sh`",
            file=sys.stderr,
        )
        return 2
    fd = sys.stdin.fileno()
    size = os.get_terminal_size(fd)
    env = {"TERM": os.environ.get("TERM") or "xterm", **dict(args.env)}
    status = None
    with client() as c:
        sb = c.get(args.sandbox_id)
        shell = args.shell or ("/bin/bash" if sb.files.exists("/bin/bash") else "/bin/sh")
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        saved = termios.tcgetattr(fd)
        old_winch = signal.signal(signal.SIGWINCH, lambda *_: _poke(wake_w))
        # A terminating signal must still restore the terminal: raise through the finally.
        old_term = signal.signal(signal.SIGTERM, _raise_exit)
        old_hup = signal.signal(signal.SIGHUP, _raise_exit)
        tty.setraw(fd, termios.TCSANOW)  # keys typed ahead are kept
        try:
            events = sb.stream(
                [shell],
                pty=(size.lines, size.columns),
                stdin_open=True,
                env=env,
                cwd=args.cwd or None,
            )
            with _closing(events):
                for ev in events:
                    if isinstance(ev, Started):
                        process = sb.process(ev.exec_id)

                        def resize(process: Any = process) -> None:
                            s = os.get_terminal_size(fd)
                            process.resize(s.lines, s.columns)

                        _InputPump(process, fd, wake_fd=wake_r, on_wake=resize).start()
                    elif isinstance(ev, Output):
                        _write_all(sys.stdout.fileno(), ev.data)
                    elif isinstance(ev, Exited):
                        status = ev.status
        finally:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
            signal.signal(signal.SIGWINCH, old_winch)
            signal.signal(signal.SIGTERM, old_term)
            signal.signal(signal.SIGHUP, old_hup)
    return _exit_status(status, "dsec sandbox shell", 0)


def _poke(fd: int) -> None:
    with suppress(OSError):  # the pipe is full: a wake-up is pending anyway
        os.write(fd, b"w")


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# ---------------------------------------------------------------------- cp


def _remote(arg: str) -> tuple[str, str] | None:
    """``ID:/path`` -> (ID, /path); a local path (``-``, ``/...``, ``./...``, no colon) ->
    None, as docker cp tells them apart."""
    if arg == "-" or arg.startswith(("/", ".")):
        return None
    sandbox_id, colon, path = arg.partition(":")
    if not colon or not sandbox_id or "/" in sandbox_id:
        return None
    return sandbox_id, path


def cmd_cp(args: argparse.Namespace) -> int:
    src, dst = _remote(args.src), _remote(args.dst)
    if (src is None) == (dst is None):
        print(
            "dsec sandbox cp: exactly one of SRC and DST must be ID:/path (the other local)",
            file=sys.stderr,
        )
        return 2
    with client() as c:
        if dst is not None:
            return _upload(c, args.src, *dst, quiet=args.quiet)
        assert src is not None
        return _download(c, *src, args.dst, quiet=args.quiet)


class _CountingReader:
    """A binary file object whose reads advance a progress bar (read on the SDK's thread)."""

    def __init__(self, fh: IO[bytes], bar: Any) -> None:
        self.fh = fh
        self.bar = bar

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.bar.update(advance=len(data))
        return data


def _upload(c: Any, local: str, sandbox_id: str, path: str, *, quiet: bool) -> int:
    sb = c.get(sandbox_id)
    if local == "-":
        fh, size, mode, name = sys.stdin.buffer, None, 0, ""
    else:
        st = os.stat(local)
        if not os.path.isfile(local):
            print(
                f"dsec sandbox cp: {local} is not a regular file (cp copies one file; for a "
                f"tree: tar c DIR | dsec sandbox exec {sandbox_id} -- tar x -C /dest)",
                file=sys.stderr,
            )
            return 1
        fh, size, mode, name = open(local, "rb"), st.st_size, st.st_mode & 0o7777, Path(local).name
    if path.endswith("/") or (sb.files.exists(path) and sb.files.stat(path).is_dir):
        if not name:
            print("dsec sandbox cp: stdin needs a file name, not a directory", file=sys.stderr)
            return 1
        path = path.rstrip("/") + "/" + name
    with fh, progress(f"{sandbox_id}:{path}", total=size, transfer=True, quiet=quiet) as bar:
        sb.files.upload(_CountingReader(fh, bar), path, mode=mode)
    return 0


def _download(c: Any, sandbox_id: str, path: str, local: str, *, quiet: bool) -> int:
    sb = c.get(sandbox_id)
    info = sb.files.stat(path)
    if info.is_dir:
        print(
            f"dsec sandbox cp: {sandbox_id}:{path} is a directory (cp copies one file; for a "
            f"tree: dsec sandbox exec {sandbox_id} -- tar c -C {path} . | tar x)",
            file=sys.stderr,
        )
        return 1
    with progress(f"{sandbox_id}:{path}", total=info.size, transfer=True, quiet=quiet) as bar:
        if local == "-":
            out = sys.stdout.buffer
            for chunk in sb.files.iter_download(path):
                out.write(chunk)
                bar.update(advance=len(chunk))
            out.flush()
            return 0
        dest = Path(local)
        if local.endswith("/") or dest.is_dir():
            dest = dest / Path(path).name
        part = dest.with_name(dest.name + ".part")
        try:
            with open(part, "wb") as fh:
                for chunk in sb.files.iter_download(path):
                    fh.write(chunk)
                    bar.update(advance=len(chunk))
            os.chmod(part, info.mode & 0o7777)
            os.replace(part, dest)
        finally:
            with suppress(FileNotFoundError):
                part.unlink()
    return 0


# -------------------------------------------------------------------- logs


def cmd_ps(args: argparse.Namespace) -> int:
    with client() as c:
        execs = c.get(args.sandbox_id).processes()
    if args.json:
        print_json(execs)
        return 0
    for e in execs:
        if e.running:
            state = "running"
        elif e.exit is not None and e.exit.signal:
            state = f"signal {e.exit.signal}"
        else:
            state = f"exit {e.exit.exit_code if e.exit else '?'}"
        print(f"{e.exec_id:<14} {state:<10} pid {e.pid:<6} {_command_text(e)}")
    return 0


def _command_text(e: Any) -> str:
    import shlex

    if e.argv[:2] == ["/bin/sh", "-c"] and len(e.argv) == 3:
        return e.argv[2]
    return shlex.join(e.argv) if e.argv else e.command


def cmd_logs(args: argparse.Namespace) -> int:
    with client() as c:
        sb = c.get(args.sandbox_id)
        if args.exec_id:
            execs = [args.exec_id]
            titles = {args.exec_id: args.exec_id}
        else:
            infos = sb.processes()
            execs = [e.exec_id for e in infos]
            titles = {e.exec_id: f"{e.exec_id}: {_command_text(e)}" for e in infos}
        if not execs:
            print(
                f"dsec sandbox logs: {args.sandbox_id} has no background commands", file=sys.stderr
            )
            return 0
        printer = _LogPrinter(titles if len(execs) > 1 else {}, as_json=args.json)
        if args.follow:
            _follow(sb, execs, printer)
        else:
            for exec_id in execs:
                for ev in _held_output(sb, exec_id):
                    printer.write(exec_id, ev)
    return 0


class _LogPrinter:
    """Writes output chunks to stdout/stderr (or as JSON lines), with a ``==> title <==``
    header whenever the command they come from changes (only when there are several)."""

    def __init__(self, titles: dict[str, str], *, as_json: bool) -> None:
        self.titles = titles
        self.as_json = as_json
        self.last = ""

    def write(self, exec_id: str, ev: Any) -> None:
        if self.as_json:
            print_json_line(
                {"exec_id": exec_id, "stream": ev.stream, "offset": ev.offset, "data": ev.data}
            )
            return
        if self.titles and exec_id != self.last:
            sys.stdout.write(f"{'' if not self.last else chr(10)}==> {self.titles[exec_id]} <==\n")
            sys.stdout.flush()
        self.last = exec_id
        out = sys.stdout.buffer if ev.stream == "stdout" else sys.stderr.buffer
        out.write(ev.data)
        out.flush()


def _held_output(sb: Any, exec_id: str) -> Iterator[Any]:
    """The output a command's sandbox holds now (``attach(follow=False)``: the stream ends
    after the replay, whether the command has ended or not)."""
    from libdsec.types import Output

    for ev in sb.process(exec_id).attach(follow=False):
        if isinstance(ev, Output):
            yield ev


def _attach_thread(sb: Any, exec_id: str, events: queue.Queue[Any]) -> None:
    """Reads ``Process.attach`` on a daemon thread into ``events``: (exec_id, event) items,
    then None (or the error) at its end."""

    def run() -> None:
        try:
            for ev in sb.process(exec_id).attach():
                events.put((exec_id, ev))
            events.put(None)
        except BaseException as exc:  # handed to the reader, who raises it
            events.put(exc)

    threading.Thread(target=run, name=f"dsec-attach-{exec_id}", daemon=True).start()


def _follow(sb: Any, execs: list[str], printer: _LogPrinter) -> None:
    """Every command's output as it comes, until all exited (or Ctrl-C)."""
    from libdsec.types import Output

    events: queue.Queue[Any] = queue.Queue()
    for exec_id in execs:
        _attach_thread(sb, exec_id, events)
    left = len(execs)
    try:
        while left:
            item = events.get()
            if item is None or isinstance(item, BaseException):
                left -= 1
                if isinstance(item, DSecError):
                    raise item
                continue
            exec_id, ev = item
            if isinstance(ev, Output):
                printer.write(exec_id, ev)
    except KeyboardInterrupt:
        return


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


__all__ = ["add_parser", "sandbox_record"]
