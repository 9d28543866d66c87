"""HTTP/1.1 requests to services listening inside the sandbox."""

from __future__ import annotations

from chronus.errors import DEADLINE_EXCEEDED, UNAVAILABLE, ChronusError, invalid

TYPE_CHECKING = False  # typing costs ~2 MB at run time: annotations are strings
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

MIB = 1024 * 1024
MAX_BODY_BYTES = 4 * MIB
DEFAULT_TIMEOUT_S = 30.0


def http_request(req: dict[str, Any]) -> dict[str, Any]:
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


#: How often a wait for a port tries to connect.
PORT_POLL_S = 0.02
MAX_PORT_WAIT_S = 3600.0


def wait_for_port(
    req: dict[str, Any], cancelled: Callable[[], bool] = lambda: False
) -> dict[str, Any]:
    """Connects to 127.0.0.1:port every PORT_POLL_S until one is accepted (and closes it at
    once: nothing is sent), for up to ``timeout_s``; stops early when ``cancelled()``."""
    import _socket
    import time

    port = int(req.get("port", 0))
    if not 1 <= port <= 65535:
        raise invalid(f"port must be 1..65535, got {port}")
    timeout = float(req.get("timeout_s", 0)) or DEFAULT_TIMEOUT_S
    if not 0 < timeout <= MAX_PORT_WAIT_S:
        raise invalid(f"timeout_s must be in (0, {MAX_PORT_WAIT_S:g}], got {timeout:g}")
    start = time.monotonic()
    deadline = start + timeout
    while not cancelled():
        s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        try:
            s.settimeout(max(0.05, min(1.0, deadline - time.monotonic())))
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return {"waited_s": time.monotonic() - start}
        except OSError:
            pass  # a connect that timed out: the listener's backlog is full, try again
        finally:
            s.close()
        if time.monotonic() + PORT_POLL_S >= deadline:
            break
        time.sleep(PORT_POLL_S)
    raise ChronusError(
        DEADLINE_EXCEEDED,
        "PORT_NOT_LISTENING",
        f"nothing listened on 127.0.0.1:{port} within {timeout:g} s",
    )
