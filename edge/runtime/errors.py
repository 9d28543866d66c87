"""Errors of the container runtime layer.

One root (`SandboxRuntimeError`) so the edge's gRPC adapter can map the whole layer in one
place; each subclass names one failure the caller can act on differently (bad input, a mount the
kernel refused, runc refusing to start, a sandbox that is not there). They carry the facts an
operator needs (errno, runc's own stderr), never just a formatted string.
"""

from __future__ import annotations

import errno as errno_mod
import os


class SandboxRuntimeError(Exception):
    """Root of every error raised by `edge.runtime`."""


class InvalidLaunchSpecError(SandboxRuntimeError, ValueError):
    """The launch spec is malformed (bad id, missing layer, impossible limits)."""


class SandboxExistsError(SandboxRuntimeError):
    """A sandbox with this id already has state on this node."""

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox {sandbox_id!r} already exists on this node")
        self.sandbox_id = sandbox_id


class SandboxNotFoundError(SandboxRuntimeError):
    """The runtime knows nothing about this sandbox id."""

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox {sandbox_id!r} not found")
        self.sandbox_id = sandbox_id


class MountError(SandboxRuntimeError, OSError):
    """mount(2) or umount2(2) failed; carries the errno and every argument of the call.

    Subclasses OSError so `exc.errno` works as usual (EBUSY, ENOENT, EINVAL are the ones worth
    branching on).
    """

    def __init__(
        self,
        err: int,
        op: str,
        target: str,
        *,
        source: str = "",
        fstype: str = "",
        flags: int = 0,
        data: str = "",
    ) -> None:
        detail = f"{op} {target!r}"
        if source or fstype:
            detail += f" (source={source!r}, fstype={fstype!r}, flags={flags:#x}, data={data!r})"
        name = errno_mod.errorcode.get(err, str(err))
        super().__init__(err, f"{detail}: {name}: {os.strerror(err)}")
        self.op = op
        self.target = target
        self.source = source
        self.fstype = fstype
        self.flags = flags
        self.data = data


class OverlayOptionsTooLongError(SandboxRuntimeError, ValueError):
    """The overlay mount options exceed what one mount(2) data page can carry."""

    def __init__(self, length: int, limit: int, layers: int) -> None:
        super().__init__(
            f"overlay options are {length} bytes for {layers} lower layers; mount(2) accepts at "
            f"most {limit}: use fewer layers or a shorter layer mount root"
        )
        self.length = length
        self.limit = limit
        self.layers = layers


class LayerError(SandboxRuntimeError):
    """A read-only layer cannot be used (missing file, unknown format)."""


class RuncError(SandboxRuntimeError):
    """A runc command failed; `stderr` is runc's own message, `argv` the command line."""

    def __init__(self, argv: list[str], returncode: int, stderr: str) -> None:
        msg = stderr.strip() or f"exit status {returncode}"
        super().__init__(f"{' '.join(argv[:4])} ...: {msg}")
        self.argv = argv
        self.returncode = returncode
        self.stderr = stderr


class RuntimeStartError(RuncError):
    """`runc run` failed to start the sandbox; everything create() did has been undone."""


class ToolkitBuildError(SandboxRuntimeError):
    """The toolkit layer could not be built (missing interpreter, ldd or mkfs.erofs failure)."""
