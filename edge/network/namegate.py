"""The name gate: a transparent TCP relay that admits a connection on the name it asks for.

Where a sandbox's connection is allowed only because of a domain rule (or a domain deny might
concern it), the edge redirects it here instead of letting it through by address (nftables
`redirect` on the node bridge, so the sandbox needs no proxy settings and cannot bypass it).
For each connection:

1. the original destination comes from conntrack (``SO_ORIGINAL_DST``);
2. the first bytes are read, at most :data:`peek.MAX_PEEK_BYTES`, for at most
   ``peek_timeout_s``: a TLS ClientHello's server name or an HTTP/1.x Host (edge.network.peek);
3. ``decide(client, destination, peeked)`` says whether it may go on: None, or why not (no
   name, a name the policy does not allow, an address the edge never resolved for that name);
   a refused connection is reset and reported through ``refused(client, reason, name)``;
4. an admitted one is connected to its destination, the peeked bytes are sent on, and from
   then on bytes are relayed untouched in the kernel (``splice`` through a pipe each way): no
   TLS termination, no certificates.

Steps 1-3 and the upstream connect run on the event loop (sockets driven directly, no stream
transports); the relay then runs off it, in a thread per direction blocked in ``splice``: the
bytes never enter Python, and a bulk transfer neither waits for the loop nor holds it up (the
edge's gRPC services share that loop). Each side's end is passed on (a half-close stays a
half-close); either side's reset or error resets both. The gate holds no per-sandbox state: the
caller's ``decide`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from edge.network.peek import MAX_PEEK_BYTES, NEED_MORE, Peeked, peek

log = logging.getLogger(__name__)

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
PIPE_BYTES = 1 << 20
F_SETPIPE_SZ = 1031  # linux/fcntl.h


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where the client meant to connect before nftables redirected it here."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


@dataclass(frozen=True)
class Attempt:
    """A connection the gate is deciding on."""

    client: tuple[str, int]
    destination: tuple[str, int]
    peeked: Peeked | None  # None: the client said too little in time


Decide = Callable[[Attempt], str | None]
Refused = Callable[[Attempt, str], None]


class NameGate:
    def __init__(
        self,
        decide: Decide,
        refused: Refused,
        *,
        destination: Callable[[socket.socket], tuple[str, int]] = original_destination,
        peek_timeout_s: float = 5.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.decide = decide
        self.refused = refused
        self.destination = destination
        self.peek_timeout_s = peek_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._relays: set[_Relay] = set()

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0: any free port); returns the port."""
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((host, port))
        lsock.listen(1024)
        lsock.setblocking(False)
        self._listener = lsock
        self._acceptor = asyncio.get_running_loop().create_task(self._accept_loop(lsock))
        return int(lsock.getsockname()[1])

    async def close(self) -> None:
        if self._acceptor is not None:
            self._acceptor.cancel()
            with contextlib.suppress(BaseException):
                await self._acceptor
        if self._listener is not None:
            self._listener.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        relays = list(self._relays)
        for relay in relays:
            relay.abort()

        def join_all() -> None:
            for relay in relays:
                relay.join(5)

        await asyncio.to_thread(join_all)

    @property
    def relaying(self) -> int:
        """Admitted connections still being relayed."""
        return len(self._relays)

    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(lsock)
            except OSError as exc:  # EMFILE and the like: the next accept may work
                log.warning("name gate: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            task = loop.create_task(self._connection(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _connection(self, conn: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            upstream = await self._admit(conn)
        except OSError as exc:
            log.debug("name gate: connection ended: %s", exc)
        except Exception:  # one connection's failure is that connection's
            log.exception("name gate: a connection failed")
        if upstream is None:
            conn.close()
            return
        relay = _Relay(conn, upstream, self._relays.discard)
        self._relays.add(relay)
        relay.start()

    async def _admit(self, conn: socket.socket) -> socket.socket | None:
        """The connected upstream socket, with the peeked bytes sent on; None if refused."""
        loop = asyncio.get_running_loop()
        attempt_head = await self._peek(conn)
        head, peeked = attempt_head
        attempt = Attempt(conn.getpeername()[:2], self.destination(conn), peeked)
        why = self.decide(attempt)
        if why is not None:
            self.refused(attempt, why)
            _reset(conn)
            return None
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        upstream.setblocking(False)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.sock_connect(upstream, attempt.destination)
            if head:
                await loop.sock_sendall(upstream, head)
        except (OSError, TimeoutError) as exc:
            log.info("name gate: %s -> %s:%d: %s", attempt.client, *attempt.destination, exc)
            upstream.close()
            _reset(conn)
            return None
        return upstream

    async def _peek(self, conn: socket.socket) -> tuple[bytes, Peeked | None]:
        loop = asyncio.get_running_loop()
        head = b""
        try:
            async with asyncio.timeout(self.peek_timeout_s):
                while len(head) < MAX_PEEK_BYTES:
                    got = peek(head)
                    if got is not NEED_MORE:
                        return head, got
                    chunk = await loop.sock_recv(conn, MAX_PEEK_BYTES - len(head))
                    if not chunk:
                        return head, None
                    head += chunk
        except TimeoutError:
            return head, None
        return head, peek(head)


class _Relay:
    """An admitted connection: a thread per direction, each blocked in ``splice`` (socket ->
    pipe -> socket), until both directions ended; then both sockets are closed."""

    def __init__(self, a: socket.socket, b: socket.socket, done: Callable[[_Relay], None]) -> None:
        a.setblocking(True)
        b.setblocking(True)
        self.a, self.b = a, b
        self._done = done
        self._failed = False
        self._back = threading.Thread(
            target=self._pump, args=(b, a), name="gate-relay", daemon=True
        )
        self._forth = threading.Thread(target=self._run, name="gate-relay", daemon=True)

    def start(self) -> None:
        self._back.start()
        self._forth.start()

    def join(self, timeout_s: float) -> None:
        self._forth.join(timeout_s)

    def abort(self) -> None:
        """Ends both directions now (the gate is closing)."""
        self._failed = True
        for sock in (self.a, self.b):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        try:
            self._pump(self.a, self.b)
            self._back.join()
            if self._failed:
                _reset(self.a)
                _reset(self.b)
        finally:
            self.a.close()
            self.b.close()
            self._done(self)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """src -> dst until src's end, then half-close dst; an error ends both directions."""
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            with contextlib.suppress(OSError):
                fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_BYTES)
            src_fd, dst_fd = src.fileno(), dst.fileno()
            while n := os.splice(src_fd, w, PIPE_BYTES, flags=os.SPLICE_F_MOVE):
                while n:
                    n -= os.splice(r, dst_fd, n, flags=os.SPLICE_F_MOVE)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            self.abort()
        finally:
            os.close(r)
            os.close(w)


def _reset(sock: socket.socket) -> None:
    """Closes with a RST (SO_LINGER 0): the client sees the connection refused, not ended."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
