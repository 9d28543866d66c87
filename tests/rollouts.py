"""Concurrent RL-style rollouts against a cluster, every call recorded: what the chaos test
(tests/integration/test_chaos.py) and bench/bench_restarts.py run while they kill services.

Each worker thread loops until told to stop (or ``max_rounds``): create a sandbox, write a
file, start a background command that counts to ``COUNT`` (one line every ``STEP_S``), run a
command reading the file back, and stop every other sandbox it made. Every call's start, end,
outcome and deadline are recorded, so a test can say which calls failed, whether any hung past
its deadline, and what must still be alive afterwards.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from libdsec import Client, Sandbox
from libdsec.errors import DSecError

#: The background command: prints 1..COUNT, one line every STEP_S.
COUNT = 24
STEP_S = 0.5
BACKGROUND = f"for i in $(seq 1 {COUNT}); do echo $i; sleep {STEP_S}; done"
#: Deadlines of the calls (seconds): a create waits for its sandbox; the others are short.
CREATE_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 30.0
#: A worker whose create failed waits this long before its next round.
FAILED_CREATE_PAUSE_S = 0.5

T = TypeVar("T")


@dataclass
class Call:
    what: str
    started: float
    ended: float
    deadline_s: float
    error: str = ""  # "" = it worked; else "<ErrorType>[REASON]: message"


@dataclass
class Background:
    sandbox_id: str
    exec_id: str
    started: float


@dataclass
class Rollouts:
    """``workers`` threads, each with its own client of ``target`` / ``token``."""

    target: str
    token: str
    workers: int = 3
    max_rounds: int = 100
    labels: dict[str, str] = field(default_factory=lambda: {"rollout": uuid.uuid4().hex[:8]})
    calls: list[Call] = field(default_factory=list)
    created: dict[str, float] = field(default_factory=dict)  # sandbox id -> when
    stopped: set[str] = field(default_factory=set)  # told to stop, and the stop worked
    backgrounds: list[Background] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        for i in range(self.workers):
            t = threading.Thread(target=self._worker, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout_s: float = 180.0) -> None:
        """Stops the workers after their current call; raises if one is still stuck."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        assert not stuck, f"rollout workers still in a call after {timeout_s} s: {stuck}"

    # ---------------------------------------------------------------- results

    def failed(self, since: float = 0.0, until: float = float("inf")) -> list[Call]:
        return [c for c in self.calls if c.error and since <= c.started < until]

    def hung(self, slack_s: float = 5.0) -> list[Call]:
        """Calls that ran past their deadline (plus ``slack_s`` for the client's own work)."""
        return [c for c in self.calls if c.ended - c.started > c.deadline_s + slack_s]

    def first_success_after(self, t: float, what: tuple[str, ...] = ()) -> float | None:
        """When the first call started at or after ``t`` (of the kinds ``what``, default any)
        ended successfully."""
        ends = [
            c.ended
            for c in self.calls
            if not c.error and c.started >= t and (not what or c.what in what)
        ]
        return min(ends) if ends else None

    # ----------------------------------------------------------------- worker

    def _call(self, what: str, deadline_s: float, fn: Callable[[], T]) -> T | None:
        started = time.monotonic()
        try:
            result = fn()
        except DSecError as err:
            self._record(Call(what, started, time.monotonic(), deadline_s, _describe(err)))
            return None
        self._record(Call(what, started, time.monotonic(), deadline_s))
        return result

    def _record(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)

    def _worker(self, index: int) -> None:
        with Client(self.target, token=self.token, timeout=CALL_TIMEOUT_S) as c:
            for round_ in range(self.max_rounds):
                if self._stop.is_set():
                    return
                self._round(c, index, round_)

    def _round(self, c: Client, index: int, round_: int) -> None:
        sb: Sandbox | None = self._call(
            "create",
            CREATE_TIMEOUT_S,
            lambda: c.create(
                image="busybox",
                cpu=0.1,
                memory_mb=32,
                labels=self.labels,
                timeout=CREATE_TIMEOUT_S,
            ),
        )
        if sb is None:
            time.sleep(FAILED_CREATE_PAUSE_S)  # as a trainer would, rather than spin
            return
        with self._lock:
            self.created[sb.id] = time.monotonic()
        payload = f"{index}-{round_}-{uuid.uuid4().hex}"
        self._call("write", CALL_TIMEOUT_S, lambda: sb.files.write("/work/payload", payload))
        proc: Any = self._call("start", CALL_TIMEOUT_S, lambda: sb.start(BACKGROUND))
        if proc is not None:
            with self._lock:
                self.backgrounds.append(Background(sb.id, proc.exec_id, time.monotonic()))
        self._call("run", CALL_TIMEOUT_S, lambda: sb.run("cat /work/payload", timeout_s=20))
        if round_ % 2 == 1 and self._call("stop", CALL_TIMEOUT_S, sb.stop) is not None:
            with self._lock:
                self.stopped.add(sb.id)


def _describe(err: DSecError) -> str:
    return f"{type(err).__name__}[{err.reason}]: {err.message}"
