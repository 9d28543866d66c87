"""Runtime backends of the edge, one package each, held to one contract (`contract.py`).

- `null.py`: tracks sandboxes, starts nothing (control-plane tests and benchmarks);
- `container/`: runc over EROFS layers (lifecycle, warm claim, containment, trusted execution);
- the VM runtimes (`microvm/` on QEMU's microvm machine, `vm/` on libvirt) go beside it.

What backends share lives here, beside the contract, never in a backend's folder: the channel
keeping of `channels.py` (backends that put aether in the sandbox), warm pools (`warm.py`), pause
reclaim and memory sampling (`pausing.py`), CPU QoS (`qos.py`). They are built from one table,
`registry.py`, over the node's services (`edge/node.py`); no backend imports another's modules.
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
