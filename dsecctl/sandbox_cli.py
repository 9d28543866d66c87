"""``dsec sandbox``: a person's day with running sandboxes, from the shell.

    dsec sandbox create --image busybox --cpu 0.5 --memory-mb 256 --label stage=eval
    dsec sandbox list --state RUNNING --label stage=eval [--json]
    dsec sandbox show ID [--json]                 everything about one sandbox
    dsec sandbox exec ID [-i] [--env K=V] [--cwd D] -- cmd args...   like `docker exec`
    dsec sandbox shell ID                         an interactive terminal (a PTY)
    dsec sandbox cp ./local ID:/work/f  |  dsec sandbox cp ID:/work/f -   (one file, streamed)
    dsec sandbox logs ID [EXEC_ID] [-f]           output of its background commands
    dsec sandbox ps ID                            its commands (exec ids for logs)
    dsec sandbox log ID [--follow] [--json]       its operation log: every call that changed it
    dsec sandbox pause|resume|stop ID
    dsec sandbox watch [--task T] [--label K=V]   one line per change until Ctrl-C
    dsec sandbox pack ID NAME                     its writable layer as a new environment
    dsec sandbox screenshot ID [-o FILE]          a desktop sandbox's screen as PNG
    dsec sandbox view ID                          the URL of its live view (with your token)

Every command that prints data takes ``--json``. A failure exits non-zero with one line on
stderr naming the command and the error; ``exec`` and ``shell`` exit with the command's own
status (128+N when signal N killed it, 124 when it timed out).
"""

from __future__ import annotations

import argparse
from typing import Any

from dsecctl.cli_common import json_option, key_value, label_option
from dsecctl.sandbox_display import add_display_parsers
from dsecctl.sandbox_exec import cmd_exec, cmd_shell, exec_options
from dsecctl.sandbox_files import cmd_cp
from dsecctl.sandbox_inspect import cmd_list, cmd_logs, cmd_oplog, cmd_ps, cmd_show
from dsecctl.sandbox_lifecycle import (
    add_create_parser,
    cmd_fork,
    cmd_pack,
    cmd_pause_resume,
    cmd_stop,
    cmd_watch,
)

STATES = ("PENDING", "STARTING", "RUNNING", "PAUSED", "STOPPING", "TERMINATED")

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
    add_create_parser(ssub)

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
    exec_options(se)
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

    sol = ssub.add_parser(
        "log",
        help="its operation log: every call that changed it, in order, with its result",
        description=(
            "The sandbox's operation log (kept by its edge, also for a while after it ended): "
            "each exec, file write, upload, remove, move, chmod, mkdir and session, in order, "
            "with its operation id, caller, times and result. --json prints the trajectory "
            "export (one JSON object per line, schema dsec.operation/v1, with the requests and "
            "kept output); --follow prints entries as they end until the sandbox ends."
        ),
    )
    sol.add_argument("sandbox_id", help="the sandbox's id (sb-...)")
    sol.add_argument("-f", "--follow", action="store_true", help="print entries as they end")
    json_option(sol, "print the trajectory export (JSON Lines)")
    sol.set_defaults(fn=cmd_oplog)

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

    sf = ssub.add_parser(
        "fork", help="N copies of a running or paused sandbox at one instant, on its node"
    )
    sf.add_argument("sandbox_id", help="the source sandbox's id (sb-...)")
    sf.add_argument("-n", "--count", type=int, default=1, help="how many children (1..64)")
    sf.add_argument(
        "--label",
        action="append",
        default=[],
        type=key_value,
        metavar="KEY=VALUE",
        help="set on every child, over the source's labels (repeatable)",
    )
    sf.add_argument("--task", default="", help="the children's task id (default: the source's)")
    sf.add_argument(
        "--ttl-s", type=int, default=0, help="the children's TTL (default: the source's)"
    )
    sf.add_argument(
        "--require-memory",
        action="store_true",
        help="refuse a files-only fork (containers) instead of making one",
    )
    json_option(sf, "print the kind, the source's stall and each child (or its error) as JSON")
    sf.set_defaults(fn=cmd_fork)

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

    add_display_parsers(ssub)


__all__ = ["add_parser"]
