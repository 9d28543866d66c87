"""What a microVM boots: the host's Debian cloud kernel and an initramfs the edge builds.

The kernel is Debian's `linux-image-cloud-amd64` (virtio drivers are modules there, ext4 is
built in). The initramfs holds only what composes the sandbox's root before aether takes over:

    /init           init.sh next to this file (mount the layers, the overlay, switch_root)
    /bin/busybox    busybox-static (the shell and the mount/insmod/switch_root applets)
    /mod/*.ko       the modules init loads, with their dependencies, in dependency order
    /modules.order  their names, one per line, in load order

It is content-addressed (the kernel release, every input file and BUILD_FORMAT), built once per
node into `<dir>/<hash>/initrd.gz` and written atomically, so an edge restart or a second edge
reuses it and a changed input yields a new one (templates are keyed by it).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import lzma
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from libdsec.errors import FailedPrecondition

BUILD_FORMAT = "dsec-microvm-initrd/1"
INIT_SCRIPT = Path(__file__).with_name("init.sh")
BUSYBOX = Path("/bin/busybox")
KERNEL_GLOB = "vmlinuz-*-cloud-amd64"
#: What init loads: the virtio-mmio transport, disks, the agent's port, the root's filesystems,
#: the network card and the balloon (free-page reporting, when the guest has the device), each
#: with its dependencies. vsock is left out: this host kind has no vhost-vsock, so the channel
#: is virtio-serial. virtio-pmem is left out: the microvm machine cannot map it (see
#: docs/ARCHITECTURE.md, "Guest memory").
MODULES = (
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "erofs",
    "overlay",
    "virtio_net",
    "virtio_balloon",
)


@dataclass(frozen=True)
class GuestKit:
    kernel: Path
    initrd: Path
    release: str  # the kernel's release, e.g. 6.1.0-57-cloud-amd64
    digest: str  # of kernel + initrd: part of every template's key


def find_kernel(boot: Path = Path("/boot")) -> tuple[Path, str]:
    """The newest Debian cloud kernel installed, and its release."""
    found = sorted(boot.glob(KERNEL_GLOB), key=lambda p: _version_key(p.name))
    if not found:
        raise FailedPrecondition(
            f"no guest kernel: {boot}/{KERNEL_GLOB} is missing (apt install linux-image-cloud-amd64)",
            reason="GUEST_KERNEL_MISSING",
        )
    kernel = found[-1]
    return kernel, kernel.name.removeprefix("vmlinuz-")


def _version_key(name: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", name)]


def module_order(release: str, wanted: tuple[str, ...] = MODULES) -> list[Path]:
    """The .ko files of `wanted` and everything they depend on, dependencies first."""
    root = Path("/lib/modules") / release
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in (root / "modules.dep").read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
        by_name[_module_name(path)] = path
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for dep in deps.get(path, []):
            visit(dep)
        order.append(path)

    for name in wanted:
        if name not in by_name:
            if (root / "modules.builtin").exists() and name in _builtins(root):
                continue
            raise FailedPrecondition(
                f"guest kernel {release} has no module {name}", reason="GUEST_KERNEL_MISSING"
            )
        visit(by_name[name])
    return [root / p for p in order]


def _module_name(path: str) -> str:
    base = os.path.basename(path)
    return re.sub(r"\.ko(\.xz|\.zst|\.gz)?$", "", base).replace("-", "_")


def _builtins(root: Path) -> set[str]:
    return {_module_name(line) for line in (root / "modules.builtin").read_text().split()}


def _module_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if path.name.endswith(".xz"):
        return lzma.decompress(data)
    if path.name.endswith(".gz"):
        return gzip.decompress(data)
    return data


def build_guest(out_dir: Path, boot: Path = Path("/boot")) -> GuestKit:
    """The kernel and the initramfs for it (built if missing). Blocking."""
    kernel, release = find_kernel(boot)
    if not BUSYBOX.exists():
        raise FailedPrecondition(
            f"{BUSYBOX} is missing (apt install busybox-static)", reason="GUEST_KERNEL_MISSING"
        )
    modules = module_order(release)
    files: list[tuple[str, bytes, int]] = [
        ("init", INIT_SCRIPT.read_bytes(), 0o755),
        ("bin/busybox", BUSYBOX.read_bytes(), 0o755),
        ("modules.order", "".join(_module_name(p.name) + "\n" for p in modules).encode(), 0o644),
    ]
    files += [(f"mod/{_module_name(p.name)}.ko", _module_bytes(p), 0o644) for p in modules]
    h = hashlib.sha256(BUILD_FORMAT.encode() + release.encode())
    for name, data, mode in files:
        h.update(f"{name}\0{mode}\0{len(data)}\0".encode())
        h.update(data)
    digest = h.hexdigest()[:24]
    target = out_dir / digest / "initrd.gz"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
            tmp.write(gzip.compress(_cpio(files), compresslevel=6, mtime=0))
        os.replace(tmp.name, target)
    kd = hashlib.sha256(digest.encode() + kernel.read_bytes()).hexdigest()[:24]
    return GuestKit(kernel, target, release, kd)


def remove_stale(out_dir: Path, keep: GuestKit) -> None:
    """Initramfs builds of earlier inputs (kept only while nothing needs them: call at start)."""
    for d in out_dir.glob("*"):
        if d.is_dir() and d != keep.initrd.parent:
            shutil.rmtree(d, ignore_errors=True)


def _cpio(files: list[tuple[str, bytes, int]]) -> bytes:
    """A newc ("070701") archive of `files` and their parent directories, root-owned."""
    out = io.BytesIO()
    ino = 1
    dirs: set[str] = set()

    def entry(name: str, mode: int, data: bytes) -> None:
        nonlocal ino
        raw = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(raw), 0)
        out.write(b"070701" + b"".join(b"%08X" % f for f in fields) + raw)
        out.write(b"\0" * (-(110 + len(raw)) % 4))
        out.write(data)
        out.write(b"\0" * (-len(data) % 4))
        ino += 1

    for name, data, mode in files:
        parts = name.split("/")[:-1]
        for i in range(len(parts)):
            d = "/".join(parts[: i + 1])
            if d not in dirs:
                dirs.add(d)
                entry(d, 0o040755, b"")
        entry(name, 0o100000 | mode, data)
    entry("TRAILER!!!", 0, b"")
    return out.getvalue()
