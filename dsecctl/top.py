"""``dsec top``: the dashboard's picture in the terminal, refreshing.

    dsec top [--interval S] [--once] [--task T] [--json]

A frame is what the token may see, through the same APIs as every other command: the nodes
with health and load (NodeService/ListNodes: operators only; other tokens see why not), the
sandboxes of its project and the projects below it (ListSandboxes) grouped per task with state
and age, each task's state changes (pauses, resumes, ends) and the recent terminations with
their reasons.

The state changes come from this command's own watch (WatchSandboxes, through libdsec), so
they go back to when ``dsec top`` started, at most :data:`~apiserver.statelog.MAX_CHANGES` of
them (the dashboard keeps its own, since its API server's feed started). A change wakes the
frame at once; otherwise it is redrawn every ``--interval`` seconds (default 2).

On a terminal the frame is redrawn in place (rich's Live) until Ctrl-C (exit 0); to a pipe or
a file each frame is printed after the previous one. ``--once`` prints one frame and exits (no
watch, so no state changes: for scripts and tests); ``--json`` prints a frame as one JSON
document (with ``--once``) or one JSON object per line per refresh.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from apiserver.statelog import StateLog
from dsecctl.cli_common import client, error_json, json_option, print_json, print_json_line
from libdsec.errors import DSecError, PermissionDenied

if TYPE_CHECKING:
    from rich.console import RenderableType

    from libdsec import Client, SandboxInfo

DEFAULT_INTERVAL_S = 2.0
INTERVAL_RANGE_S = (0.5, 3600.0)
#: Terminations shown in the text frame (the most recent; --json has every one listed).
TERMINATIONS_SHOWN = 10
#: State changes shown per task in the text frame (the most recent).
CHANGES_SHOWN = 8
#: Sandboxes shown per task in the text frame (live ones first, oldest first; --json has all).
ROWS_PER_TASK = 30
#: The watch is opened again this long after it broke.
WATCH_RETRY_S = 2.0


def interval(value: str) -> float:
    """--interval: seconds, within :data:`INTERVAL_RANGE_S`."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    lo, hi = INTERVAL_RANGE_S
    if not math.isfinite(seconds) or not lo <= seconds <= hi:
        raise argparse.ArgumentTypeError(f"{value}: must be {lo:g}..{hi:g} seconds")
    return seconds


def _stamp(t: datetime.datetime | None) -> float | None:
    return t.timestamp() if t is not None else None


def sandbox_row(info: SandboxInfo) -> dict[str, Any]:
    """A sandbox as a frame carries it (the fields of the dashboard's JSON)."""
    spec = info.spec
    return {
        "id": info.id,
        "project_id": info.project_id,
        "task_id": info.task_id,
        "state": info.state,
        "edge_id": info.edge_id,
        "backend": info.backend,
        "image": info.image,
        "cpu_millis": round(spec.cpu * 1000) if spec is not None else 0,
        "memory_mb": spec.memory_mb if spec is not None else 0,
        "labels": info.labels,
        "created_at": _stamp(info.created_at),
        "terminated_at": _stamp(info.terminated_at),
        "termination_reason": info.termination_reason,
        "termination_message": info.termination_message,
    }


def node_row(n: Any) -> dict[str, Any]:
    """A node (watcher_pb2.EdgeStatus): ``dsec node list``'s fields and its load."""
    from dsecctl.node_cli import node_row as listed

    return {
        **listed(n),
        "cpu_millis_allocated": n.load.cpu_millis_allocated,
        "cpu_millis_capacity": n.load.cpu_millis_capacity,
        "memory_mb_allocated": n.load.memory_mb_allocated,
        "memory_mb_capacity": n.load.memory_mb_capacity,
    }


@dataclass
class Frame:
    """One picture: what the token sees now."""

    at: float
    project_id: str
    sandboxes: list[dict[str, Any]]
    nodes: list[dict[str, Any]] | None
    nodes_error: dict[str, Any] | None
    history: list[dict[str, Any]] = field(default_factory=list)
    history_since: float | None = None
    watch_error: str = ""

    def as_json(self) -> dict[str, Any]:
        return dict(vars(self))


class Changes:
    """This command's watch, on a thread of its own: every change into a state log; ``woken``
    is set at each one (the frame is redrawn at once)."""

    def __init__(self, c: Client, task_id: str) -> None:
        self.c = c
        self.task_id = task_id
        self.log = StateLog()
        self.log.start(time.time())
        self.woken = threading.Event()
        self.error = ""
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name="dsec-top-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._closing.is_set():
            try:
                with self.c.watch(task_id=self.task_id) as changes:
                    self._watch = changes
                    self.error = ""
                    for info in changes:
                        with self._lock:
                            self.log.observe(
                                at=time.time(),
                                sandbox_id=info.id,
                                project_id=info.project_id,
                                task_id=info.task_id,
                                state=info.state,
                                reason=info.termination_reason or "",
                            )
                        self.woken.set()
            except DSecError as err:
                self.error = f"{type(err).__name__} [{err.reason}]: {err.message}"
                self.woken.set()
            self._closing.wait(WATCH_RETRY_S)  # a broken watch is opened again

    def seed(self, sandboxes: list[dict[str, Any]]) -> None:
        """States listed in a frame: a sandbox's first change seen then has a ``previous``."""
        with self._lock:
            for s in sandboxes:
                self.log.seed(s["id"], s["state"])

    def history(self) -> list[dict[str, Any]]:
        with self._lock:
            return [c.as_json() for c in self.log.history(lambda p: True, self.task_id)]

    def close(self) -> None:
        self._closing.set()
        if self._watch is not None:
            self._watch.close()
        self._thread.join(timeout=5)


def take_frame(c: Client, project_id: str, task_id: str, changes: Changes | None) -> Frame:
    from dsecctl.node_cli import list_nodes

    nodes: list[dict[str, Any]] | None = None
    nodes_error: dict[str, Any] | None = None
    try:
        nodes = [node_row(n) for n in list_nodes().nodes]
    except PermissionDenied as err:  # not an operator: the frame says so
        nodes_error = error_json(err)
    sandboxes = [sandbox_row(s) for s in c.list(task_id=task_id, include_subprojects=True)]
    if changes is not None:
        changes.seed(sandboxes)
    return Frame(
        at=time.time(),
        project_id=project_id,
        sandboxes=sandboxes,
        nodes=nodes,
        nodes_error=nodes_error,
        history=changes.history() if changes is not None else [],
        history_since=changes.log.since if changes is not None else None,
        watch_error=changes.error if changes is not None else "",
    )


# ----------------------------------------------------------------- rendering


def _age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _clock(t: float | None) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S") if t is not None else ""


_STATE_STYLE = {
    "RUNNING": "green",
    "PAUSED": "yellow",
    "PENDING": "blue",
    "STARTING": "blue",
    "STOPPING": "dim",
    "TERMINATED": "dim",
}


def _nodes_table(frame: Frame) -> RenderableType:
    from rich.table import Table
    from rich.text import Text

    if frame.nodes is None:
        why = frame.nodes_error or {}
        return Text(
            f"nodes: shown to operators ({why.get('reason', '')}: {why.get('message', '')})",
            style="dim",
        )
    table = Table(title="nodes", title_justify="left", box=None, pad_edge=False)
    for column in ("NODE", "HEALTH", "SANDBOXES", "CPU COMMITTED", "MEMORY COMMITTED"):
        table.add_column(column)
    for n in frame.nodes:
        health = n["health"] + (
            f" {n['health_reason']}" if n["health_reason"] not in ("", n["health"]) else ""
        )
        table.add_row(
            n["id"],
            Text(health, style="green" if n["health"] == "HEALTHY" else "red"),
            str(n["sandboxes"]),
            f"{n['cpu_millis_allocated'] / 1000:.1f} / {n['cpu_millis_capacity'] / 1000:.1f}",
            f"{n['memory_mb_allocated'] / 1024:.1f} / {n['memory_mb_capacity'] / 1024:.1f} GiB",
        )
    return table


def _tasks(frame: Frame) -> Iterable[RenderableType]:
    from rich.table import Table
    from rich.text import Text

    by_task: dict[str, list[dict[str, Any]]] = {}
    for s in frame.sandboxes:
        by_task.setdefault(s["task_id"], []).append(s)
    history: dict[str, list[dict[str, Any]]] = {}
    for c in frame.history:
        history.setdefault(c["task_id"], []).append(c)
    if not by_task:
        yield Text("no sandboxes", style="dim")
    for task_id in sorted(by_task, key=lambda t: (t == "", t)):
        sandboxes = sorted(
            by_task[task_id],
            key=lambda s: (s["state"] == "TERMINATED", s["created_at"] or 0.0, s["id"]),
        )
        counts: dict[str, int] = {}
        for s in sandboxes:
            counts[s["state"]] = counts.get(s["state"], 0) + 1
        summary = ", ".join(f"{n} {state.lower()}" for state, n in counts.items())
        table = Table(
            title=f"task {task_id or '(none)'}  ({summary})",
            title_justify="left",
            box=None,
            pad_edge=False,
        )
        for column in ("SANDBOX", "STATE", "AGE", "NODE", "IMAGE", "ENDED"):
            table.add_column(column, no_wrap=True)
        for s in sandboxes[:ROWS_PER_TASK]:
            end = s["terminated_at"] or frame.at
            table.add_row(
                s["id"],
                Text(s["state"], style=_STATE_STYLE.get(s["state"], "")),
                _age(end - (s["created_at"] or end)),
                s["edge_id"] or "-",
                s["image"],
                s["termination_reason"] or "",
            )
        yield table
        if len(sandboxes) > ROWS_PER_TASK:
            yield Text(f"  ... and {len(sandboxes) - ROWS_PER_TASK} more", style="dim")
        for c in history.get(task_id, [])[-CHANGES_SHOWN:]:
            step = f"{c['previous']} → {c['state']}" if c["previous"] else c["state"]
            reason = f" ({c['reason']})" if c["reason"] else ""
            yield Text(f"  {_clock(c['at'])}  {c['sandbox_id']}  {step}{reason}", style="dim")


def _terminations(frame: Frame) -> RenderableType:
    from rich.table import Table
    from rich.text import Text

    ended = sorted(
        (s for s in frame.sandboxes if s["state"] == "TERMINATED"),
        key=lambda s: s["terminated_at"] or 0.0,
        reverse=True,
    )[:TERMINATIONS_SHOWN]
    if not ended:
        return Text("recent terminations: none", style="dim")
    table = Table(title="recent terminations", title_justify="left", box=None, pad_edge=False)
    for column in ("ENDED", "SANDBOX", "TASK", "REASON", "MESSAGE"):
        table.add_column(column, no_wrap=column != "MESSAGE")
    for s in ended:
        table.add_row(
            _clock(s["terminated_at"]),
            s["id"],
            s["task_id"] or "-",
            s["termination_reason"] or "?",
            s["termination_message"],
        )
    return table


def render(frame: Frame, interval_s: float | None) -> RenderableType:
    from rich.console import Group
    from rich.text import Text

    every = f"  every {interval_s:g} s (Ctrl-C ends)" if interval_s else ""
    since = (
        f"  state changes since {_clock(frame.history_since)}"
        if frame.history_since is not None
        else "  (--once: no watch, no state changes)"
    )
    parts: list[RenderableType] = [
        Text(f"dsec top  project {frame.project_id}  {_clock(frame.at)}{every}{since}", "bold"),
        Text(""),
        _nodes_table(frame),
        Text(""),
        *_tasks(frame),
        Text(""),
        _terminations(frame),
    ]
    if frame.watch_error:
        parts.append(Text(f"watch: {frame.watch_error} (opened again)", style="red"))
    return Group(*parts)


# ------------------------------------------------------------------- command


def cmd_top(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    with client() as c:
        project_id = c.whoami().project_id
        if args.once:
            frame = take_frame(c, project_id, args.task, None)
            if args.json:
                print_json(frame.as_json())
            else:
                Console().print(render(frame, None))
            return 0
        changes = Changes(c, args.task)
        changes.start()
        console = Console()
        try:
            if args.json or not console.is_terminal:
                while True:
                    frame = take_frame(c, project_id, args.task, changes)
                    if args.json:
                        print_json_line(frame.as_json())
                    else:
                        console.print(render(frame, args.interval))
                        console.print()
                    sys.stdout.flush()
                    changes.woken.wait(args.interval)
                    changes.woken.clear()
            with Live(console=console, auto_refresh=False, screen=False) as live:
                while True:
                    frame = take_frame(c, project_id, args.task, changes)
                    live.update(render(frame, args.interval), refresh=True)
                    changes.woken.wait(args.interval)
                    changes.woken.clear()
        except KeyboardInterrupt:
            return 0
        finally:
            changes.close()


def add_parser(sub: Any) -> None:
    top = sub.add_parser(
        "top", help="nodes, sandboxes per task, state changes and terminations, refreshing"
    )
    top.add_argument(
        "--interval",
        type=interval,
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help=f"seconds between frames ({INTERVAL_RANGE_S[0]:g}..{INTERVAL_RANGE_S[1]:g}; "
        f"default {DEFAULT_INTERVAL_S:g}); a change redraws at once",
    )
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument("--task", default="", help="only the sandboxes of this task")
    json_option(top, "a frame as JSON: one document with --once, else one line per frame")
    top.set_defaults(fn=cmd_top)
