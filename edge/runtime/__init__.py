"""The edge's container runtime: EROFS layers + overlayfs + runc, and the OCI bundle.

Domain code only (no gRPC, no generated protobuf): the edge's servicer adapts it. Calls block;
the async edge runs them with asyncio.to_thread.
"""

from edge.runtime.errors import (
    InvalidLaunchSpecError,
    LayerError,
    MountError,
    OverlayOptionsTooLongError,
    RuncError,
    RuntimeStartError,
    SandboxExistsError,
    SandboxNotFoundError,
    SandboxRuntimeError,
    ToolkitBuildError,
)
from edge.runtime.mounts import LayerImage, LayerMounts, mount_overlay, unmount_overlay
from edge.runtime.runc import RuncRuntime, become_subreaper
from edge.runtime.spec import (
    LaunchSpec,
    RuntimeState,
    RuntimeStats,
    SandboxProcess,
    SandboxStatus,
)

__all__ = [
    "InvalidLaunchSpecError",
    "LaunchSpec",
    "LayerError",
    "LayerImage",
    "LayerMounts",
    "MountError",
    "OverlayOptionsTooLongError",
    "RuncError",
    "RuncRuntime",
    "RuntimeStartError",
    "RuntimeState",
    "RuntimeStats",
    "SandboxExistsError",
    "SandboxNotFoundError",
    "SandboxProcess",
    "SandboxRuntimeError",
    "SandboxStatus",
    "ToolkitBuildError",
    "become_subreaper",
    "mount_overlay",
    "unmount_overlay",
]
