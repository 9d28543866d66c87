"""HTTP/1.1 requests to services listening inside the sandbox.

Their timeouts count running time (`chronus.clock`): a pause of the sandbox in the middle of a
request or of a wait for a port does not use them up. The calling thread waits in turns of at
most MAX_WAIT_S and gives up only once a reactor `Deadline` has passed.
"""

from __future__ import annotations

from chronus.clock import MAX_WAIT_S
from chronus.errors import DEADLINE_EXCEEDED, UNAVAILABLE, ChronusError, invalid

TYPE_CHECKING = False  # typing costs ~2 MB at run time: annotations are strings
if TYPE_CHECKING:
    import socket
    from collections.abc import Callable
    from typing import Any

    from chronus.reactor import Reactor

MIB = 1024 * 1024
MAX_BODY_BYTES = 4 * MIB
DEFAULT_TIMEOUT_S = 30.0


def http_request(req: dict[str, Any], reactor: Reactor) -> dict[str, Any]:
    """One request; ``timeout_s`` bounds each step (connect, each send and each read), as a
    socket timeout does, in running time."""
    # http.client costs ~3.5 MB (it pulls in email parsing): imported on first
    # use so that idle sandboxes do not pay for it.
    import http.client

    port = int(req.get("port", 0))
    if not 1 <= port <= 65535:
        raise invalid(f"port must be 1..65535, got {port}")
    body: bytes = req.get("body", b"")
    if len(body) > MAX_BODY_BYTES:
        raise invalid(f"body is at most {MAX_BODY_BYTES} bytes")
    path = req.get("path") or "/"
    if not path.startswith("/"):
        raise invalid("path must start with /")
    method = (req.get("method") or "GET").upper()
    timeout = float(req.get("timeout_s", 0)) or DEFAULT_TIMEOUT_S
    limit = int(req.get("max_body_bytes", 0)) or MAX_BODY_BYTES
    limit = min(limit, MAX_BODY_BYTES)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    def connect(address: tuple[str, int], *_: Any) -> socket.socket:
        return _connect(address, timeout, reactor)

    conn._create_connection = connect  # type: ignore[attr-defined]  # http.client's own hook
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for header in req.get("headers", []):
            conn.putheader(header.get("name", ""), header.get("value", ""))
        if body or method in ("POST", "PUT", "PATCH"):
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body or None)
        resp = conn.getresponse()
        data = resp.read(limit + 1)
        truncated = len(data) > limit
        return {
            "status": resp.status,
            "headers": [{"name": k, "value": v} for k, v in resp.getheaders()],
            "body": data[:limit],
            "truncated": truncated,
        }
    except TimeoutError:
        raise ChronusError(
            DEADLINE_EXCEEDED, "HTTP_TIMEOUT", f"127.0.0.1:{port} did not answer in {timeout}s"
        ) from None
    except ConnectionRefusedError:
        raise ChronusError(
            UNAVAILABLE, "CONNECTION_REFUSED", f"nothing listens on 127.0.0.1:{port}"
        ) from None
    except (OSError, http.client.HTTPException) as exc:
        raise ChronusError(UNAVAILABLE, "HTTP_ERROR", f"127.0.0.1:{port}: {exc}") from None
    finally:
        conn.close()


def _connect(address: tuple[str, int], limit: float, reactor: Reactor) -> socket.socket:
    """http.client's connection, on a `_RunningSocket`; a connect that times out (the
    listener's backlog is full) is tried again on a new socket until the deadline passes."""
    import _socket

    cls = _running_socket()
    start = reactor.clock.now()
    deadline = reactor.deadline(limit)
    try:
        while True:
            sock = cls(_socket.AF_INET, _socket.SOCK_STREAM)
            sock.reactor, sock.limit = reactor, limit
            sock.settimeout(_turn(reactor, start, limit))
            try:
                sock.connect(address)
                return sock
            except TimeoutError:
                sock.close()
                if deadline.passed:
                    raise
            except BaseException:
                sock.close()
                raise
    finally:
        deadline.cancel()


_socket_class: Any = None


def _running_socket() -> Any:
    """The class of `_connect`'s sockets, made at the first request (`socket` is only
    imported by then, with http.client)."""
    global _socket_class
    if _socket_class is not None:
        return _socket_class
    import socket

    class _RunningSocket(socket.socket):
        """A socket whose timeout (`limit`, per step like a socket timeout) counts running
        time: a step that would block waits in turns of at most MAX_WAIT_S until it is done
        or a reactor Deadline of `limit` has passed."""

        reactor: Reactor
        limit: float

        def _step(self, fn: Callable[..., Any], *args: Any) -> Any:
            self.settimeout(0.0)
            try:
                return fn(*args)
            except BlockingIOError:
                pass
            reactor, limit = self.reactor, self.limit
            start = reactor.clock.now()
            deadline = reactor.deadline(limit)
            try:
                while True:
                    self.settimeout(_turn(reactor, start, limit))
                    try:
                        return fn(*args)
                    except TimeoutError:
                        if deadline.passed:
                            raise
            finally:
                deadline.cancel()

        def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
            n: int = self._step(super().recv_into, buffer, nbytes, flags)
            return n

        def sendall(self, data: Any, flags: int = 0) -> None:
            view = memoryview(data).cast("B")
            while view:
                view = view[self._step(super().send, view, flags) :]

    _socket_class = _RunningSocket
    return _socket_class


def _turn(reactor: Reactor, start: float, limit: float) -> float:
    """How long one wait of a step begun at `start` (running time) may be: what is left of
    `limit` by the clock, at most MAX_WAIT_S. Only a size: the step's Deadline judges."""
    return max(0.01, min(MAX_WAIT_S, limit - (reactor.clock.now() - start)))


#: How often a wait for a port tries to connect.
PORT_POLL_S = 0.02
MAX_PORT_WAIT_S = 3600.0


def wait_for_port(
    req: dict[str, Any], reactor: Reactor, cancelled: Callable[[], bool] = lambda: False
) -> dict[str, Any]:
    """Connects to 127.0.0.1:port every PORT_POLL_S until one is accepted (and closes it at
    once: nothing is sent), for up to ``timeout_s`` of running time; stops early when
    ``cancelled()``."""
    import _socket
    import time

    port = int(req.get("port", 0))
    if not 1 <= port <= 65535:
        raise invalid(f"port must be 1..65535, got {port}")
    timeout = float(req.get("timeout_s", 0)) or DEFAULT_TIMEOUT_S
    if not 0 < timeout <= MAX_PORT_WAIT_S:
        raise invalid(f"timeout_s must be in (0, {MAX_PORT_WAIT_S:g}], got {timeout:g}")
    clock = reactor.clock
    start = clock.now()
    deadline = reactor.deadline(timeout)
    try:
        while not cancelled():
            s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
            try:
                s.settimeout(max(0.05, _turn(reactor, start, timeout)))
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    # At least 0: a start read at a thaw, before the stall was taken off.
                    return {"waited_s": max(0.0, clock.now() - start)}
            except OSError:
                pass  # a connect that timed out: the listener's backlog is full, try again
            finally:
                s.close()
            if deadline.passed:
                break
            time.sleep(PORT_POLL_S)
    finally:
        deadline.cancel()
    raise ChronusError(
        DEADLINE_EXCEEDED,
        "PORT_NOT_LISTENING",
        f"nothing listened on 127.0.0.1:{port} within {timeout:g} s",
    )
