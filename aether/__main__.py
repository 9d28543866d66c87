"""`python -m aether`: the container's process, started by runc.

The edge passes an already-listening Unix stream socket as fd 3
(DSEC_AETHER_LISTEN_FD, or `--listen-fd N`); in a VM the channel is a character device instead
(DSEC_AETHER_CHANNEL_DEVICE: the guest's virtio-serial port to the edge). Run it as `python -S -m aether`
with PYTHONPATH at the toolkit: site-packages are neither needed nor wanted.
"""

from __future__ import annotations

import _socket
import os
import sys

from aether.config import AetherConfig
from insandbox.log import get_logger
from insandbox.security import become_subreaper, install_seccomp_from_env, make_undumpable

log = get_logger("aether")


def main(argv: list[str] | None = None) -> int:
    # Before anything else: from here on, every process of the sandbox runs under the filter.
    failure = install_seccomp_from_env()
    if failure is not None:
        log.error("seccomp: %s", failure)
        return 3
    try:
        config = AetherConfig.load(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    if not make_undumpable():
        log.warning("prctl(PR_SET_DUMPABLE, 0) failed: /proc/%d/fd is reachable", os.getpid())
    if os.getpid() != 1 and not become_subreaper():
        log.warning("not pid 1 and not a subreaper: orphans escape aether")
    listener = None
    if not config.channel_device:
        try:
            listener = _socket.socket(fileno=config.listen_fd)
        except OSError as exc:
            log.error("fd %d is not a listening socket: %s", config.listen_fd, exc)
            return 2
    # Imported after the prctl calls and before chronus is forked: chronus
    # shares every module page aether loaded, copy-on-write.
    from aether.server import Aether

    return Aether(config, listener).run()


if __name__ == "__main__":
    sys.exit(main())
