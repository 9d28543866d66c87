"""`python -m chronus --fd N`: serve the framed channel on inherited socket N.

aether normally forks chronus (sharing its imported modules copy-on-write);
this entry runs it as a separate program, for tests and for aether's
`DSEC_AETHER_CHRONUS_MODE=exec`.
"""

from __future__ import annotations

import _socket
import os
import sys

from chronus.engine import serve_socket
from insandbox.security import make_undumpable


def main(argv: list[str] | None = None) -> None:
    # No argparse: it would cost more memory than the rest of the entry point.
    args = sys.argv[1:] if argv is None else argv
    fd = int(os.environ.get("DSEC_CHRONUS_FD", "3"))
    if len(args) == 2 and args[0] == "--fd":
        fd = int(args[1])
    elif args:
        sys.exit("usage: python -m chronus [--fd N]")
    make_undumpable()
    serve_socket(_socket.socket(fileno=fd))
    os._exit(0)  # do not wait for stream threads: the channel is gone


if __name__ == "__main__":
    main()
