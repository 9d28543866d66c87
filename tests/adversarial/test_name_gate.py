"""Name-aware egress: a connection allowed only by a domain rule is admitted on the name it asks
for (TLS server name, HTTP Host), not on the address it connects to (issue 20). Two names share
one address in the lab here, as sites behind one CDN address do."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from libdsec import NetworkPolicy, Sandbox
from tests.adversarial.conftest import NPM, SHARED
from tests.helpers import client_hello, wait_for

pytestmark = pytest.mark.usefixtures("contained")

# Connects to HOST:PORT and asks for NAME: a real ClientHello on 443 (Python's TLS client
# through a memory BIO), an HTTP/1.1 request with Host otherwise, raw bytes with "raw". A 4th
# argument "split" sends the hello in two segments 50 ms apart; "partial" sends its first
# 100 bytes only. Prints what came back ("REPLY <bytes>") or how it ended.
CLIENT = r"""
import socket, ssl, sys, time
host, port, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
how = sys.argv[4] if len(sys.argv) > 4 else ""
s = socket.create_connection((host, port), 5)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.settimeout(8)
if name == "raw":
    s.sendall(b"\x00raw bytes\r\n\r\n")
elif port == 443:
    ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
    i, o = ssl.MemoryBIO(), ssl.MemoryBIO()
    t = ctx.wrap_bio(i, o, server_hostname=None if name == "-" else name)
    try: t.do_handshake()
    except ssl.SSLWantReadError: pass
    hello = o.read()
    if how:
        s.sendall(hello[:100])
        time.sleep(0.05)
    if how == "partial":
        time.sleep(6)  # the connection stays open past the gate's peek timeout
    else:
        s.sendall(hello[100:] if how else hello)
else:
    s.sendall(b"GET / HTTP/1.1\r\nHost: " + name.encode() + b"\r\n\r\n")
try:
    data = s.recv(100)
    print("REPLY" if data else "CLOSED", data.decode(errors="replace").strip())
except ConnectionResetError:
    print("RESET")
"""


def ask(sb: Sandbox, host: str, port: int, name: str, how: str = "") -> str:
    sb.files.write("/work/client.py", CLIENT)
    r = sb.run(["python3", "/work/client.py", host, str(port), name, how], timeout_s=30)
    assert r.exit_code == 0, r
    return r.text.strip()


def test_two_names_on_one_address_one_allowed_one_denied(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox(
        image="bookworm",
        memory_mb=256,
        network=NetworkPolicy(
            allow=["cdn-allowed.test:443", "cdn-allowed.test:80"], deny=["cdn-denied.test"]
        ),
    )
    # TLS: the server name decides, not the (shared) address
    assert ask(sb, SHARED, 443, "cdn-allowed.test").startswith("REPLY")
    assert ask(sb, SHARED, 443, "cdn-denied.test") == "RESET"
    # plain HTTP: the Host header decides
    assert ask(sb, SHARED, 80, "cdn-allowed.test").startswith("REPLY")
    assert ask(sb, SHARED, 80, "cdn-denied.test") == "RESET"
    # bypasses: no name, raw TCP, a name the policy never mentions
    assert ask(sb, SHARED, 443, "-") == "RESET"
    assert ask(sb, SHARED, 443, "raw") == "RESET"
    assert ask(sb, SHARED, 443, "github.com") == "RESET"
    info = wait_for(lambda: (i := sb.refresh()).violations["blocked_connects"] >= 5 and i)
    assert info.state == "RUNNING"
    # ... each refusal counted by the name it asked for (sb.info.violations.blocked_names)
    want = {"cdn-denied.test": 2, "(no name)": 2, "github.com": 1}
    info = wait_for(lambda: (i := sb.refresh()).violations.blocked_names == want and i)
    assert info.violations["blocked_connects"] == 5


def test_an_allowed_names_address_with_another_name_is_refused(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    """SNI of an allowed name sent to an address the edge never resolved for it: refused."""
    sb = make_sandbox(
        image="bookworm",
        memory_mb=256,
        network=NetworkPolicy(allow=["cdn-allowed.test:443", "registry.npmjs.org:443"]),
    )
    assert ask(sb, NPM, 443, "registry.npmjs.org").startswith("REPLY")
    assert ask(sb, NPM, 443, "cdn-allowed.test") == "RESET"  # right name, wrong address


def test_an_ip_rule_keeps_its_fast_path_and_a_policy_update_flips_a_name_live(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox(
        image="bookworm",
        memory_mb=256,
        network=NetworkPolicy(allow=[f"{NPM}:443", "cdn-allowed.test:443"]),
    )
    assert ask(sb, NPM, 443, "raw").startswith("REPLY")  # by IP rule: no name needed
    assert ask(sb, SHARED, 443, "cdn-denied.test") == "RESET"
    sb.update_network_policy(NetworkPolicy(allow=["cdn-denied.test:443"]))
    assert ask(sb, SHARED, 443, "cdn-denied.test").startswith("REPLY")
    assert ask(sb, SHARED, 443, "cdn-allowed.test") == "RESET"


# Opens N connections at once to HOST:443, each sending the same ClientHello (read from a
# file), and prints how many got the server's reply and how many were reset or timed out.
BURST = r"""
import socket, sys, selectors
host, n, hello = sys.argv[1], int(sys.argv[2]), open(sys.argv[3], "rb").read()
sel = selectors.DefaultSelector()
for _ in range(n):
    s = socket.socket(); s.setblocking(False); s.connect_ex((host, 443))
    sel.register(s, selectors.EVENT_WRITE)
replied = failed = 0
import time
deadline = time.time() + 40
while replied + failed < n and time.time() < deadline:
    for key, ev in sel.select(1):
        s = key.fileobj
        try:
            if ev & selectors.EVENT_WRITE:
                s.sendall(hello); sel.modify(s, selectors.EVENT_READ); continue
            data = s.recv(100)
            replied += bool(data); failed += not data
        except OSError:
            failed += 1
        sel.unregister(s); s.close()
print(replied, failed, n - replied - failed)
"""


def test_a_burst_of_connections_is_decided_one_by_one(make_sandbox: Callable[..., Sandbox]) -> None:
    """300 connections at once, half asking for an allowed name and half for a denied one:
    each gets its own verdict, and the sandbox's refusals are counted exactly."""
    sb = make_sandbox(
        image="bookworm",
        memory_mb=256,
        network=NetworkPolicy(allow=["cdn-allowed.test:443"], deny=["cdn-denied.test"]),
    )
    sb.files.write("/work/burst.py", BURST)
    sb.files.write("/work/allowed.bin", client_hello("cdn-allowed.test"))
    sb.files.write("/work/denied.bin", client_hello("cdn-denied.test"))
    for name, want in (("allowed", "150 0 0"), ("denied", "0 150 0")):
        r = sb.run(["python3", "/work/burst.py", SHARED, "150", f"/work/{name}.bin"], timeout_s=60)
        assert r.exit_code == 0 and r.text.strip() == want, (name, r)
    wait_for(lambda: sb.refresh().violations.blocked_names == {"cdn-denied.test": 150})
    assert sb.run("true").ok  # the edge keeps serving


def test_a_hello_over_two_segments_is_read_whole_and_one_never_completed_is_refused(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    """The gate holds a hello's first segment in the kernel's queue until the rest arrives,
    then lets both through (or resets); a hello never completed is reset after 5 s."""
    sb = make_sandbox(
        image="bookworm",
        memory_mb=256,
        network=NetworkPolicy(allow=["cdn-allowed.test:443"], deny=["cdn-denied.test"]),
    )
    assert ask(sb, SHARED, 443, "cdn-allowed.test", "split").startswith("REPLY")
    assert ask(sb, SHARED, 443, "cdn-denied.test", "split") == "RESET"
    # (the lab's server answers a silent client after 0.5 s: what the client sent never
    # reached it, and the half hello is refused when the peek time is up)
    proc = sb.start(["python3", "/work/client.py", SHARED, "443", "cdn-allowed.test", "partial"])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3.5:  # held, not refused, while the peek time runs
        assert "(no name)" not in sb.refresh().violations.blocked_names
        time.sleep(0.5)
    want = {"cdn-denied.test": 1, "(no name)": 1}
    wait_for(lambda: sb.refresh().violations.blocked_names == want, timeout_s=15)
    proc.wait(30)
