"""Runtime backends of the edge, one package each, held to one contract (`contract.py`).

- `null.py`: tracks sandboxes, starts nothing (control-plane tests and benchmarks);
- `container/`: runc over EROFS layers (lifecycle, warm claim, containment, trusted execution);
- the VM runtimes (`microvm/` on QEMU's microvm machine, `vm/` on libvirt) go beside it.

Backends that put aether in the sandbox share the channel keeping of `channels.py`.
"""

from edge.backends.contract import (
    BackgroundLoop,
    Capability,
    ExitCallback,
    SandboxBackend,
    SandboxChannel,
    check_declared,
    offers,
    require,
)
from edge.backends.null import NullBackend

__all__ = [
    "BackgroundLoop",
    "Capability",
    "ExitCallback",
    "NullBackend",
    "SandboxBackend",
    "SandboxChannel",
    "check_declared",
    "offers",
    "require",
]
