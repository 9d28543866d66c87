"""HTTP/1.1 requests to services listening inside the sandbox."""

from __future__ import annotations

from chronus.errors import DEADLINE_EXCEEDED, UNAVAILABLE, ChronusError, invalid

TYPE_CHECKING = False  # typing costs ~2 MB at run time: annotations are strings
if TYPE_CHECKING:
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
