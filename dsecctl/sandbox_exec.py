"""``dsec sandbox exec|shell``: a command in a sandbox, with this terminal's input and output.

``exec`` and ``shell`` exit with the command's own status (128+N when signal N killed it, 124
when it timed out, 125 when dsec itself failed)."""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from dsecctl.cli_common import MIB, client, key_value
from libdsec.errors import DSecError

#: What ``exec`` forwards of a command's output by default (the platform's own default is
#: 1 MiB; the in-sandbox agent holds up to this much per stream while it forwards).
EXEC_OUTPUT_BYTES = 16 * MIB
EXIT_TIMED_OUT = 124  # as timeout(1)
#: `exec`/`shell`: dsec itself failed (the sandbox is gone, the cluster unreachable, ...), so
#: the command's status is unknown: docker exec's 125, never a code a command could give.
EXIT_DSEC_FAILED = 125
EXIT_INTERRUPTED = 128 + signal.SIGINT


def exec_options(p: argparse.ArgumentParser) -> None:
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
        exec_options(options)
        options.parse_args(rest[:cut], namespace=args)
    return rest[cut + 1 :]


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
