"""A tiny single-threaded event loop for chronus's file descriptors.

One thread watches every command's pipes, pty masters, pidfds and the shell
sessions' control fifos, and runs timers (timeouts, lingering). asyncio would
do this too but costs ~6 MB per process (measured); epoll (`insandbox.poller`) costs nothing.
Other threads talk to the loop only through `call_soon`; callbacks that touch
shared exec state take the owner's lock themselves.

Timers run on the running clock (`chronus.clock`): the loop takes the time it did not run (a
paused sandbox's freeze) off it before it runs any callback, so a paused command's timeout, a
session's interrupt grace or a `Deadline` do not pass over the pause. Callbacks see the time
of their turn (`now`), read once per phase, as libuv's loop time: a freeze in the middle of a
phase is the next check's (a time read after it, before that check, would be ahead by the
freeze, and a timer armed from it late by as much).
"""

from __future__ import annotations

import heapq
import itertools
import os
from _collections import deque  # not `collections`: see chronus.threads
from time import monotonic

from chronus import threads
from chronus.clock import MAX_WAIT_S, Clock
from insandbox import poller
from insandbox.log import get_logger

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

    def fire(self) -> None:
        self.callback()


class Deadline(Timer):
    """`passed` becomes true once `delay` seconds of running time have gone by since it was made
    (`Reactor.deadline`). Any thread makes, reads and cancels one; only the reactor judges it,
    having taken a stall off its clock before it fires a timer: a thread that is thawed before
    the reactor cannot tell a pause from a wait."""

    __slots__ = ("delay", "passed")

    def __init__(self, when: float, delay: float) -> None:
        super().__init__(when, _nothing)
        self.delay = delay
        self.passed = False

    def fire(self) -> None:
        self.passed = True


def _nothing() -> None:
    pass


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
        self.clock = Clock()  # what every timer and deadline of chronus counts
        self.now = self.clock.now()  # the running time of this turn (loop thread)

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

    def deadline(self, delay: float) -> Deadline:
        """A `Deadline` `delay` seconds of running time from now (any thread)."""
        deadline = Deadline(self.clock.now() + delay, delay)
        self.call_soon(lambda: self._arm(deadline))
        return deadline

    # ------------------------------------------------ loop thread only
    def call_later(self, delay: float, fn: Callback) -> Timer:
        """Run fn `delay` seconds of running time after this turn's time."""
        return self.call_at(self.now + delay, fn)

    def call_at(self, when: float, fn: Callback) -> Timer:
        """Run fn once the running clock (`clock.now()`, `now`) reaches `when`."""
        return self._push(Timer(when, fn))

    def _arm(self, deadline: Deadline) -> None:
        if not deadline.cancelled:
            # From its making, unless that read of the clock is ahead of this turn's: made at a
            # thaw, before the stall was taken off. Then from now.
            deadline.when = min(deadline.when, self.now + deadline.delay)
            self._push(deadline)

    def _push(self, timer: Timer) -> Timer:
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
        clock, timers = self.clock, self._timers
        mark = monotonic()  # where the time since the last check began
        while True:
            while timers and timers[0][2].cancelled:
                heapq.heappop(timers)  # so that a cancelled timer keeps no wait short
            timeout: float | None = None
            if self._calls:
                timeout = 0.0
            elif timers:
                # At most MAX_WAIT_S while a timer is pending: a stall is then found within
                # that of where it began (see chronus.clock). With none, no wakeups at all.
                timeout = max(0.0, min(MAX_WAIT_S, timers[0][0] - clock.now()))
            ready = self._sel.select(timeout)
            # Two checks a turn, each before callbacks see `now`: the wait (and the previous
            # timers' callbacks), then the I/O and calls' callbacks, which ask no wait.
            mark = self._check(mark, timeout)
            for key, events in ready:
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
            mark = self._check(mark, 0.0)
            now = self.now
            while timers and timers[0][0] <= now:
                timer = heapq.heappop(timers)[2]
                if not timer.cancelled:
                    self._guard(timer.fire)

    def _check(self, mark: float, asked: float | None) -> float:
        """Takes a stall since `mark` off the clock (none is known after a wait without a bound:
        then no deadline was pending) and sets this turn's `now`; returns the new mark."""
        ended = monotonic()
        if asked is not None:
            stalled = self.clock.stalled(mark, asked, ended)
            if stalled:
                log.info("did not run for %.1fs (paused or starved): timers skip it", stalled)
        self.now = ended - self.clock.stalled_s
        return ended

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
