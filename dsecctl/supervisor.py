"""The local cluster's services under supervisord (PyPI ``supervisor``, a maintained
process supervisor): what ``dsec up`` runs.

supervisord starts each service as its child and, when one dies unexpectedly, starts it
again: at once after a run that lasted ``START_S``, with a growing back-off (1 s, 2 s, ...)
while it keeps dying during start-up, and never again after ``START_RETRIES`` such failures
(the service is then FATAL, and ``dsec status`` shows its log's tail). A graceful stop is
SIGTERM with ``STOP_WAIT_S`` before SIGKILL; only the service's own process gets the signal,
so an edge's sandboxes (their own process trees) outlive it and the next edge re-adopts
them.

Everything lives in ``<home>/supervisor/``: the generated ``supervisord.conf``, the control
socket (0700: root's only), supervisord's own log, one environment file per service (0600)
and ``events.json``, where an event listener (:mod:`dsecctl.supervisor_events`) counts each
service's automatic restarts. Service logs stay where they were (``<home>/logs``), rotated
by supervisord at ``LOG_MAX_BYTES``.

A service's environment travels in a JSON file read by :mod:`dsecctl.launch`, which execs
the service in place (same PID): supervisord's own ``environment=`` syntax cannot quote
every value. A program is ``python -m <module>`` (a dsec service) or a command of its own
(``argv``: a host daemon such as libvirtd, :mod:`dsecctl.host_daemons`), run in the
foreground and supervised the same way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xmlrpc.client
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.xmlrpc import SupervisorTransport

#: A run shorter than this counts as a failed start (back-off, then FATAL).
START_S = 3
#: Failed starts in a row before supervisord gives a service up (FATAL).
START_RETRIES = 4
#: SIGTERM, then SIGKILL after this.
STOP_WAIT_S = 40
#: A service's log is rotated at this size, keeping LOG_BACKUPS old ones.
LOG_MAX_BYTES = 50 * 1024 * 1024
LOG_BACKUPS = 2
#: supervisord's states of a process that is up or on its way up.
UP_STATES = ("STARTING", "RUNNING")
#: The event listener's program name (not a service).
LISTENER = "dsec-events"


class SupervisorError(RuntimeError):
    """supervisord could not be started or reached, or refused a request."""


@dataclass(frozen=True)
class Program:
    """One service as supervisord runs it."""

    name: str
    module: str
    env: dict[str, str]
    log_path: Path
    #: A command instead of ``python -m module`` (a host daemon in the foreground).
    argv: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProcessInfo:
    """What supervisord knows of one service."""

    name: str
    state: str  # STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, EXITED, FATAL, UNKNOWN
    pid: int
    description: str  # supervisord's: "pid 123, uptime 0:01:02", "Exited too quickly ..."


def _escape(value: str) -> str:
    """A value for supervisord's config: it expands %(name)s, so % is written %%."""
    if "\n" in value:
        raise SupervisorError(f"no newline allowed in a supervisord config value: {value!r}")
    return value.replace("%", "%%")


class Supervisor:
    """supervisord of one local cluster (``home``): its config, process and control socket."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.dir = home / "supervisor"
        self.conf = self.dir / "supervisord.conf"
        self.socket = self.dir / "supervisord.sock"
        self.pidfile = self.dir / "supervisord.pid"
        self.log = self.dir / "supervisord.log"
        self.events = self.dir / "events.json"

    # ---------------------------------------------------------------- config

    def write_config(self, programs: Iterable[Program], base_env: dict[str, str]) -> None:
        """The config for ``programs`` (in start order) and their environment files; each
        service's environment is ``base_env`` (the caller's, e.g. PATH) plus its own."""
        (self.dir / "env").mkdir(parents=True, exist_ok=True, mode=0o700)
        python = sys.executable
        lines = [
            "[supervisord]",
            "nodaemon=true",
            f"logfile={_escape(str(self.log))}",
            "logfile_maxbytes=10MB",
            "logfile_backups=1",
            f"pidfile={_escape(str(self.pidfile))}",
            f"childlogdir={_escape(str(self.dir))}",
            "",
            "[unix_http_server]",
            f"file={_escape(str(self.socket))}",
            "chmod=0700",
            "",
            "[rpcinterface:supervisor]",
            "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
            "",
            f"[eventlistener:{LISTENER}]",
            f"command={_escape(python)} -m dsecctl.supervisor_events {_escape(str(self.events))}",
            "events=PROCESS_STATE",
            "autorestart=true",
            f"stderr_logfile={_escape(str(self.dir / 'events.log'))}",
            "stderr_logfile_maxbytes=1MB",
            "stderr_logfile_backups=1",
            "",
        ]
        for priority, p in enumerate(programs, start=10):
            env_file = self.dir / "env" / f"{p.name}.json"
            fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                spec: dict[str, Any] = {"module": p.module, "env": {**base_env, **p.env}}
                if p.argv:
                    spec["argv"] = list(p.argv)
                json.dump(spec, fh)
            lines += [
                f"[program:{p.name}]",
                f"command={_escape(python)} -m dsecctl.launch {_escape(str(env_file))}",
                "autostart=false",  # `dsec up` starts them in dependency order
                "autorestart=true",  # whatever ended it, but supervisord's own stop
                f"startsecs={START_S}",
                f"startretries={START_RETRIES}",
                "stopsignal=TERM",
                f"stopwaitsecs={STOP_WAIT_S}",
                f"priority={priority}",
                f"stdout_logfile={_escape(str(p.log_path))}",
                f"stdout_logfile_maxbytes={LOG_MAX_BYTES}",
                f"stdout_logfile_backups={LOG_BACKUPS}",
                "redirect_stderr=true",
                "",
            ]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.conf.write_text("\n".join(lines))

    # ------------------------------------------------------------ supervisord

    def start(self, env: dict[str, str], timeout_s: float = 30.0) -> int:
        """Starts supervisord (its own session: a Ctrl-C in the terminal does not reach it)
        and waits until its control socket answers; returns its PID."""
        self.events.unlink(missing_ok=True)
        out = open(self.dir / "supervisord.out", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor.supervisord", "-n", "-c", str(self.conf)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        out.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise SupervisorError(
                    f"supervisord exited with {proc.returncode}: {self._tail(self.dir / 'supervisord.out')}"
                )
            try:
                if self.rpc().supervisor.getState()["statename"] == "RUNNING":
                    return proc.pid
            except (OSError, xmlrpc.client.Error):
                pass
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise SupervisorError(f"supervisord did not answer within {timeout_s:.0f} s")
            time.sleep(0.05)

    def pid(self) -> int:
        """supervisord's PID if it runs (0 if not)."""
        try:
            pid = int(self.pidfile.read_text().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return 0
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return 0
        return pid if b"supervisord" in cmdline and str(self.conf).encode() in cmdline else 0

    def rpc(self) -> Any:
        transport = SupervisorTransport(None, None, f"unix://{self.socket}")
        return xmlrpc.client.ServerProxy("http://localhost", transport=transport)

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stops supervisord (it stops whatever service still runs, in reverse order) and
        waits until it is gone; SIGKILL after ``timeout_s``."""
        pid = self.pid()
        if not pid:
            return
        try:
            self.rpc().supervisor.shutdown()
        except (OSError, xmlrpc.client.Error):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _pid_alive(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.05)

    # -------------------------------------------------------------- services

    def start_process(self, name: str) -> None:
        """Starts one service without waiting for its start to be judged (``START_S``)."""
        try:
            self.rpc().supervisor.startProcess(name, False)
        except xmlrpc.client.Fault as fault:
            if "ALREADY_STARTED" not in fault.faultString:
                raise SupervisorError(f"{name}: {fault.faultString}") from None

    def stop_process(self, name: str) -> None:
        """Stops one service gracefully (SIGTERM, SIGKILL after ``STOP_WAIT_S``); returns
        once it is gone."""
        try:
            self.rpc().supervisor.stopProcess(name, True)
        except xmlrpc.client.Fault as fault:
            if "NOT_RUNNING" not in fault.faultString:
                raise SupervisorError(f"{name}: {fault.faultString}") from None

    def processes(self) -> dict[str, ProcessInfo]:
        """Every service's state, by name (the event listener left out)."""
        return {
            i["name"]: ProcessInfo(
                name=i["name"],
                state=i["statename"],
                pid=int(i["pid"]),
                description=i["description"],
            )
            for i in self.rpc().supervisor.getAllProcessInfo()
            if i["group"] != LISTENER
        }

    def restarts(self) -> dict[str, dict[str, Any]]:
        """The listener's counts by service: ``restarts`` (automatic starts after a crash
        or a failed start), ``last_exit_at``."""
        try:
            data: dict[str, dict[str, Any]] = json.loads(self.events.read_text())
            return data
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _tail(path: Path, lines: int = 20) -> str:
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no output)"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (our own child not reaped yet) is gone for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
