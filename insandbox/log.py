"""A minimal stderr logger for the in-sandbox agents.

`logging` costs ~1.3 MB per process (measured); aether and chronus run in
every sandbox, so they use this instead: one line per record on stderr,
which the edge redirects to a host file outside the sandbox. Nothing is ever
written to a file inside the sandbox (agents have searched logs for answers).
"""

from __future__ import annotations

import os
import time

_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40}
_threshold = _LEVELS.get(os.environ.get("DSEC_AETHER_LOG_LEVEL", "INFO").upper(), 20)


class Logger:
    """The subset of `logging.Logger` the agents use."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def _emit(self, level: str, msg: str, args: tuple[object, ...]) -> None:
        if _LEVELS[level] < _threshold:
            return
        if args:
            msg = msg % args
        now = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
        line = f"{stamp}.{int(now % 1 * 1000):03d}Z {level} {self.name}[{os.getpid()}]: {msg}\n"
        try:
            os.write(2, line.encode("utf-8", "replace"))
        except OSError:
            pass  # a closed stderr must never take the agent down

    def debug(self, msg: str, *args: object) -> None:
        self._emit("DEBUG", msg, args)

    def info(self, msg: str, *args: object) -> None:
        self._emit("INFO", msg, args)

    def warning(self, msg: str, *args: object) -> None:
        self._emit("WARNING", msg, args)

    def error(self, msg: str, *args: object) -> None:
        self._emit("ERROR", msg, args)

    def exception(self, msg: str, *args: object) -> None:
        import traceback  # only on the error path: it pulls in linecache and tokenize

        self._emit("ERROR", msg + "\n" + traceback.format_exc().rstrip(), args)


def get_logger(name: str) -> Logger:
    return Logger(name)
