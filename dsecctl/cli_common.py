"""What the ``dsec`` subcommands share: the client, ``KEY=VALUE`` arguments, JSON output and
progress bars on a terminal."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import json
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from libdsec.errors import DSecError

if TYPE_CHECKING:
    from libdsec import Client

MIB = 1024 * 1024


def client() -> Client:
    """A :class:`libdsec.Client` for $DSEC_TARGET / $DSEC_TOKEN (default: the local cluster)."""
    from libdsec import Client  # here: a command that needs no client starts faster

    return Client()


def _what(args: argparse.Namespace) -> str:
    """The command that failed, for its error line: ``dsec sandbox exec``."""
    words = [getattr(args, "topic", ""), getattr(args, "action", "")]
    return " ".join(["dsec", *(w for w in words if isinstance(w, str) and w)])


def run_command(args: argparse.Namespace) -> int:
    """Runs the parsed command (``args.fn``) and turns what it raises into the CLI's exit
    status and one line on stderr: the one place ``dsec`` and ``python -m dsecctl.grpc_cli``
    end a command."""
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
        print(f"{_what(args)}: {type(err).__name__} [{err.reason}]: {err.message}", file=sys.stderr)
        return 2
    except (TimeoutError, RuntimeError, OSError) as err:
        print(f"{_what(args)}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


def key_value(item: str) -> tuple[str, str]:
    """A ``KEY=VALUE`` argument (the value may be empty, the key not)."""
    key, eq, value = item.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {item!r}")
    return key, value


def label_option(p: argparse.ArgumentParser, help: str = "") -> None:
    p.add_argument(
        "--label",
        action="append",
        default=[],
        type=key_value,
        metavar="KEY=VALUE",
        help=help or "only sandboxes with this label (repeatable: all must match)",
    )


def json_option(p: argparse.ArgumentParser, help: str = "print one JSON document") -> None:
    p.add_argument("--json", action="store_true", help=help)


def plain(value: Any) -> Any:
    """``value`` as JSON-ready data: dataclasses as objects, datetimes as ISO 8601 text, bytes
    as UTF-8 text (undecodable bytes replaced), errors as their code, reason and message."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        # (a dict subclass's own attributes too: SandboxInfo.violations.blocked_names)
        extra = vars(value) if hasattr(value, "__dict__") else {}
        return {str(k): plain(v) for k, v in [*value.items(), *extra.items()]}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v) for v in value]
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, DSecError):
        return error_json(value)
    return value


def print_json(value: Any) -> None:
    """One JSON document on stdout (indented: a person reads it, ``jq`` parses it)."""
    print(json.dumps(plain(value), indent=2, sort_keys=False))


def print_json_line(value: Any) -> None:
    """One JSON object on one line (a stream of them: ``watch``, ``logs --json``)."""
    print(json.dumps(plain(value)), flush=True)


def error_json(err: DSecError | None) -> dict[str, Any] | None:
    if err is None:
        return None
    return {
        "code": err.code.name,
        "reason": err.reason,
        "message": err.message,
        "metadata": err.metadata,
    }


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # closed or replaced
        return False


class _NoProgress:
    """What :func:`progress` gives when stderr is not a terminal: updates go nowhere."""

    live = False

    def update(self, *, advance: float = 0, completed: float | None = None, **_: Any) -> None:
        pass

    def set_total(self, total: float | None) -> None:
        pass


class _Task:
    live = True

    def __init__(self, progress: Any, task_id: Any) -> None:
        self._progress = progress
        self._id = task_id

    def update(self, *, advance: float = 0, completed: float | None = None, **kw: Any) -> None:
        if completed is not None:
            kw["completed"] = completed
        self._progress.update(self._id, advance=advance, **kw)

    def set_total(self, total: float | None) -> None:
        self._progress.update(self._id, total=total)


@contextmanager
def progress(
    description: str, *, total: float | None = None, transfer: bool = False, quiet: bool = False
) -> Iterator[_Task | _NoProgress]:
    """A ``rich`` progress bar on stderr while the block runs, only when stderr is a terminal
    (and not ``quiet``): ``total`` None is an operation of unknown length (a spinner and the
    time elapsed), ``transfer`` shows bytes, speed and time left. Yields a task to update."""
    if quiet or not stderr_is_terminal():
        yield _NoProgress()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
    if transfer:
        columns += [DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()]
    elif total is not None:
        columns += [MofNCompleteColumn(), TimeElapsedColumn()]
    else:
        columns += [TimeElapsedColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        yield _Task(bar, bar.add_task(description, total=total))


def size_text(n: int) -> str:
    """Bytes for a person: ``512 B``, ``1.5 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def print_env(env: Any) -> None:
    """An environment: name, size, one line per layer, its config."""
    print(f"{env.name}  {len(env.layers)} layers, {size_text(env.size_bytes)}")
    for layer in env.layers:
        print(
            f"  {layer.kind.lower():<9} {layer.digest[:19]}  {size_text(layer.size_bytes):>10}"
            f"  (metadata {size_text(layer.meta_bytes)})  {layer.source}"
        )
    for k, v in sorted(env.config.items()):
        print(f"  {k}={v}")
