"""insandbox: what the two in-sandbox agents, aether and chronus, share.

aether (pid 1: the edge's channel, the relay, init duties) and chronus (the engine: commands,
sessions, files) run in every sandbox from the toolkit layer (edge/toolkit.py), on its bare
interpreter, standard library only. This package holds what both of them use, so that neither
imports the other:

  wire      the frame codec: contract messages as dicts, from `dsec.wire_schema` (no protobuf)
  log       a stderr logger (`logging` costs ~1.3 MB per process)
  security  prctl settings (non-dumpable, subreaper) and the seccomp program installer
  poller    epoll shaped like the subset of `selectors` the agents use
  proc      the process table, and signalling a process, a group or a session's tree

Layering (tests/unit/test_layering.py): aether and chronus import insandbox; insandbox imports
neither of them, nor anything outside the standard library but `dsec.wire_schema`. Every module
here is loaded by aether before it forks chronus, so the two processes share its pages
copy-on-write: keep it small and free of heavy imports (see `chronus.threads` for why).
"""

#: The version of the in-sandbox agents, reported in aether's Hello (`chronus_version`). aether,
#: chronus and this library ship together in one toolkit: chronus is forked from aether's own
#: modules, or started from the same toolkit, so the two never differ.
__version__ = "0.1.0"
