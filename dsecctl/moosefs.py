"""A MooseFS file system on lab hosts: the shared layer store of a multi-node cluster.

The report serves every node's images from one distributed file system (3FS) mounted through
its FUSE client. MooseFS (Debian's ``moosefs-*`` packages) has the same shape: one metadata
server (``mfsmaster``), chunkservers holding the data (64 MiB chunks, replicated ``goal``
times), and a FUSE client (``mfsmount``) on every node. Every daemon takes a config file naming
its addresses, ports and directories, so several file systems, and every daemon of one, run
side by side on lab hosts (:mod:`dsecctl.hosts`) with nothing written outside their directory.
Why MooseFS rather than GlusterFS or CephFS: docs/ARCHITECTURE.md, "Several machines".

Every daemon runs in the foreground as a child of this process (``-f``): its PID is known, and
:meth:`MooseFS.close` unmounts the clients and stops the daemons, also after a failure. A
chunkserver refuses a loopback master address, so the master must be on a lab host.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from dsecctl.hosts import Host

MASTER_PORTS = {"MATOML": 9419, "MATOCS": 9420, "MATOCL": 9421}
CHUNKSERVER_PORT = 9422


class MooseFSError(RuntimeError):
    """A daemon did not start, or a mount failed."""


@dataclass
class _Daemon:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


def _accepts(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((address, port)) == 0


def _write_cfg(path: Path, values: dict[str, object]) -> Path:
    path.write_text("".join(f"{k} = {v}\n" for k, v in values.items()))
    return path


class MooseFS:
    """One MooseFS: the master on ``master``, one chunkserver per host of ``chunkservers``
    (data under each host's own directory), clients mounted with :meth:`mount`."""

    def __init__(self, root: Path, master: Host, chunkservers: list[Host], goal: int = 0) -> None:
        self.root = root
        self.master = master
        self.chunkservers = chunkservers
        #: Copies of each chunk (0: as many as there are chunkservers, at most 2).
        self.goal = goal or min(2, len(chunkservers))
        self._daemons: list[_Daemon] = []
        self.mounts: dict[Path, _Daemon] = {}

    # --------------------------------------------------------------- daemons

    def _spawn(self, name: str, host: Host, argv: list[str]) -> _Daemon:
        log = self.root / f"{name}.log"
        with open(log, "ab") as fh:
            proc = subprocess.Popen(
                host.command(argv),
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        d = _Daemon(name, proc, log)
        self._daemons.append(d)
        return d

    def start(self, timeout_s: float = 30.0) -> MooseFS:
        try:
            self._start(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, timeout_s: float) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        mdir = self.root / "master"
        mdir.mkdir(exist_ok=True)
        if not (mdir / "metadata.mfs").exists():
            (mdir / "metadata.mfs").write_text("MFSM NEW")  # an empty file system
        exports = self.root / "mfsexports.cfg"
        exports.write_text("* / rw,alldirs,maproot=0\n")
        cfg = {
            "WORKING_USER": "root",
            "WORKING_GROUP": "root",
            "DATA_PATH": mdir,
            "EXPORTS_FILENAME": exports,
            "LOCK_MEMORY": 0,
            **{f"{k}_LISTEN_HOST": self.master.address for k in MASTER_PORTS},
            **{f"{k}_LISTEN_PORT": v for k, v in MASTER_PORTS.items()},
        }
        master_cfg = _write_cfg(self.root / "mfsmaster.cfg", cfg)
        self._spawn("mfsmaster", self.master, ["mfsmaster", "-f", "-c", str(master_cfg), "start"])
        for i, host in enumerate(self.chunkservers):
            data = host.local("mfschunkserver")
            (data / "chunks").mkdir(exist_ok=True)
            hdd = data / "mfshdd.cfg"
            hdd.write_text(f"{data / 'chunks'}\n")
            cs_cfg = _write_cfg(
                data / "mfschunkserver.cfg",
                {
                    "WORKING_USER": "root",
                    "WORKING_GROUP": "root",
                    "DATA_PATH": data,
                    "HDD_CONF_FILENAME": hdd,
                    "MASTER_HOST": self.master.address,
                    "MASTER_PORT": MASTER_PORTS["MATOCS"],
                    "CSSERV_LISTEN_HOST": host.address,
                    "CSSERV_LISTEN_PORT": CHUNKSERVER_PORT,
                    # A test's small disk: keep only 256 MiB free, not the default's 4 GiB.
                    "HDD_LEAVE_SPACE_DEFAULT": "256MiB",
                },
            )
            self._spawn(
                f"mfschunkserver-{i}", host, ["mfschunkserver", "-f", "-c", str(cs_cfg), "start"]
            )
        deadline = time.monotonic() + timeout_s
        while not _accepts(self.master.address, MASTER_PORTS["MATOCL"]):
            self._check_daemons()
            if time.monotonic() > deadline:
                raise MooseFSError(f"mfsmaster not listening after {timeout_s:.0f} s")
            time.sleep(0.1)
        # Ready once a client sees every chunkserver's space.
        probe = self.root / "probe-mount"
        self.mount(self.master, probe)
        deadline = time.monotonic() + timeout_s
        while os.statvfs(probe).f_blocks == 0:
            self._check_daemons()
            if time.monotonic() > deadline:
                raise MooseFSError(f"no chunkserver registered in {timeout_s:.0f} s")
            time.sleep(0.2)
        subprocess.run(
            ["mfssetgoal", "-r", str(self.goal), str(probe)], capture_output=True, check=False
        )
        self.unmount(probe)

    def _check_daemons(self) -> None:
        for d in self._daemons:
            if d.proc.poll() is not None:
                tail = d.log.read_text(errors="replace")[-2000:]
                raise MooseFSError(f"{d.name} exited with {d.proc.returncode}:\n{tail}")

    # --------------------------------------------------------------- clients

    def mount(self, host: Host, target: Path, timeout_s: float = 15.0) -> Path:
        """Mounts the file system at ``target`` through a FUSE client on ``host``."""
        target.mkdir(parents=True, exist_ok=True)
        opts = f"mfsmaster={self.master.address},mfsport={MASTER_PORTS['MATOCL']}"
        d = self._spawn(
            f"mfsmount-{host.name}-{len(self.mounts)}",
            host,
            ["mfsmount", "-f", "-o", opts, str(target)],
        )
        deadline = time.monotonic() + timeout_s
        while not os.path.ismount(target):
            if d.proc.poll() is not None:
                raise MooseFSError(
                    f"mfsmount on {host.name} exited: {d.log.read_text(errors='replace')[-1000:]}"
                )
            if time.monotonic() > deadline:
                raise MooseFSError(f"mfsmount on {host.name}: {target} not mounted")
            time.sleep(0.05)
        self.mounts[target] = d
        return target

    def unmount(self, target: Path) -> None:
        d = self.mounts.pop(target, None)
        r = subprocess.run(["umount", str(target)], capture_output=True)
        if r.returncode != 0:
            # Busy (a layer mount still reads a blob through it) or its client is dead
            # (ENOTCONN): detach it; the kernel lets go when the last user does.
            subprocess.run(["umount", "-l", str(target)], capture_output=True)
        if d is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                d.proc.wait(timeout=10)
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()
            self._daemons.remove(d)

    def client_read_bytes(self, target: Path) -> int:
        """Bytes the FUSE client mounted at ``target`` has read so far (``rchar`` of its
        process: the file data it fetched from chunkservers, plus the kernel's requests and
        the master's answers, both small next to data): what that node read from the store,
        as a difference between two calls. Unlike the chunkservers' counters it does not
        count the copies chunkservers send each other when a write is replicated."""
        d = self.mounts[target]
        for line in Path(f"/proc/{d.proc.pid}/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
        raise MooseFSError(f"no rchar in /proc/{d.proc.pid}/io")

    def close(self) -> None:
        for target in list(self.mounts):
            self.unmount(target)
        for d in reversed(self._daemons):
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for d in reversed(self._daemons):
            with contextlib.suppress(subprocess.TimeoutExpired):
                d.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()
        self._daemons.clear()

    def __enter__(self) -> MooseFS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
