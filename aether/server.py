"""aether's loop: init duties, the edge connection, the relay to chronus.

Single-threaded, one epoll loop (`insandbox.poller`): the listening socket (containers) or the
channel character device (VMs: a virtio-serial port), the edge connection, the chronus channel
and the signal wake-up socket. Frames are
relayed without decoding their bodies (`wire.split_frame`); only stream ids
are rewritten, because the edge's ids restart with each connection while
chronus may still be winding down streams of the previous one.

chronus is a program aether supervises, named (`ENGINE`) and never imported: aether forks it
from its own modules or executes it, talks to it over frames, and uses nothing else of it.
"""

from __future__ import annotations

import _signal  # `signal` and `socket` build enums: ~1 MB per process
import _socket
import fcntl
import gc
import os
import sys
import time

import insandbox
from aether.config import AetherConfig
from insandbox import poller, wire
from insandbox.log import get_logger
from insandbox.proc import descendants, kill_quietly, killpg_quietly, proc_table

TYPE_CHECKING = False  # typing costs ~2 MB at run time: annotations are strings
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

log = get_logger("aether")

PROTOCOL_VERSION = 1
UNAVAILABLE = 14
HIGH_WATER = 16 * 1024 * 1024  # stop reading a side whose peer is this far behind
LOW_WATER = 4 * 1024 * 1024

F_REQUEST, F_RESPONSE, F_END, F_CANCEL, F_PING, F_PONG, F_SHUTDOWN, F_HALF_CLOSE, F_CLAIM = (
    3,
    4,
    5,
    6,
    7,
    8,
    9,
    10,
    11,
)
F_SYNC = 12
#: Set in a warm sandbox's environment: chronus waits for the edge's Claim.
WARM_ENV = "DSEC_AETHER_WARM"
#: Set by a VM guest's init (edge/backends/microvm/init.sh): claims carry a GuestIdentity.
GUEST_ENV = "DSEC_AETHER_GUEST"
DEVICE_RETRY_S = 0.02
#: The longest aether waits with nothing due (a safety net: every wait has a reason).
MAX_IDLE_WAIT_S = 60.0
#: A loop turn that came back this much later than it asked to was not running: the sandbox
#: was frozen (pause), or starved (a 0.01-cpu quota, a heavy swap-in). That time is not silence.
STALL_S = 1.0
#: The engine aether runs, by name. Exec mode: the program `python -m chronus --fd 3`. Fork mode
#: (the default): its module ENGINE_MODULE, loaded into aether before the fork so that chronus
#: shares every page aether loaded, copy-on-write; the child then calls its
#: `serve_socket(channel)`. A name, not an import: aether needs nothing else of chronus, and the
#: two share their code through `insandbox` (tests/unit/test_layering.py keeps it so).
ENGINE = "chronus"
ENGINE_MODULE = "chronus.engine"


class DeviceStream:
    """A character device used as the edge channel (a VM's virtio-serial port), with the
    socket methods `Conn` uses. The host end may come and go: EOF or an error means the edge
    is gone, and aether opens the device again (see Aether._open_device)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        if os.isatty(self.fd):  # a pty stands in for virtio-serial in tests: bytes, no echo
            import termios
            import tty

            tty.setraw(self.fd, termios.TCSANOW)

    def fileno(self) -> int:
        return self.fd

    def setblocking(self, flag: bool) -> None:
        os.set_blocking(self.fd, flag)

    def settimeout(self, timeout: float) -> None:
        os.set_blocking(self.fd, True)

    def send(self, data: bytes | bytearray) -> int:
        return os.write(self.fd, data)

    def sendall(self, data: bytes | bytearray) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def recv(self, n: int) -> bytes:
        return os.read(self.fd, n)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Conn:
    """A non-blocking framed socket (or DeviceStream) with an output buffer."""

    def __init__(self, sock: Any, name: str) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.name = name
        self.reader = wire.FrameReader()
        self.out = bytearray()
        self.last_rx = time.monotonic()
        self.closed = False

    def queue(self, payload: bytes) -> None:
        if not self.closed:
            self.out += wire.pack_frame(payload)

    def flush(self) -> None:
        while self.out and not self.closed:
            try:
                n = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.closed = True
                return
            del self.out[:n]

    def receive(self) -> list[bytes] | None:
        """Complete frames now readable; None when the peer is gone."""
        try:
            data = self.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return None
        if not data:
            return None
        self.last_rx = time.monotonic()
        return self.reader.feed(data)


class Aether:
    def __init__(self, config: AetherConfig, listener: _socket.socket | None) -> None:
        """`listener`: the listening socket the edge connects to (containers); None when the
        channel is the character device `config.channel_device` (VMs: virtio-serial)."""
        self.config = config
        # A warm sandbox: started before anyone asked for it; chronus waits for the claim.
        self.warm = os.environ.pop(WARM_ENV, "") == "1"
        # In a VM guest (set by the guest's init): the claim carries the guest's identity.
        self.guest = os.environ.pop(GUEST_ENV, "") == "1"
        self._counters_at = 0.0
        self._pids_hits = 0
        self._disk_full = ""
        self.sel = poller.Poller()
        self.listener = listener
        self._reopen_at = 0.0  # device channel: when to open the device again
        if listener is not None:
            listener.setblocking(False)
            os.set_inheritable(listener.fileno(), False)  # commands never inherit the channel
            self.sel.register(listener, poller.EVENT_READ, "listen")
        # chronus's private runtime directory (a detached tmpfs from the edge), kept for it.
        self.runtime_fd = _runtime_fd()
        self._sig_r, self._sig_w = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
        self._sig_r.setblocking(False)
        self._sig_w.setblocking(False)
        self.sel.register(self._sig_r, poller.EVENT_READ, "signal")
        self.edge: Conn | None = None
        self.chronus: Conn | None = None
        self.chronus_pid = 0
        # Frames for chronus while it restarts: delivered to the new one.
        self._chronus_backlog = bytearray()
        self._chronus_started = 0.0
        self._restart_at = 0.0
        # edge stream id <-> chronus stream id, for the current edge connection
        self._to_chronus: dict[int, int] = {}
        self._to_edge: dict[int, int] = {}
        self._next_id = 1
        self._ping_sent = False
        self._nonce = 0
        self._shutdown_grace: float | None = None

    # ------------------------------------------------------------ main loop
    def run(self) -> int:
        for sig in (_signal.SIGCHLD, _signal.SIGTERM, _signal.SIGINT):
            _signal.signal(sig, lambda *_: None)  # the wake-up fd does the work
        _signal.set_wakeup_fd(self._sig_w.fileno(), warn_on_full_buffer=False)
        # The edge connects before we run: answer its Hello first, then import and fork
        # chronus (~10 ms here) while the edge reports the sandbox RUNNING to its caller.
        # Requests that arrive meanwhile wait in the chronus backlog.
        if self.guest:
            from aether import guest

            guest.boot()
        if self.listener is not None:
            self._accept()
        else:
            self._open_device()
        if self.warm:
            # A warm sandbox: chronus's modules now (shared with it by fork), chronus itself at
            # the claim, with the sandbox's environment.
            _load_engine()
        else:
            self._start_chronus()
        self._update_interest()  # the loop below selects on what is registered
        log.info(
            "aether %d ready (chronus %d, %s mode)",
            os.getpid(),
            self.chronus_pid,
            self.config.chronus_mode,
        )
        turn = time.monotonic()
        while self._shutdown_grace is None:
            timeout = self._timeout()
            ready = self.sel.select(timeout)
            now = time.monotonic()
            self._credit_stall(now - turn - timeout)
            turn = now
            for key, events in ready:
                tag = key.data
                if tag == "listen":
                    self._accept()
                elif tag == "signal":
                    self._on_signal()
                elif isinstance(tag, Conn):
                    if events & poller.EVENT_WRITE:
                        tag.flush()
                    if events & poller.EVENT_READ:
                        self._on_readable(tag)
            # A freeze can land anywhere in a turn, not only in the wait: time lost between
            # the wait's end and the keepalive's judgement in `_tick` counts as a stall too.
            now = time.monotonic()
            self._credit_stall(now - turn)
            turn = now
            self._tick()
            self._update_interest()
        self._shutdown(self._shutdown_grace)
        return 0

    def _credit_stall(self, late_s: float) -> None:
        """aether only judges the edge's silence over time it was running to hear it: a
        paused sandbox is frozen (cgroup freezer) for minutes to hours, and CLOCK_MONOTONIC
        runs on meanwhile. Time a loop turn lost beyond its wait is added to the edge's last
        frame time, so a thawed aether does not drop the edge (which suspends its own
        keepalive while the sandbox is paused) for a silence that was its own."""
        edge = self.edge
        if late_s < STALL_S or edge is None:
            return
        edge.last_rx = min(time.monotonic(), edge.last_rx + late_s)
        self._ping_sent = False  # a ping sent before the stall is answered or asked again
        log.info("did not run for %.1fs (paused or starved); the edge's silence restarts", late_s)

    def _timeout(self) -> float:
        """Until the next thing `_tick` has to do: an idle sandbox's aether wakes once per
        ping (every ping_idle_s) instead of every second (1,000 idle sandboxes spent ~5% of
        a core on those wakeups, and the edge's watchdog skips a sandbox whose CPU time has
        not moved: bench/bench_density.py)."""
        due = [t for t in (self._restart_at, self._reopen_at) if t]
        if self.guest:
            due.append(self._counters_at)
        edge = self.edge
        if edge is not None:
            after = self.config.peer_dead_s if self._ping_sent else self.config.ping_idle_s
            due.append(edge.last_rx + after)
        if not due:
            return MAX_IDLE_WAIT_S
        return min(MAX_IDLE_WAIT_S, max(0.0, min(due) - time.monotonic()))

    def _update_interest(self) -> None:
        edge, ch = self.edge, self.chronus
        for conn, peer in ((edge, ch), (ch, edge)):
            if conn is None:
                continue
            if conn.closed:
                self._lost(conn)
                continue
            # Backpressure: stop reading a side while its peer's buffer is full.
            behind = peer is not None and len(peer.out) > HIGH_WATER
            events = 0 if behind else poller.EVENT_READ
            if conn.out:
                events |= poller.EVENT_WRITE
            key = self.sel.get_map().get(conn.sock.fileno())
            if key is None:
                if events:
                    self.sel.register(conn.sock, events, conn)
            elif not events:
                self.sel.unregister(conn.sock)
            elif key.events != events:
                self.sel.modify(conn.sock, events, conn)

    def _tick(self) -> None:
        now = time.monotonic()
        if self._restart_at and now >= self._restart_at:
            self._restart_at = 0.0
            self._start_chronus()
        if self._reopen_at and now >= self._reopen_at:
            self._reopen_at = 0.0
            self._open_device()
        if self.guest and now >= self._counters_at:
            self._counters_at = now + 1.0
            self._report_counters()
        edge = self.edge
        if edge is None:
            return
        if edge.out:
            # Frames wait for the edge to read them: it is reading slowly (a slow consumer of
            # one stream holds its channel), not silent. A dead edge closes the socket.
            edge.last_rx = max(edge.last_rx, now - self.config.ping_idle_s)
        idle = now - edge.last_rx
        if idle >= self.config.peer_dead_s:
            log.warning("edge silent for %.0fs; dropping the connection", idle)
            self._drop_edge()
        elif idle >= self.config.ping_idle_s and not self._ping_sent:
            self._nonce += 1
            edge.queue(wire.encode(wire.FRAME, {"ping": {"nonce": self._nonce}}))
            edge.flush()
            self._ping_sent = True

    # ----------------------------------------------------------------- edge
    def _accept(self) -> None:
        assert self.listener is not None
        try:
            fd, _ = self.listener._accept()  # type: ignore[attr-defined]  # accept4(CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        sock = _socket.socket(fileno=fd)
        if self.edge is not None:
            log.info("a new edge connection replaces the current one")
            self._drop_edge()
        self._greet(Conn(sock, "edge"))
        log.info("edge connected")

    def _open_device(self) -> None:
        """Device channel: (re)open the port and greet whoever is at the other end. A host
        that connects later asks for the Hello with a Ping of nonce 0 (see _on_edge_frame)."""
        path = self.config.channel_device
        try:
            stream = DeviceStream(path)
        except OSError as exc:
            log.warning("cannot open the channel device %s: %s; retrying", path, exc.strerror)
            self._reopen_at = time.monotonic() + 0.5
            return
        self._greet(Conn(stream, "edge"))
        log.info("channel device %s open", path)

    def _greet(self, conn: Conn) -> None:
        self.edge = conn
        self._ping_sent = False
        self._send_hello()

    def _send_hello(self) -> None:
        assert self.edge is not None
        hello = {
            "protocol_version": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "chronus_version": insandbox.__version__,
        }
        self.edge.queue(wire.encode(wire.FRAME, {"hello": hello}))
        self.edge.flush()

    def _drop_edge(self) -> None:
        edge = self.edge
        if edge is None:
            return
        self.edge = None
        self._unregister(edge)
        edge.sock.close()
        self._abandon_streams()
        log.info("edge disconnected")
        if self.listener is None and self._shutdown_grace is None:
            # The device: wait for the host again. Soon: after a VM's restore this is the
            # create's critical path; while no host is there each retry costs a read() only.
            self._reopen_at = time.monotonic() + DEVICE_RETRY_S

    def _abandon_streams(self) -> None:
        """Streams of a vanished caller are abandoned; background commands and sessions are
        not streams and live on. A foreground command's stream is cancelled as abandoned:
        chronus keeps the command for a grace, for the edge to attach to it again (after a
        microVM's restore, the edge continues the caller's stream that way)."""
        abandoned = wire.encode("dsec.aether.v1.Cancel", {"abandoned": True})
        for cid in list(self._to_edge):
            self._to_chronus_frame(cid, F_CANCEL, abandoned)
        self._to_chronus.clear()
        self._to_edge.clear()

    def _on_edge_frame(self, payload: bytes) -> None:
        self._ping_sent = False
        sid, kind, body = wire.split_frame(payload)
        if kind == F_REQUEST:
            cid = self._to_chronus.get(sid)
            if cid is None:
                cid = self._next_id
                self._next_id = self._next_id % 0xFFFFFFFF + 1
                self._to_chronus[sid] = cid
                self._to_edge[cid] = sid
            self._to_chronus_frame(cid, F_REQUEST, body)
        elif kind in (F_CANCEL, F_HALF_CLOSE):
            cid = self._to_chronus.get(sid)
            if cid is not None:
                self._to_chronus_frame(cid, kind, body)
                if kind == F_CANCEL:  # the edge wants nothing more on it
                    del self._to_chronus[sid]
                    del self._to_edge[cid]
        elif kind == F_PING:
            assert self.edge is not None
            if not body and self.listener is None:
                # Device channel: a Ping of nonce 0 is a host that just connected to the
                # port asking for the Hello (a socket's accept tells aether that instead).
                # The previous host may have left unseen (a guest saved by a pause before
                # aether read the port's hangup): its streams end here, or the new host's
                # stream ids (from 1 again) would reach them. The new host sends nothing
                # but these Pings before the Hello, so no stream of its own is lost; what
                # was already queued for the previous one it skips (it precedes the Hello).
                self._abandon_streams()
                self._send_hello()
            self.edge.queue(wire.join_frame(0, F_PONG, body))  # Pong mirrors Ping's nonce
        elif kind == F_CLAIM:
            self._claim(wire.decode("dsec.aether.v1.Claim", body))
        elif kind == F_SYNC and self.guest:
            from aether import guest

            try:
                guest.sync(wire.decode("dsec.aether.v1.GuestSync", body))
            except (OSError, ValueError, KeyError) as exc:
                log.error("guest sync failed: %s", exc)
        elif kind == F_SHUTDOWN:
            grace = wire.decode("dsec.aether.v1.Shutdown", body).get("grace_s", 0.0)
            log.info("shutdown requested (grace %.1fs)", grace)
            self._shutdown_grace = max(0.0, grace)

    def _claim(self, claim: dict[str, Any]) -> None:
        """A warm sandbox is handed to its owner: its environment replaces ours (chronus and
        every command inherit it from here), then chronus starts. A second claim is refused.
        In a VM guest the claim also carries the guest's identity (aether/guest.py), applied
        first and answered with `Claimed`."""
        if not self.warm:
            log.warning("claim of a sandbox that is not warm: ignored")
            return
        self.warm = False
        if self.guest and self.edge is not None:
            from aether import guest

            t0 = time.monotonic()
            error = guest.apply_identity(claim.get("guest") or {})
            log.info("guest identity applied in %.1f ms", (time.monotonic() - t0) * 1000)
            self.edge.queue(wire.encode(wire.FRAME, {"claimed": {"error": error}}))
        os.environ.clear()
        os.environ.update(claim.get("env") or {})
        log.info("claimed: chronus starts with the sandbox's environment")
        self._start_chronus()

    def _report_counters(self) -> None:
        """A guest's pids-limit hits, on the console the edge reads (edge/backends/microvm/
        console.py): the host cannot read the guest's cgroup."""
        from aether import guest

        hits = guest.pids_limit_hits()
        if hits != self._pids_hits:
            self._pids_hits = hits
            log.warning("DSEC-COUNTER pids_limit_hits=%d", hits)
        full = guest.disk_full()
        if full and not self._disk_full:
            log.warning("DSEC-DISK-FULL %s", full)
        self._disk_full = full

    def _to_chronus_frame(self, cid: int, kind: int, body: Any) -> None:
        payload = wire.join_frame(cid, kind, body)
        if self.chronus is not None:
            self.chronus.queue(payload)
        elif len(self._chronus_backlog) < HIGH_WATER:
            self._chronus_backlog += wire.pack_frame(payload)
        elif kind == F_REQUEST and self.edge is not None:
            sid = self._to_edge.pop(cid, None)
            if sid is not None:
                del self._to_chronus[sid]
                end = {"code": UNAVAILABLE, "reason": "CHRONUS_RESTARTING", "message": "retry"}
                self.edge.queue(wire.encode(wire.FRAME, {"stream_id": sid, "end": end}))

    def _end_all_streams(self, reason: str, message: str) -> None:
        if self.edge is not None:
            end = {"code": UNAVAILABLE, "reason": reason, "message": message}
            for sid in self._to_chronus:
                self.edge.queue(wire.encode(wire.FRAME, {"stream_id": sid, "end": end}))
        self._to_chronus.clear()
        self._to_edge.clear()

    # -------------------------------------------------------------- chronus
    def _on_chronus_frame(self, payload: bytes) -> None:
        cid, kind, body = wire.split_frame(payload)
        if kind not in (F_RESPONSE, F_END):
            return
        sid = self._to_edge.get(cid)
        if sid is None or self.edge is None:
            return  # a stream the edge abandoned
        self.edge.queue(wire.join_frame(sid, kind, body))
        if kind == F_END:
            del self._to_edge[cid]
            del self._to_chronus[sid]

    def _start_chronus(self) -> None:
        ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
        self._chronus_started = time.monotonic()
        if self.config.chronus_mode == "exec":
            self.chronus_pid = self._exec_chronus(theirs)
        else:
            # Loaded before the fork, so chronus shares these pages copy-on-write.
            serve_socket = _load_engine()
            gc.collect()
            gc.freeze()  # the collector must not dirty the shared pages in chronus
            pid = os.fork()
            if pid == 0:
                self._become_chronus(ours, theirs, serve_socket)
            self.chronus_pid = pid
        theirs.close()
        self.chronus = Conn(ours, "chronus")
        self.chronus.out, self._chronus_backlog = self._chronus_backlog, bytearray()
        self.sel.register(ours, poller.EVENT_READ, self.chronus)
        self.chronus.flush()

    def _exec_chronus(self, theirs: _socket.socket) -> int:
        """Exec mode: `python -m chronus --fd 3` in a session of its own, with aether's stdio,
        the channel as fd 3 and chronus's runtime directory (if any) as fd 4; its pid."""
        argv = [sys.executable, *_interpreter_flags(), "-m", ENGINE, "--fd", "3"]
        env = dict(os.environ)
        # Copies numbered above 4: a dup2 onto the same number would keep close-on-exec.
        copies = [fcntl.fcntl(theirs.fileno(), fcntl.F_DUPFD_CLOEXEC, 10)]
        actions = [(os.POSIX_SPAWN_DUP2, copies[0], 3)]
        try:
            if self.runtime_fd >= 0:
                copies.append(fcntl.fcntl(self.runtime_fd, fcntl.F_DUPFD_CLOEXEC, 10))
                actions.append((os.POSIX_SPAWN_DUP2, copies[1], 4))
                env["DSEC_CHRONUS_RUNTIME_FD"] = "4"
            return os.posix_spawn(
                sys.executable,
                argv,
                env,
                file_actions=actions,
                setsid=True,
                setsigmask=(),
                # Python ignores these; an ignored disposition survives exec.
                setsigdef=(_signal.SIGPIPE, _signal.SIGXFSZ),
            )
        finally:
            for fd in copies:
                os.close(fd)

    def _become_chronus(
        self,
        ours: _socket.socket,
        theirs: _socket.socket,
        serve_socket: Callable[[_socket.socket], None],
    ) -> None:
        """In the forked child: drop everything of aether's, serve the channel."""
        code = 0
        try:
            _signal.set_wakeup_fd(-1)
            for sig in (_signal.SIGCHLD, _signal.SIGTERM, _signal.SIGINT):
                _signal.signal(sig, _signal.SIG_DFL)
            keep = {0, 1, 2, theirs.fileno(), self.runtime_fd}
            for name in os.listdir("/proc/self/fd"):
                fd = int(name)
                if fd not in keep:
                    try:
                        os.close(fd)  # the listener, the edge connection, epoll...
                    except OSError:
                        pass
            serve_socket(theirs)
        except BaseException:
            log.exception("chronus failed")
            code = 1
        os._exit(code)  # never return into aether's loop

    def _lost(self, conn: Conn) -> None:
        if conn is self.edge:
            self._drop_edge()
        elif conn is self.chronus:
            self._chronus_lost("channel closed")

    def _chronus_lost(self, why: str, reaped: bool = False) -> None:
        conn = self.chronus
        if conn is None:
            return
        self.chronus = None
        self._unregister(conn)
        conn.sock.close()
        if not reaped:
            kill_quietly(self.chronus_pid, _signal.SIGKILL)  # it only closed the channel
        log.error("chronus %d lost (%s); restarting it", self.chronus_pid, why)
        self._end_all_streams("CHRONUS_RESTARTED", f"chronus stopped ({why}) and was restarted")
        if self._shutdown_grace is None:
            wait = self._chronus_started + self.config.restart_backoff_s - time.monotonic()
            if wait > 0:
                self._restart_at = time.monotonic() + wait
            else:
                self._start_chronus()

    # ----------------------------------------------------------- shared I/O
    def _on_readable(self, conn: Conn) -> None:
        frames = conn.receive()
        if frames is None:
            self._lost(conn)
            return
        for payload in frames:
            try:
                if conn is self.edge:
                    self._on_edge_frame(payload)
                elif conn is self.chronus:
                    self._on_chronus_frame(payload)
            except wire.WireError as exc:
                log.warning("malformed frame from %s: %s", conn.name, exc)
        for c in (self.edge, self.chronus):
            if c is not None:
                c.flush()

    def _unregister(self, conn: Conn) -> None:
        if conn.sock.fileno() >= 0 and conn.sock.fileno() in self.sel.get_map():
            self.sel.unregister(conn.sock)

    # ------------------------------------------------------------- signals
    def _on_signal(self) -> None:
        try:
            signums = self._sig_r.recv(4096)
        except BlockingIOError:
            signums = b""
        self._reap()
        if _signal.SIGTERM in signums or _signal.SIGINT in signums:
            log.info("SIGTERM: shutting down")
            self._shutdown_grace = self.config.sigterm_grace_s

    def _reap(self) -> None:
        """Reap every exited child: chronus, and orphans re-parented to us.

        Commands are children of chronus, which waits for them itself, so
        waiting for any child here never steals a status chronus needs."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.chronus_pid and self.chronus is not None:
                self._chronus_lost(f"exit status {status}", reaped=True)

    # ------------------------------------------------------------ shutdown
    def _shutdown(self, grace: float) -> None:
        """SIGTERM every process group, wait `grace`, SIGKILL what is left."""
        self._end_all_streams("SHUTDOWN", "the sandbox is shutting down")
        if self.edge is not None:
            self.edge.sock.setblocking(True)
            self.edge.sock.settimeout(1.0)
            try:
                self.edge.sock.sendall(self.edge.out)
            except OSError:
                pass
        me = os.getpid()
        self._signal_all(_signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and descendants({me}, proc_table()):
            self._reap_quietly()
            time.sleep(0.02)
        for _ in range(100):
            if not self._signal_all(_signal.SIGKILL):
                break
            time.sleep(0.02)
            self._reap_quietly()
        log.info("shutdown complete")
        if self.guest:
            from aether import guest

            guest.power_off()  # pid 1 of a VM must not just exit (the kernel would panic)

    @staticmethod
    def _signal_all(sig: int) -> int:
        table = proc_table()
        targets = descendants({os.getpid()}, table)
        groups = {p.pgid for p in table if p.pid in targets}
        for pgid in groups:
            if pgid != os.getpgid(0):
                killpg_quietly(pgid, sig)
        for pid in targets:
            kill_quietly(pid, sig)
        return len(targets)

    @staticmethod
    def _reap_quietly() -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return


def _load_engine() -> Callable[[_socket.socket], None]:
    """The engine's entry point `serve_socket`, its module imported by name (see ENGINE)."""
    __import__(ENGINE_MODULE)  # the builtin: `importlib` is not loaded in the sandbox
    entry: Callable[[_socket.socket], None] = sys.modules[ENGINE_MODULE].serve_socket
    return entry


def _runtime_fd() -> int:
    """DSEC_CHRONUS_RUNTIME_FD, made close-on-exec: chronus keeps it, commands never see it."""
    try:
        fd = int(os.environ.get("DSEC_CHRONUS_RUNTIME_FD") or "-1")
    except ValueError:
        return -1
    if fd >= 0:
        try:
            os.set_inheritable(fd, False)
        except OSError:
            log.warning("DSEC_CHRONUS_RUNTIME_FD=%d is not open", fd)
            return -1
    return fd


def _interpreter_flags() -> list[str]:
    flags = []
    if sys.flags.no_site:
        flags.append("-S")
    if sys.flags.isolated:
        flags.append("-I")
    return flags
