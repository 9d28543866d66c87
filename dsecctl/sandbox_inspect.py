"""``dsec sandbox list|show|ps|logs``: what a sandbox is and what ran in it."""

from __future__ import annotations

import argparse
import queue
import sys
import threading
from collections.abc import Iterator
from typing import Any

from dsecctl.cli_common import MIB, client, plain, print_json, print_json_line
from libdsec.errors import DSecError

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


# ------------------------------------------------------------ operation log


def cmd_oplog(args: argparse.Namespace) -> int:
    """``dsec sandbox log ID [--follow] [--json]``: the sandbox's operation log."""
    with client() as c:
        sb = c.get(args.sandbox_id)
        ops = sb.follow_log() if args.follow else iter(sb.log(with_bodies=args.json))
        for op in ops:
            if args.json:
                print_json_line(op.to_json(sb.id))
            else:
                print(_operation_line(op), flush=True)
    return 0


def _operation_line(op: Any) -> str:
    """One entry: seq, time, kind, state and result, operation id, what it was."""
    import time as _time

    at = _time.strftime("%H:%M:%S", _time.localtime(op.started_at)) if op.started_at else "-"
    took = f"{op.ended_at - op.started_at:.2f}s" if op.ended_at and op.started_at else "-"
    if op.state != "SUCCEEDED":
        result = f"{op.state} {op.error_reason}".strip()
    elif op.exit_code is not None:
        result = f"exit {op.exit_code}" if not op.signal else f"signal {op.signal}"
    else:
        result = "ok"
    return f"{op.seq:>5} {at} {took:>7} {op.kind:<14} {result:<18} {op.operation_id}  {op.summary}"
