"""prctl(2) settings of the in-sandbox agents.

ctypes is imported only here and only at start: the settings are inherited
by chronus across fork, so chronus never needs it again.
"""

from __future__ import annotations

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def make_undumpable() -> bool:
    """Without CAP_SYS_PTRACE, nobody (not even root in the sandbox) can then
    open /proc/<pid>/fd/* of this process to reach the channel, read its
    memory or attach a debugger. Reset to dumpable by execve, so commands
    are unaffected; kept across fork, so chronus inherits it."""
    return _prctl(PR_SET_DUMPABLE, 0)


def become_subreaper() -> bool:
    """Orphans of our descendants are re-parented to us instead of to the
    real init: outside a pid namespace (tests, development), aether still
    sees and reaps every process of the sandbox."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)
