"""aether: the sandbox's init process and the proxy between the edge and chronus.

Process tree (inside the sandbox's pid namespace)::

    aether (pid 1)                 init: reaps orphans, relays frames, never runs commands
    └── chronus                    forked from aether; the engine (package `chronus`)
        ├── <command>              one session (setsid) per command: own process group
        │   └── ...                grandchildren; killed by session id at timeout
        └── <shell> -i             one per shell session, on its own pseudo-terminal
            └── <job>              job control: one process group per pipeline

Channel: the edge hands aether an already-listening Unix stream socket as fd 3
(vsock or virtio-serial for VMs). One edge connection is active at a time; a new
one replaces the old, whose streams are cancelled. Background commands and
shell sessions are not streams: they live on while no edge is connected. Frames
are a 4-byte big-endian length and one `dsec.aether.v1.Frame` (<= 8 MiB); the
first frame on each connection is Hello. aether answers Ping, pings an idle
edge after 5 s and drops a silent one after 20 s.

Relay: aether and chronus speak the same frames over a socketpair. aether does
not decode call bodies: it reads the Frame's top-level fields (`insandbox.wire.split_frame`)
and rewrites the stream id, because edge stream ids restart with each
connection while chronus may still be ending the previous connection's
streams. Control frames (Ping, Shutdown) are handled by aether itself.

Reaping: aether waits for any child (`waitpid(-1)`), which only ever returns
its own children: chronus, and orphans re-parented to pid 1 (or to aether as a
subreaper when it is not pid 1, as in tests). Commands are children of chronus,
which waits for each by pid (pidfd), so no exit status is ever stolen. If
chronus dies, aether ends its in-flight streams with UNAVAILABLE /
CHRONUS_RESTARTED and forks a new one; the old commands are orphans aether
reaps.

Shutdown (frame, or SIGTERM with a 2 s grace): SIGTERM to every descendant's
process group, wait, SIGKILL the rest, exit 0.

Hardening: both processes are non-dumpable (prctl), so an agent that is root
in the sandbox but lacks CAP_SYS_PTRACE cannot open /proc/<pid>/fd/* to reach
the channel; every descriptor is close-on-exec, so no command inherits the
listener, the edge connection or chronus's sockets. Logs go to stderr only
(the edge sends it to a host file), never to a file inside the sandbox.
chronus's runtime directory (session files and FIFOs) arrives from the edge
as fd 4 (DSEC_CHRONUS_RUNTIME_FD): a detached tmpfs, kept by aether for
chronus and never inherited by commands. Commands run confined by chronus
(`chronus.landlock`, `chronus.seccomp`); aether and chronus are not.

Why no protobuf library: aether and chronus run in every sandbox, on a
relocatable interpreter from the toolkit layer, with a budget of a few MB.
protobuf costs ~10 MB per process and grpc ~20 MB (measured), asyncio ~6 MB.
`insandbox.wire` encodes and decodes the contract messages from the generated table
`dsec.wire_schema.SCHEMA` with the standard library; the conformance tests
check it against the real protobuf classes. chronus is forked after every
module is imported, so the two processes share those pages copy-on-write.

Layering: aether and chronus share their in-sandbox code (the codec, the logger, the security
helpers, the poller, the process table) through the package `insandbox`; neither imports the
other. aether knows chronus by name only (`aether.server.ENGINE`): a program it runs.
"""
