"""Warm microVMs: restored guests waiting for their owner (DSEC_EDGE_MICROVM_WARM_POOL), the
shared warm pool (edge/backends/warm.py) with the one rule a guest adds: its shape is fixed."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from edge.backends.microvm.vm import Shape
from edge.backends.warm import WarmPool, WarmSandbox
from edge.model import SandboxRecord, SandboxSpec


class MicrovmWarmPool(WarmPool):
    """Warm microVMs serve creates of the pool's shape only (the guest's vCPUs, RAM and disk
    cannot change under it): 1 vCPU, `memory_mb` of RAM, the default disk."""

    def __init__(
        self,
        targets: dict[str, int],
        start: Callable[[str], Awaitable[WarmSandbox]],
        discard: Callable[[WarmSandbox], Awaitable[None]],
        shape_of: Callable[[SandboxSpec], Shape],
        memory_mb: int,
    ) -> None:
        super().__init__(targets, start, discard)
        self.shape_of = shape_of
        self.memory_mb = memory_mb

    def spec(self, image: str) -> SandboxSpec:
        """What a warm guest of `image` is started as."""
        return SandboxSpec(backend="MICROVM", image=image, memory_mb=self.memory_mb)

    def eligible(self, rec: SandboxRecord) -> bool:
        pool = self.shape_of(self.spec(rec.spec.image))
        return super().eligible(rec) and self.shape_of(rec.spec) == pool
