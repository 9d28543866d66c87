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

Each side's end is passed on (a half-close stays a half-close); either side's reset or error
closes both. Sockets are driven directly on the event loop (no stream transports), so the relay
owns their file descriptors. The gate holds no per-sandbox state: the caller's ``decide`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

from edge.network.peek import MAX_PEEK_BYTES, NEED_MORE, Peeked, peek

log = logging.getLogger(__name__)

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
PIPE_BYTES = 1 << 20
SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK


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
            if upstream is not None:
                await _relay(conn, upstream)
        except OSError as exc:
            log.debug("name gate: connection ended: %s", exc)
        except Exception:  # one connection's failure is that connection's
            log.exception("name gate: a connection failed")
        finally:
            conn.close()
            if upstream is not None:
                upstream.close()

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


async def _relay(a: socket.socket, b: socket.socket) -> None:
    """Both directions, in the kernel, until both ended; an error on either ends both."""
    up = asyncio.ensure_future(_pump(a, b))
    down = asyncio.ensure_future(_pump(b, a))
    try:
        done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_EXCEPTION)
        if any(t.exception() is not None for t in done):
            return
        await asyncio.gather(up, down)
    finally:
        up.cancel()
        down.cancel()
        await asyncio.wait({up, down})


async def _pump(src: socket.socket, dst: socket.socket) -> None:
    """src -> dst through a pipe, in the kernel, until src's end; then half-close dst."""
    loop = asyncio.get_running_loop()
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):
            import fcntl

            fcntl.fcntl(w, 1031, PIPE_BYTES)  # F_SETPIPE_SZ
        in_pipe = 0
        src_fd, dst_fd = src.fileno(), dst.fileno()
        eof = False
        while not eof or in_pipe:
            if not eof:
                try:
                    n = os.splice(src_fd, w, PIPE_BYTES, flags=SPLICE_FLAGS)
                except BlockingIOError:
                    n = -1
                if n == 0:
                    eof = True
                elif n > 0:
                    in_pipe += n
            if in_pipe:
                try:
                    in_pipe -= os.splice(r, dst_fd, in_pipe, flags=SPLICE_FLAGS)
                    continue
                except BlockingIOError:
                    await _wait(loop, dst_fd, writable=True)
                    continue
            if not eof:
                await _wait(loop, src_fd, writable=False)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
    finally:
        os.close(r)
        os.close(w)


async def _wait(loop: asyncio.AbstractEventLoop, fd: int, *, writable: bool) -> None:
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    (loop.add_writer if writable else loop.add_reader)(fd, ready)
    try:
        await fut
    finally:
        (loop.remove_writer if writable else loop.remove_reader)(fd)


def _reset(sock: socket.socket) -> None:
    """Closes with a RST (SO_LINGER 0): the client sees the connection refused, not ended."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
