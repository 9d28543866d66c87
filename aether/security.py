"""prctl(2) settings of the in-sandbox agents.

ctypes is imported at start (here, and by chronus.seccomp, whose Filter installs
the sandbox's profile too): the settings are inherited by chronus across fork.
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


SECCOMP_FD_ENV = "DSEC_AETHER_SECCOMP_FD"


def install_seccomp_from_env(environ: dict[str, str] | None = None) -> str | None:
    """Install the sandbox's seccomp filter, handed over by the edge as a sealed memfd named
    by DSEC_AETHER_SECCOMP_FD (struct sock_filter[], compiled once per node from the runtime's
    profile; see edge/runtime/seccomp_bpf.py). Called first thing, before chronus exists: every
    later process of the sandbox inherits the filter and cannot remove it. runc has already set
    no_new_privs. Returns None when done or not asked for, else why it failed (aether must then
    refuse to run: a sandbox without its filter is never started)."""
    import os

    env = os.environ if environ is None else environ
    raw = env.pop(SECCOMP_FD_ENV, None)  # chronus and commands need not see it
    if not raw:
        return None
    try:
        fd = int(raw)
        size = os.fstat(fd).st_size
        code = os.pread(fd, size, 0)
        os.close(fd)
    except (ValueError, OSError) as exc:
        return f"{SECCOMP_FD_ENV}={raw}: cannot read the filter: {exc}"
    if not code or len(code) % 8 or len(code) // 8 > 4096:
        return f"{SECCOMP_FD_ENV}={raw}: not a seccomp program ({len(code)} bytes)"
    from chronus.seccomp import Filter

    try:
        Filter(code).install()
    except OSError as exc:
        return f"{exc.strerror or exc}: {os.strerror(exc.errno or 0)}"
    return None
