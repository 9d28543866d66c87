"""Small helpers shared by tests."""

from __future__ import annotations

import hashlib
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from libdsec import Client, Sandbox
from libdsec.errors import DSecError


def dsec_status(home: Any) -> str:
    """`dsec status` of the local cluster at `home` (it must succeed): its output."""
    out = subprocess.run(
        [sys.executable, "-m", "dsecctl", "status"],
        env={**os.environ, "DSEC_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def wait_for(predicate: Callable[[], Any], timeout_s: float = 15.0, interval_s: float = 0.1) -> Any:
    """Polls until ``predicate()`` is truthy and returns that value (not a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)


@contextmanager
def sandbox_factory(
    client: Client, test_id: str, *, memory_mb: int = 256, grace_s: float = 0.5
) -> Iterator[Callable[..., Sandbox]]:
    """A factory of sandboxes labelled with the test's id (``labels["test"]``), all stopped on
    exit, also when the test failed. Defaults: busybox, half a core, ``memory_mb``."""
    made: list[Sandbox] = []
    label = hashlib.sha256(test_id.encode()).hexdigest()[:16]

    def make(**kw: Any) -> Sandbox:
        kw.setdefault("image", "busybox")
        kw.setdefault("cpu", 0.5)
        kw.setdefault("memory_mb", memory_mb)
        kw["labels"] = {**kw.get("labels", {}), "test": label}
        sb = client.create(**kw)
        made.append(sb)
        return sb

    try:
        yield make
    finally:
        for sb in made:
            try:
                sb.stop(grace_s=grace_s)
            except DSecError:
                pass  # already gone


def client_hello(server_name: str | None) -> bytes:
    """The bytes a real TLS client sends first, asking for ``server_name`` (None: no SNI):
    Python's own TLS client through memory BIOs, so nothing is sent anywhere."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:  # the hello is out; it waits for the server's answer
        return outgoing.read()
    raise AssertionError("a TLS handshake completed with no server")
