"""aether configuration, read once at start from `DSEC_AETHER_*` variables
(and `--listen-fd N` on the command line). The channel to the edge is either a listening socket
passed as a descriptor (containers: DSEC_AETHER_LISTEN_FD) or a character device
(VMs: DSEC_AETHER_CHANNEL_DEVICE, e.g. a virtio-serial port /dev/vport0p1)."""

from __future__ import annotations

import os

TYPE_CHECKING = False  # `collections` costs ~2 ms at start: annotations are strings
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence


class AetherConfig:
    """Immutable by convention. Not a dataclass: `dataclasses` imports
    `inspect` and `ast`, ~3 MB per process (measured)."""

    sigterm_grace_s = 2.0
    restart_backoff_s = 1.0  # minimum spacing of chronus restarts

    def __init__(
        self,
        listen_fd: int = 3,
        chronus_mode: str = "fork",
        ping_idle_s: float = 5.0,
        peer_dead_s: float = 20.0,
        channel_device: str = "",
    ) -> None:
        self.listen_fd = listen_fd  # an already-listening stream socket from the edge
        # or, instead, a character device to the host (a VM's virtio-serial port)
        self.channel_device = channel_device
        self.chronus_mode = chronus_mode  # "fork": share imported modules; "exec": fresh
        self.ping_idle_s = ping_idle_s  # send Ping when nothing arrived for this long
        self.peer_dead_s = peer_dead_s  # drop the edge connection after this much silence

    def __repr__(self) -> str:
        return (
            f"AetherConfig(listen_fd={self.listen_fd}, channel_device={self.channel_device!r}, "
            f"chronus_mode={self.chronus_mode!r}, "
            f"ping_idle_s={self.ping_idle_s}, peer_dead_s={self.peer_dead_s})"
        )

    @classmethod
    def load(
        cls, argv: Sequence[str] = (), environ: Mapping[str, str] | None = None
    ) -> AetherConfig:
        environ = os.environ if environ is None else environ
        listen_fd = int(environ.get("DSEC_AETHER_LISTEN_FD", "3"))
        args = list(argv)
        if len(args) == 2 and args[0] == "--listen-fd":
            listen_fd = int(args[1])
        elif args:
            raise ValueError("usage: python -m aether [--listen-fd N]")
        mode = environ.get("DSEC_AETHER_CHRONUS_MODE", "fork")
        if mode not in ("fork", "exec"):
            raise ValueError(f"DSEC_AETHER_CHRONUS_MODE must be fork or exec, not {mode!r}")
        cfg = cls(
            listen_fd=listen_fd,
            chronus_mode=mode,
            ping_idle_s=float(environ.get("DSEC_AETHER_PING_IDLE_S", "5")),
            peer_dead_s=float(environ.get("DSEC_AETHER_PEER_DEAD_S", "20")),
            channel_device=environ.get("DSEC_AETHER_CHANNEL_DEVICE", ""),
        )
        if cfg.listen_fd < 0 or cfg.ping_idle_s <= 0 or cfg.peer_dead_s <= cfg.ping_idle_s:
            raise ValueError("invalid aether configuration: " + repr(cfg))
        return cfg
