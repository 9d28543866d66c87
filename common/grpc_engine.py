"""gRPC's I/O engine for dsec's services: imported first by every service's ``__main__``,
before anything loads grpc (the core reads its experiments once, at start-up).

gRPC core >= 1.6x moves socket I/O of clients and listeners onto its EventEngine threads;
with the asyncio API that is one more thread between the socket and the event loop for every
message (socket -> EventEngine thread -> completion-queue poller thread -> loop). With those
two experiments off, the poller thread that waits on the completion queue does the socket
I/O itself. Measured on this machine's FnCall throughput path (10 ms jobs, 16 callers,
alternated runs, every process's CPU from /proc): context switches per job halved in the
API server (26 -> 13), edge (15 -> 8) and SDK caller (12 -> 7), and their CPU per job fell
1.07-1.25 -> 0.76-0.79 ms (API server), 1.16-1.43 -> 1.03-1.06 ms (edge).

An operator's own ``GRPC_EXPERIMENTS`` wins (set it to an empty string for gRPC's default).
The SDK does not do this (it would change every other gRPC user in the caller's process);
callers may set the same variable themselves.
"""

from __future__ import annotations

import os
import sys

#: The experiments dsec's services turn off.
EXPERIMENTS = "-event_engine_client,-event_engine_listener"

if "grpc" in sys.modules:  # too late to matter: say so, change nothing
    print(
        "dsec: common.grpc_engine imported after grpc; gRPC's I/O engine unchanged", file=sys.stderr
    )
else:
    os.environ.setdefault("GRPC_EXPERIMENTS", EXPERIMENTS)
