"""The few thread primitives chronus uses, on `_thread` alone.

Why not `threading`: in a fresh interpreter, `import threading` also imports `collections`,
`functools`, `types`, `operator`, `reprlib`, ... — ~4 ms of CPU per sandbox start on this machine
kind (measured with `selectors` and `queue`, which pull the same in: 14.6 vs 10.2 ms for the
C-level equivalents), paid by every sandbox before its first command. The semantics below are
CPython's own (`threading.Condition`/`Event`), minus what chronus never uses (named or joinable
threads, `wait_for`, re-entrant condition locks).
"""

from __future__ import annotations

import _thread

Lock = _thread.allocate_lock
RLock = _thread.RLock
get_ident = _thread.get_ident

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def start_thread(target: Callable[..., Any], *args: Any) -> int:
    """Run target(*args) in a new thread (never joined: chronus ends with os._exit)."""
    return _thread.start_new_thread(target, args)


class Condition:
    """threading.Condition over a plain (non-reentrant) lock."""

    def __init__(self, lock: Any = None) -> None:
        self._lock = lock if lock is not None else _thread.allocate_lock()
        self._waiters: list[Any] = []

    def __enter__(self) -> bool:
        return bool(self._lock.acquire())

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return bool(self._lock.acquire(blocking, timeout))

    def release(self) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Release the lock, sleep until notified or `timeout` seconds, take it again."""
        waiter = _thread.allocate_lock()
        waiter.acquire()
        self._waiters.append(waiter)
        self._lock.release()
        got = False
        try:
            if timeout is None:
                got = waiter.acquire()
            elif timeout > 0:
                got = waiter.acquire(True, timeout)
            else:
                got = waiter.acquire(False)
            return got
        finally:
            self._lock.acquire()
            if not got:
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass

    def notify(self, n: int = 1) -> None:
        """Wake up to n waiters (the caller holds the lock)."""
        while self._waiters and n > 0:
            waiter = self._waiters.pop(0)
            try:
                waiter.release()
            except RuntimeError:
                continue  # it timed out meanwhile
            n -= 1

    def notify_all(self) -> None:
        self.notify(len(self._waiters))


class Event:
    """threading.Event."""

    def __init__(self) -> None:
        self._cond = Condition()
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with self._cond:
            self._flag = True
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            if not self._flag:
                self._cond.wait(timeout)
            return self._flag
