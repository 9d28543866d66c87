"""chronus: command execution, shell sessions, files and HTTP inside a sandbox.

chronus serves the calls of `dsec.chronus.v1.Request` (as dicts, see
`insandbox.wire`) arriving as frames from aether over a socketpair. Standard
library only (it runs on the toolkit's bare interpreter); see `aether` for the
process tree and the channel, and `insandbox` for what the two share (neither imports the
other: aether starts chronus by name, see `aether.server.ENGINE`).

Structure:
  engine    reads frames; one thread per stream runs the call; one write lock
  reactor   one thread and one `selectors` loop own every child's descriptors
            (pipes, pty masters, pidfds, session control FIFOs) and timers
  execs     `Exec`: head+tail capture (`output`), subscribers with stream
            offsets (reattach), stdin, timeouts; `ExecManager`: the table
  sessions  persistent shells driven by a marker protocol (module docstring)
  files     file operations; atomic writes; streamed upload and download
  httpcall  HTTP/1.1 to 127.0.0.1:<port> inside the sandbox
  clock     the running clock every timer and deadline counts (pauses left out)

Semantics worth knowing:
  * Each command runs in its own session (setsid). A timeout SIGKILLs the
    process group, every process of the session and every descendant, and
    reports exit_code -1, timed_out true (distinct from a non-zero exit).
  * Timeouts count the time the sandbox ran (`clock`): a command's, a
    session's interrupt grace and start, WaitExec's, WaitForPort's and each
    step of an HTTP request. A paused container is frozen while
    CLOCK_MONOTONIC runs on; a microVM's guest clock stops: both agree.
    duration_s is wall time (a container's pause is in it).
  * A command that cannot start (argv[0] or cwd missing) reports exit_code
    127 (126: found but not executable) with `error` set, like a shell.
  * Output is capped per stream (max_output_bytes, default 1 MiB): the first
    and last halves are kept; a sync result carries head + marker + tail.
    A stream forwards at most the cap per subscription; the exit event
    always carries the totals. Sync results are capped at 3 MiB per stream
    so that an ExecResult always fits in one 8 MiB frame.
  * When the command exits, its pipes are read for a short linger; a
    grandchild that keeps them open (`server &`) does not hold the call, and
    its later output is drained and discarded (no SIGPIPE).
  * Abandoning a foreground call (Cancel, or the edge connection dropping)
    kills its command; `background` commands live until they exit. Background
    results are kept for attach/wait (the last 64 exited).
  * ExecInput streams always keep stdin open; HalfClose closes it. On a pty,
    close_stdin sends the terminal's EOF character instead of hanging up.
  * `trusted` execs and `modified_files` answer UNIMPLEMENTED here: the edge
    serves both (a sibling container of the read-only layers; a walk of the
    writable upper layer).
  * Every command and every session's shell runs in its own Landlock domain
    with a second seccomp filter (`landlock`, `seccomp`): it cannot reach
    chronus's runtime directory (a detached tmpfs in a container), signal
    chronus, aether or another call's processes, or use dangerous ioctls.
"""
