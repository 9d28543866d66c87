"""The layer store: content-addressed EROFS layers, environments, on-demand loading.

- `model`: names, layer kinds, descriptors (a layer's digested identity), environments;
- `erofs`: reproducible chunked mkfs.erofs builds (metadata image + data blob);
- `store`: the store directory (local or a shared filesystem): layers, environments, GC;
- `node`: one node's local metadata copies, verification, leases, crash recovery;
- `tree`: overlayfs-form trees (whiteouts, opaque dirs), filtered copies, squashing;
- `sources`: imports from a directory, a tar archive, the local Docker engine;
- `diff`: pack_diff's residue-free snapshot of a sandbox's writable layer;
- `service`: `Environments`, the facade the edge uses.

Domain code only: nothing here imports gRPC or generated code.
"""

from edge.layers.model import Environment, LayerInfo, LayerKind, LayerRef, canonical_name
from edge.layers.service import Environments, LayerSettings, PackResult, ResolvedEnvironment

__all__ = [
    "Environment",
    "Environments",
    "LayerInfo",
    "LayerKind",
    "LayerRef",
    "LayerSettings",
    "PackResult",
    "ResolvedEnvironment",
    "canonical_name",
]
