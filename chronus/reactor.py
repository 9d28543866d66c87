"""A tiny single-threaded event loop for chronus's file descriptors.

One thread watches every command's pipes, pty masters, pidfds and the shell
sessions' control fifos, and runs timers (timeouts, lingering). asyncio would
do this too but costs ~6 MB per process (measured); epoll (`chronus.poller`) costs nothing.
Other threads talk to the loop only through `call_soon`; callbacks that touch
shared exec state take the owner's lock themselves.
"""

from __future__ import annotations

import heapq
import itertools
import os
import time
from _collections import deque  # not `collections`: see chronus.threads

from aether.log import get_logger
from chronus import poller, threads

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    Callback = Callable[[], None]

log = get_logger("chronus.reactor")


class Timer:
    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callback) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Reactor:
    def __init__(self) -> None:
        self._sel = poller.Poller()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel.register(self._wake_r, poller.EVENT_READ, None)
        self._calls: deque[Callback] = deque()
        self._timers: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._readers: dict[int, Callback] = {}
        self._writers: dict[int, Callback] = {}
        self._thread_id = -1

    def start(self) -> None:
        self._thread_id = threads.start_thread(self._run)

    def in_loop(self) -> bool:
        return threads.get_ident() == self._thread_id

    # ------------------------------------------------ any thread
    def call_soon(self, fn: Callback) -> None:
        self._calls.append(fn)  # deque.append is atomic under the GIL
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # already awake

    # ------------------------------------------------ loop thread only
    def call_later(self, delay: float, fn: Callback) -> Timer:
        timer = Timer(time.monotonic() + delay, fn)
        heapq.heappush(self._timers, (timer.when, next(self._seq), timer))
        return timer

    def add_reader(self, fd: int, fn: Callback) -> None:
        self._readers[fd] = fn
        self._update(fd)

    def remove_reader(self, fd: int) -> None:
        if self._readers.pop(fd, None) is not None:
            self._update(fd)

    def add_writer(self, fd: int, fn: Callback) -> None:
        self._writers[fd] = fn
        self._update(fd)

    def remove_writer(self, fd: int) -> None:
        if self._writers.pop(fd, None) is not None:
            self._update(fd)

    def forget(self, fd: int) -> None:
        """Stop watching fd entirely (call before closing it)."""
        self._readers.pop(fd, None)
        self._writers.pop(fd, None)
        self._update(fd)

    def _update(self, fd: int) -> None:
        events = (poller.EVENT_READ if fd in self._readers else 0) | (
            poller.EVENT_WRITE if fd in self._writers else 0
        )
        registered = fd in self._sel.get_map()
        if not events:
            if registered:
                self._sel.unregister(fd)
        elif registered:
            self._sel.modify(fd, events)
        else:
            self._sel.register(fd, events)

    def _run(self) -> None:
        while True:
            timeout: float | None = None
            if self._timers:
                timeout = max(0.0, self._timers[0][0] - time.monotonic())
            if self._calls:
                timeout = 0
            for key, events in self._sel.select(timeout):
                fd = key.fd
                if fd == self._wake_r:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    continue
                if events & poller.EVENT_READ and fd in self._readers:
                    self._guard(self._readers[fd])
                if events & poller.EVENT_WRITE and fd in self._writers:
                    self._guard(self._writers[fd])
            while self._calls:
                self._guard(self._calls.popleft())
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                timer = heapq.heappop(self._timers)[2]
                if not timer.cancelled:
                    self._guard(timer.callback)

    @staticmethod
    def _guard(fn: Callback) -> None:
        try:
            fn()
        except Exception:
            log.exception("reactor callback failed")


class Drain:
    """Keeps reading pipes that outlive their command, discarding the data.

    A service started with `server &` keeps the command's stdout open after
    the command ends; closing our end would kill it with SIGPIPE at its next
    log line. So the read end stays open and is emptied until EOF.
    """

    def __init__(self, reactor: Reactor) -> None:
        self._reactor = reactor

    def adopt(self, fd: int) -> None:
        def on_read() -> None:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._reactor.forget(fd)
                os.close(fd)

        self._reactor.add_reader(fd, on_read)
