"""chronus configuration, read once at start from `DSEC_CHRONUS_*` variables.

A plain class rather than a dataclass: `dataclasses` pulls in `inspect` and
`ast` (~3 MB per process, measured), too much for an in-sandbox agent.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # `collections` costs ~2 ms at start: annotations are strings
if TYPE_CHECKING:
    from collections.abc import Mapping

MIB = 1024 * 1024

# Variables of the agents themselves; commands must not see them.
_PRIVATE_PREFIXES = ("DSEC_AETHER_", "DSEC_CHRONUS_")
_LD_PREFIX = "DSEC_CHRONUS_ENV_LD_"


class ChronusConfig:
    """Immutable by convention: built once, then only read."""

    max_output_bytes_limit = 64 * MIB  # streaming/background ceiling per stream
    sync_output_bytes_limit = 3 * MIB  # an ExecResult must fit one 8 MiB frame
    sync_timeout_s = 600.0  # sync exec with timeout_s 0
    keepalive_ms = 5000
    linger_s = 0.1  # how long an exited command's pipes are still read
    keep_exited = 64  # exited background execs kept for attach/wait
    session_ready_s = 10.0
    #: A foreground command whose stream was abandoned (its connection went) waits this long
    #: (running time) for an AttachExec before it is killed (chronus.execs.Execs.orphan).
    orphan_grace_s = 60.0

    def __init__(
        self,
        workdir: str,
        runtime_dir: str,
        env: Mapping[str, str] | None = None,
        max_output_bytes: int = 1 * MIB,
        runtime_fd: int = -1,
        landlock: str = "auto",
    ) -> None:
        self.workdir = workdir
        self.runtime_dir = runtime_dir  # session FIFOs and scripts (when runtime_fd < 0)
        # A directory descriptor for the same, preferred: in a container the edge passes a
        # detached tmpfs, which no path in the sandbox leads to (chronus.landlock).
        self.runtime_fd = runtime_fd
        self.landlock = landlock  # "auto" (when available), "on" (required), "off"
        self.env = dict(env or {})  # sandbox env of every command
        self.max_output_bytes = max_output_bytes  # per stream, when a request says 0
        #: Accounts that may run commands as anyone through `sudo` (chronus.sudo); none: no
        #: sudo service.
        self.sudo_users: list[str] = []

    def __repr__(self) -> str:
        return f"ChronusConfig(workdir={self.workdir!r}, runtime_dir={self.runtime_dir!r})"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ChronusConfig:
        environ = os.environ if environ is None else environ
        workdir = environ.get("DSEC_CHRONUS_WORKDIR") or os.getcwd()
        runtime_dir = environ.get("DSEC_CHRONUS_RUNTIME_DIR") or "/run/dsec"
        if "'" in runtime_dir or '"' in runtime_dir or "\n" in runtime_dir:
            raise ValueError("DSEC_CHRONUS_RUNTIME_DIR must not contain quotes or newlines")
        env = {k: v for k, v in environ.items() if not k.startswith(_PRIVATE_PREFIXES)}
        # The sandbox's LD_* variables, kept from pid 1's loader by the edge (edge/backends/container/backend.py).
        for k, v in environ.items():
            if k.startswith(_LD_PREFIX) and len(k) > len(_LD_PREFIX):
                env["LD_" + k[len(_LD_PREFIX) :]] = v
        max_out = int(environ.get("DSEC_CHRONUS_MAX_OUTPUT_BYTES", str(1 * MIB)))
        if max_out <= 0:
            raise ValueError("DSEC_CHRONUS_MAX_OUTPUT_BYTES must be positive")
        runtime_fd = int(environ.get("DSEC_CHRONUS_RUNTIME_FD") or "-1")
        landlock = environ.get("DSEC_CHRONUS_LANDLOCK") or "auto"
        if landlock not in ("auto", "on", "off"):
            raise ValueError("DSEC_CHRONUS_LANDLOCK must be auto, on or off")
        cfg = cls(
            workdir=workdir,
            runtime_dir=runtime_dir,
            env=env,
            max_output_bytes=max_out,
            runtime_fd=runtime_fd,
            landlock=landlock,
        )
        cfg.sudo_users = [u for u in environ.get("DSEC_CHRONUS_SUDO_USERS", "").split(",") if u]
        grace = environ.get("DSEC_CHRONUS_ORPHAN_GRACE_S")
        if grace:
            cfg.orphan_grace_s = float(grace)
            if not cfg.orphan_grace_s > 0:
                raise ValueError("DSEC_CHRONUS_ORPHAN_GRACE_S must be positive")
        return cfg
