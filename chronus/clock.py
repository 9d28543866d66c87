"""The running clock: CLOCK_MONOTONIC minus the time chronus was not running.

A paused container sandbox is frozen (cgroup freezer) for minutes to hours, and CLOCK_MONOTONIC
runs on meanwhile: a timer on it would count the pause (a command with a 60 s timeout started
10 s before a 90 s pause would be killed at the thaw, having run 10 s). A microVM's guest clock
stops with the VM, so there the pause is not counted. Every chronus deadline is kept on this
clock instead, so that the two backends agree: a timeout counts the time the sandbox ran.

The reactor finds the stalls (`Reactor._run`, the one place that waits with a known timeout, as
aether's loop does: `aether.server.Server._credit_stall`): a stretch of its loop (a wait and the
callbacks before it; then the callbacks after it, which ask no wait) that took more than STALL_S
longer than the wait it asked for was frozen (or starved), and the whole stretch is taken off
the clock (`stalled`) before any callback runs. Where in it the freeze began is unknown, and a
deadline must not pass early, so this errs on the command's side, by at most the wait asked
(and callbacks' few milliseconds). While a timer is pending the reactor never waits longer
than MAX_WAIT_S, which bounds that error; with none it sleeps as long as it likes (no wakeups
in an idle sandbox), and no deadline needs the clock then. A freeze that makes no turn more
than STALL_S late (one of at most STALL_S + MAX_WAIT_S) counts as running time.

Threads: only the reactor thread writes `stalled_s` (a float rebinding, atomic under the GIL);
any thread may read `now()`. A thread other than the reactor's cannot tell at a thaw whether the
stall has been taken off yet, so it never judges a deadline itself: it asks the reactor for a
`Deadline` (`Reactor.deadline`), which the reactor raises after crediting the stall. For the
same reason a start read by another thread at a thaw may be ahead by the stall: the reactor
counts from the earlier of it and its own turn's time (`Exec._arm_timeout`, `Reactor._arm`),
and `wait_for_port`'s waited_s is clamped at 0. The reactor's callbacks use the time of their
turn (`Reactor.now`), not a fresh read, for the same reason.
"""

from __future__ import annotations

from time import monotonic

#: A loop turn that came back this much later than it asked to did not run (as aether's).
STALL_S = 1.0
#: The longest the reactor waits while a timer is pending: what a stall may take off too much.
MAX_WAIT_S = 1.0


class Clock:
    __slots__ = ("stalled_s",)

    def __init__(self) -> None:
        self.stalled_s = 0.0  # taken off CLOCK_MONOTONIC so far

    def now(self) -> float:
        """Seconds of running time (any thread; only differences mean anything)."""
        return monotonic() - self.stalled_s

    def stalled(self, started: float, asked: float, ended: float) -> float:
        """A turn that began at monotonic `started`, waited for up to `asked` seconds and came
        back at `ended`: if it is late by more than STALL_S, take the whole turn off the clock and
        return its length; else 0.0. The reactor thread only."""
        turn = ended - started
        if turn - asked <= STALL_S:
            return 0.0
        self.stalled_s += turn
        return turn
