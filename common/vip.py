"""A virtual IP for a stateless tier: each instance announces it over BGP while it is healthy.

The API servers (and the compatibility front ends) keep no state of their own, so any
instance can answer any call. The report puts them behind one BGP-announced virtual IP with
ECMP: the router in front spreads connections over every instance that announces the
address, and a failed instance's route is withdrawn within seconds. Here:

- each instance has the virtual IP on its host's ``lo`` and listens on all addresses;
- next to it runs a small *route agent* (``python -m common.vip``), started by the instance
  itself with a parent-death signal, which runs FRR's ``bgpd`` (Debian's package ``frr``;
  ``bgpd`` alone, without zebra: it only speaks, it installs no route) peering with the router,
  also with a parent-death signal;
- the agent checks the instance through the virtual IP itself (gRPC health of the instance's
  main service, or ``GET /health`` of an HTTP one) every ``vip_check_interval_s``, announces
  the ``/32`` after ``vip_rise`` passes and withdraws it after ``vip_fall`` failures (a
  refused connection, an answer other than SERVING, no answer within a second: a hung
  instance too);
- the instance reads the agent's state lines (stdout, one JSON object each) and reports
  SERVING only while the agent runs: a routing daemon that cannot start makes it answer
  NOT_SERVING, with the reason in its log (what ``dsec status`` shows);
- on SIGTERM the instance asks the agent to withdraw and waits for it before it stops
  taking calls.

What ends an announcement: the instance killed (``kill -9``): the agent and ``bgpd`` die
with it, the BGP session closes and the router drops the route at once; the instance hung or
unhealthy: the agent withdraws; the whole host gone: the router's hold timer
(``vip_hold_s``, 3 s) ends the session. The router side (``dsecctl/vip_router.py``) accepts
any instance of its subnet as a BGP peer, so a new instance takes traffic without a change
to the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from common.config import ConfigError

log = logging.getLogger(__name__)

#: Where Debian's frr package puts its daemons.
FRR_DIR = "/usr/lib/frr"
#: A route agent that died is started again after this long.
RESPAWN_S = 1.0


@dataclass(frozen=True)
class VipConfig:
    """The ``vip_*`` fields of a service that can run behind a virtual IP (``DSEC_<SVC>_VIP``...)."""

    #: The virtual IP this instance announces ("" = none: the instance has only its address).
    vip: str = ""
    #: The BGP neighbour: the router (a top-of-rack switch, or dsecctl/vip_router.py).
    vip_peer: str = ""
    #: This instance's AS number, and the router's.
    vip_asn: int = 65100
    vip_peer_asn: int = 65000
    #: BGP keepalive and hold time toward the router (what ends a lost host's route).
    vip_keepalive_s: int = 1
    vip_hold_s: int = 3
    #: The route agent's health check of this instance: period, passes to announce,
    #: failures to withdraw.
    vip_check_interval_s: float = 0.25
    vip_rise: int = 1
    vip_fall: int = 2
    #: FRR's daemons (bgpd), and where the agent keeps bgpd's config, sockets and log.
    vip_frr_dir: str = FRR_DIR
    vip_state_dir: str = ""

    def validate_vip(self, listen: str) -> None:
        if not self.vip:
            return
        try:
            ipaddress.IPv4Address(self.vip)
            ipaddress.IPv4Address(self.vip_peer)
        except ValueError as exc:
            raise ConfigError(f"vip and vip_peer must be IPv4 addresses: {exc}") from None
        host = listen.rsplit(":", 1)[0]
        if listen.startswith("unix") or host not in ("0.0.0.0", self.vip):
            raise ConfigError(
                f"with a vip the listen address must be 0.0.0.0:<port> or {self.vip}:<port>"
                f" (calls arrive for the virtual IP), not {listen!r}"
            )
        if not self.vip_state_dir:
            raise ConfigError("vip_state_dir must be set with a vip (bgpd's files)")
        if not (1 <= self.vip_keepalive_s < self.vip_hold_s):
            raise ConfigError("vip_keepalive_s must be >= 1 and below vip_hold_s")
        if self.vip_rise < 1 or self.vip_fall < 1 or self.vip_check_interval_s <= 0:
            raise ConfigError("vip_rise and vip_fall must be >= 1, vip_check_interval_s > 0")


def bgpd_config(cfg: VipConfig, router_id: str) -> str:
    """bgpd's configuration for an instance: one eBGP session to the router, the /32."""
    peer = cfg.vip_peer
    return f"""hostname dsec-vip
router bgp {cfg.vip_asn}
 bgp router-id {router_id}
 no bgp ebgp-requires-policy
 no bgp network import-check
 neighbor {peer} remote-as {cfg.vip_peer_asn}
 neighbor {peer} timers {cfg.vip_keepalive_s} {cfg.vip_hold_s}
 neighbor {peer} timers connect 1
 address-family ipv4 unicast
  neighbor {peer} activate
 exit-address-family
"""


#: Prefix of a child's argv: SIGKILL it when the thread that started it dies (``kill -9``).
#: util-linux's ``setpriv`` sets the parent-death signal and execs the child. Not a
#: ``preexec_fn``: that runs Python between fork and exec, and a fork of a process with gRPC's
#: threads can deadlock there (a lock held by another thread at the fork is never released);
#: a child stuck so never execs, and its instance waited for it forever.
DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL", "--"]


# ------------------------------------------------------------------------ the route agent


class RouteAgent:
    """The agent process: bgpd, the health check, announce and withdraw (module doc)."""

    def __init__(self, cfg: VipConfig, check: str) -> None:
        self.cfg = cfg
        #: "grpc:<host:port>/<service>" or "http://<host:port>/<path>".
        self.check_target = check
        self.dir = Path(cfg.vip_state_dir)
        self.bgpd: subprocess.Popen[bytes] | None = None
        self.announced = False
        self.held = False  # withdrawn for good (the instance is stopping)
        self._channel: object | None = None
        self._last_session = ""

    def emit(self, state: str, reason: str = "", **extra: object) -> None:
        print(json.dumps({"state": state, "reason": reason, **extra}), flush=True)

    # -------------------------------------------------------------------- bgpd

    def start_bgpd(self) -> None:
        """Writes bgpd's config and starts it; raises RuntimeError with bgpd's own words."""
        self.dir.mkdir(parents=True, exist_ok=True)
        binary = Path(self.cfg.vip_frr_dir) / "bgpd"
        if not os.access(binary, os.X_OK):
            raise RuntimeError(f"{binary} not found (Debian package frr)")
        router_id = _source_address(self.cfg.vip_peer)
        conf = self.dir / "bgpd.conf"
        conf.write_text(bgpd_config(self.cfg, router_id))
        for stale in ("bgpd.vty", "bgpd.pid"):
            with contextlib.suppress(FileNotFoundError):
                (self.dir / stale).unlink()
        out = open(self.dir / "bgpd.out", "wb")
        self.bgpd = subprocess.Popen(
            [
                *DIE_WITH_PARENT,
                str(binary),
                "-S",  # no user change: the parent-death signal survives
                "-Z",  # no zebra: this bgpd only announces
                "-p",
                "0",  # it connects to the router; it listens for no one
                "-P",
                "0",
                "-f",
                str(conf),
                "-i",
                str(self.dir / "bgpd.pid"),
                "--vty_socket",
                str(self.dir),
                "--log",
                f"file:{self.dir / 'bgpd.log'}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        out.close()
        deadline = time.monotonic() + 10
        while not (self.dir / "bgpd.vty").exists():
            if self.bgpd.poll() is not None:
                raise RuntimeError(f"bgpd exited with {self.bgpd.returncode}: {self._bgpd_says()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"bgpd did not open its vty socket in 10 s: {self._bgpd_says()}")
            time.sleep(0.05)

    def _bgpd_says(self) -> str:
        text = ""
        for name in ("bgpd.out", "bgpd.log"):
            with contextlib.suppress(OSError):
                text += (self.dir / name).read_text(errors="replace")
        lines = [line for line in text.splitlines() if line.strip()]
        return " | ".join(lines[-3:]) or "(no output)"

    def vtysh(self, *commands: str) -> subprocess.CompletedProcess[str]:
        argv = ["vtysh", "--vty_socket", str(self.dir)]
        for c in commands:
            argv += ["-c", c]
        return subprocess.run(argv, capture_output=True, text=True, timeout=10)

    def set_announced(self, on: bool) -> None:
        no = "" if on else "no "
        r = self.vtysh(
            "configure terminal",
            f"router bgp {self.cfg.vip_asn}",
            "address-family ipv4 unicast",
            f"{no}network {self.cfg.vip}/32",
        )
        if r.returncode != 0:
            raise RuntimeError(f"vtysh: {(r.stdout + r.stderr).strip()}")
        self.announced = on
        self.emit("announced" if on else "withdrawn", session=self.session())

    def session(self) -> str:
        """The BGP session's state toward the router ("Established", "Active", ...)."""
        r = self.vtysh(f"show bgp neighbors {self.cfg.vip_peer} json")
        try:
            return str(json.loads(r.stdout)[self.cfg.vip_peer]["bgpState"])
        except (ValueError, KeyError, TypeError):
            return "unknown"

    # -------------------------------------------------------------------- the check

    def healthy(self) -> bool:
        if self.check_target.startswith("http://"):
            import urllib.error
            import urllib.request

            try:
                with urllib.request.urlopen(self.check_target, timeout=1.0) as resp:
                    return bool(resp.status == 200)
            except (OSError, urllib.error.URLError):
                return False
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        target, _, service = self.check_target.removeprefix("grpc:").partition("/")
        if self._channel is None:
            self._channel = grpc.insecure_channel(target)
        try:
            resp = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1.0
            )
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    # -------------------------------------------------------------------- the loop

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            self.start_bgpd()  # first: nothing changes on the host if it cannot start
            _add_vip(self.cfg.vip)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            self.emit("failed", f"routing daemon cannot start: {exc}")
            return 3
        self.emit("ready", session=self.session())
        passes = fails = 0
        next_session = time.monotonic() + 2
        try:
            while True:
                if self.bgpd is not None and self.bgpd.poll() is not None:
                    self.emit(
                        "failed", f"bgpd exited with {self.bgpd.returncode}: {self._bgpd_says()}"
                    )
                    return 3
                ok = self.healthy()
                passes, fails = (passes + 1, 0) if ok else (0, fails + 1)
                if not self.held:
                    if not self.announced and passes >= self.cfg.vip_rise:
                        self.set_announced(True)
                    elif self.announced and fails >= self.cfg.vip_fall:
                        self.set_announced(False)
                if time.monotonic() > next_session:
                    session = self.session()
                    if session != self._last_session:
                        self._last_session = session
                        self.emit("session", session=session, announced=self.announced)
                    next_session = time.monotonic() + 2
                if self._read_command(self.cfg.vip_check_interval_s):
                    return 0
        finally:
            if self.announced:
                with contextlib.suppress(Exception):
                    self.set_announced(False)
            if self.bgpd is not None and self.bgpd.poll() is None:
                self.bgpd.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.bgpd.wait(3)

    def _read_command(self, wait_s: float) -> bool:
        """Waits up to ``wait_s`` for a command from the instance; True: stop (stdin closed)."""
        ready, _, _ = select.select([sys.stdin], [], [], wait_s)
        if not ready:
            return False
        line = sys.stdin.readline()
        if not line:
            return True
        if line.strip() == "withdraw":
            self.held = True
            if self.announced:
                self.set_announced(False)
            else:
                self.emit("withdrawn", session=self.session())
        return False


def _source_address(peer: str) -> str:
    """This host's address toward ``peer`` (bgpd's router id)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 179))
        return str(s.getsockname()[0])


def _add_vip(vip: str) -> None:
    """The virtual IP on ``lo`` of this host (idempotent): calls to it are delivered here."""
    r = subprocess.run(
        ["ip", "addr", "replace", f"{vip}/32", "dev", "lo"], capture_output=True, text=True
    )
    if r.returncode != 0:
        raise RuntimeError(f"ip addr replace {vip}/32 dev lo: {r.stderr.strip()}")


def main() -> int:
    """``python -m common.vip CONFIG_JSON CHECK``: the route agent of one instance."""
    fields = json.loads(sys.argv[1])
    cfg = VipConfig(**fields)
    return RouteAgent(cfg, sys.argv[2]).run()


# ------------------------------------------------------------------------ the instance's side


class RouteAgentHandle:
    """The instance's end: starts the agent, follows its state, asks it to withdraw.

    ``on_change(ok, reason)`` is called whenever the agent's ability to announce changes
    (``ok``: the agent runs with bgpd; not: it failed or died, ``reason`` says why).
    """

    def __init__(
        self,
        cfg: VipConfig,
        check: str,
        on_change: Callable[[bool, str], Awaitable[None]],
        name: str = "",
    ) -> None:
        self.cfg = cfg
        self.check = check
        self.on_change = on_change
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.state = "starting"
        self.reason = ""
        self._withdrawn = asyncio.Event()
        self._stopping = False

    def _spawn(self) -> subprocess.Popen[bytes]:
        # From the event loop's thread (the main one): the parent-death signal follows the
        # thread that forked, and this one lives as long as the process.
        fields = {f.name: getattr(self.cfg, f.name) for f in dataclasses.fields(VipConfig)}
        return subprocess.Popen(
            [*DIE_WITH_PARENT, sys.executable, "-m", "common.vip", json.dumps(fields), self.check],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    async def run(self) -> None:
        """Keeps one agent running (restarted 1 s after it dies) until cancelled."""
        last = ""
        while not self._stopping:
            self.proc = self._spawn()
            try:
                await self._follow(self.proc)
            finally:
                if self.proc.poll() is None:
                    self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
            if self._stopping:
                return
            why = self.reason or f"route agent exited with {self.proc.returncode}"
            if why != last:  # once per reason, not once per attempt
                log.error(
                    "%s: not SERVING: virtual IP %s not announced: %s; trying again every %.0f s",
                    self.name,
                    self.cfg.vip,
                    why,
                    RESPAWN_S,
                )
                last = why
            await self.on_change(False, why)
            await asyncio.sleep(RESPAWN_S)

    async def _follow(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        while True:
            line = await asyncio.to_thread(proc.stdout.readline)
            if not line:
                return
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            state, reason = str(msg.get("state", "")), str(msg.get("reason", ""))
            self.state, self.reason = state, reason
            if state == "failed":
                continue  # logged and reported when the agent exits, just after
            if state == "ready":
                log.info(
                    "%s: route agent ready: virtual IP %s via %s (session %s)",
                    self.name,
                    self.cfg.vip,
                    self.cfg.vip_peer,
                    msg.get("session", ""),
                )
                await self.on_change(True, "")
            elif state in ("announced", "withdrawn"):
                log.info(
                    "%s: virtual IP %s %s (session %s)",
                    self.name,
                    self.cfg.vip,
                    state,
                    msg.get("session", ""),
                )
                if state == "withdrawn":
                    self._withdrawn.set()
            elif state == "session":
                log.info(
                    "%s: BGP session to %s: %s", self.name, self.cfg.vip_peer, msg.get("session")
                )

    async def withdraw(self, settle_s: float = 0.3) -> None:
        """Withdraws the route for good (the instance is stopping) and waits for it."""
        self._stopping = True
        proc = self.proc
        if proc is None or proc.poll() is not None or proc.stdin is None:
            return
        self._withdrawn.clear()
        with contextlib.suppress(OSError):
            proc.stdin.write(b"withdraw\n")
            proc.stdin.flush()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._withdrawn.wait(), 5.0)
        # The router has the UPDATE in well under this; connections in flight finish.
        await asyncio.sleep(settle_s)

    async def close(self) -> None:
        self._stopping = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()  # the agent withdraws and exits
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), 5.0)
            except TimeoutError:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
