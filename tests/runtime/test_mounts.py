"""mount(2) helpers, shared EROFS layer mounts and overlays, on the real kernel."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edge.runtime import (
    LayerError,
    LayerImage,
    LayerMounts,
    MountError,
    OverlayOptionsTooLongError,
    disk,
    mounts,
)
from edge.runtime.errors import SandboxRuntimeError
from edge.runtime.mounts import (
    MOUNT_DATA_MAX,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RDONLY,
    is_mountpoint,
    mount,
    mount_overlay,
    mounts_under,
    overlay_options,
    read_mountinfo,
    umount_quiet,
    unmount_overlay,
)


@pytest.fixture
def layers(tmp_path: Path) -> Iterator[LayerMounts]:
    lm = LayerMounts(tmp_path / "layers")
    yield lm
    for m in mounts_under(tmp_path):
        umount_quiet(m.mountpoint)


@pytest.fixture
def image(tmp_path: Path, erofs_image: Callable[..., Path]) -> Path:
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "motd").write_text("hello layer\n")
    return erofs_image(src, tmp_path / "a.erofs")


def test_file_backed_erofs_without_loop_device(layers: LayerMounts, image: Path) -> None:
    mp = layers.acquire(image, "sb-1:0")
    info = [m for m in read_mountinfo() if m.mountpoint == str(mp)]
    assert len(info) == 1
    assert info[0].fstype == "erofs" and info[0].source == str(image.resolve())
    assert not info[0].source.startswith("/dev/loop")
    assert (mp / "etc" / "motd").read_text() == "hello layer\n"
    with pytest.raises(OSError, match="Read-only"):
        (mp / "new").write_text("x")


def test_refcount_by_holder(layers: LayerMounts, image: Path) -> None:
    a = layers.acquire(image, "a:0")
    b = layers.acquire(image, "b:0")
    assert a == b and len(mounts_under(layers.root)) == 1
    assert layers.release(image, "a:0") is False  # b still holds it
    assert layers.release(image, "a:0") is False  # double release is a no-op
    assert is_mountpoint(a)
    assert layers.release(image, "b:0") is True
    assert not is_mountpoint(a) and not a.exists()
    assert layers.holders() == {}


def test_directory_layer_is_used_as_is(layers: LayerMounts, tmp_path: Path) -> None:
    assert layers.acquire(tmp_path, "a:0") == tmp_path
    assert layers.release(tmp_path, "a:0") is False
    assert mounts_under(layers.root) == []


def test_recover_from_mountinfo_and_claims(
    layers: LayerMounts, image: Path, tmp_path: Path
) -> None:
    mp = layers.acquire(image, "a:0")
    layers.acquire(image, "b:0")
    # a new process: nothing in memory, the mount is still there
    fresh = LayerMounts(layers.root)
    got = fresh.recover({"a:0": [image], "c:0": [tmp_path / "never-mounted.erofs"]})
    assert got == {mp.name: {"a:0"}}  # b has no record any more; c's image was never mounted
    assert fresh.release(image, "c:0") is False
    assert fresh.release(image, "a:0") is True
    assert not is_mountpoint(mp)


def test_unmount_unused_after_recovery(layers: LayerMounts, image: Path) -> None:
    mp = layers.acquire(image, "gone:0")
    fresh = LayerMounts(layers.root)
    fresh.recover({})
    assert fresh.unmount_unused() == [mp]
    assert mounts_under(layers.root) == [] and list(layers.root.iterdir()) == []


def chunked_image(tmp_path: Path, erofs_image: Callable[..., Path]) -> tuple[Path, Path, bytes]:
    """A chunked EROFS image (metadata only) and its blob: (image, blob, the file's bytes)."""
    src = tmp_path / "chunked-src"
    src.mkdir()
    payload = bytes(range(256)) * 64
    (src / "data.bin").write_bytes(payload)
    blob = tmp_path / "data.blob"
    meta = erofs_image(src, tmp_path / "meta.erofs", "--chunksize=4096", f"--blobdev={blob}")
    return meta, blob, payload


def test_chunked_image_with_blob(
    layers: LayerMounts, tmp_path: Path, erofs_image: Callable[..., Path]
) -> None:
    meta, blob, payload = chunked_image(tmp_path, erofs_image)
    mp = layers.acquire(LayerImage(meta, blob), "a:0")
    assert (mp / "data.bin").read_bytes() == payload
    assert layers.mountpoint(LayerImage(meta, blob)) != layers.mountpoint(LayerImage(meta))


@pytest.fixture
def loop_mode() -> Iterator[None]:
    """EROFS mounted as on a kernel older than 6.12: through read-only loop devices."""
    assert mounts.set_erofs_mode("loop") == "loop"
    try:
        yield
    finally:
        mounts.set_erofs_mode("auto")


def _loop_bound(device: str) -> bool:
    return Path(f"/sys/block/{device.removeprefix('/dev/')}/loop/backing_file").exists()


def test_loop_mode_mounts_layers_on_read_only_loop_devices_the_unmount_frees(
    layers: LayerMounts,
    image: Path,
    tmp_path: Path,
    erofs_image: Callable[..., Path],
    loop_mode: None,
) -> None:
    """Before 6.12 (no file-backed EROFS) each image, and each chunk blob, goes on a loop device
    of its own: read-only, autoclear (freed by the unmount, or by a failed mount), and the
    mount table still names the image file behind it (the node's layer leases read it)."""
    mp = layers.acquire(image, "a:0")
    (info,) = [m for m in read_mountinfo() if m.mountpoint == str(mp)]
    assert info.fstype == "erofs" and info.source.startswith("/dev/loop")
    device = info.source
    assert mounts.erofs_backing(device) == str(image.resolve())
    assert Path(f"/sys/block/{device[5:]}/ro").read_text().strip() == "1"
    assert (mp / "etc" / "motd").read_text() == "hello layer\n"
    with pytest.raises(OSError, match="Read-only"):
        (mp / "new").write_text("x")
    meta, blob, payload = chunked_image(tmp_path, erofs_image)
    chunked = layers.acquire(LayerImage(meta, blob), "a:0")
    assert (chunked / "data.bin").read_bytes() == payload
    (cinfo,) = [m for m in read_mountinfo() if m.mountpoint == str(chunked)]
    blob_device = next(
        f"/dev/{d.name}"
        for d in Path("/sys/block").glob("loop*")
        if mounts.erofs_backing(f"/dev/{d.name}") == str(blob.resolve())
    )
    assert layers.release(image, "a:0") and layers.release(LayerImage(meta, blob), "a:0")
    assert not _loop_bound(device) and not _loop_bound(cinfo.source)
    assert not _loop_bound(blob_device)
    junk = tmp_path / "junk.erofs"
    junk.write_bytes(b"\0" * 8192)
    before = {d.name for d in Path("/sys/block").glob("loop*") if _loop_bound(d.name)}
    with pytest.raises(MountError):
        layers.acquire(junk, "a:0")
    after = {d.name for d in Path("/sys/block").glob("loop*") if _loop_bound(d.name)}
    assert after <= before  # the failed mount's device was freed too


def test_missing_image_and_bad_mount_errors(layers: LayerMounts, tmp_path: Path) -> None:
    with pytest.raises(LayerError):
        layers.acquire(tmp_path / "missing.erofs", "a:0")
    not_erofs = tmp_path / "junk.erofs"
    not_erofs.write_bytes(b"\0" * 8192)
    with pytest.raises(MountError) as info:
        layers.acquire(not_erofs, "a:0")
    assert info.value.errno == errno.EINVAL and info.value.fstype == "erofs"
    assert list(layers.root.iterdir()) == []  # the failed mountpoint was removed
    with pytest.raises(MountError) as info2:
        mount("none", tmp_path / "no-such-dir", "tmpfs")
    assert info2.value.errno == errno.ENOENT


def test_overlay_mount_and_unmount(layers: LayerMounts, image: Path, tmp_path: Path) -> None:
    top = tmp_path / "top"
    top.mkdir()
    (top / "top.txt").write_text("top\n")
    upper, work, target = tmp_path / "upper", tmp_path / "work", tmp_path / "merged"
    for d in (upper, work, target):
        d.mkdir()
    mount_overlay([top, layers.acquire(image, "a:0")], upper, work, target)
    assert (target / "top.txt").read_text() == "top\n"
    assert (target / "etc" / "motd").read_text() == "hello layer\n"
    (target / "etc" / "motd").write_text("changed\n")
    assert (upper / "etc" / "motd").read_text() == "changed\n"
    assert unmount_overlay(target) is True
    assert unmount_overlay(target) is False  # idempotent
    assert not is_mountpoint(target)


def test_overlay_option_limits(tmp_path: Path) -> None:
    many = [tmp_path / f"layer-{i:04d}-{'x' * 40}" for i in range(100)]
    with pytest.raises(OverlayOptionsTooLongError) as info:
        overlay_options(many, tmp_path / "u", tmp_path / "w")
    assert info.value.limit == MOUNT_DATA_MAX and info.value.layers == 100
    assert len(overlay_options(many[:10], tmp_path / "u", tmp_path / "w")) < MOUNT_DATA_MAX
    with pytest.raises(LayerError, match="contains"):
        overlay_options([tmp_path / "a:b"], tmp_path / "u", tmp_path / "w")
    with pytest.raises(LayerError, match="at least one"):
        overlay_options([], tmp_path / "u", tmp_path / "w")


def test_mount_error_is_an_oserror() -> None:
    exc = MountError(errno.EBUSY, "umount", "/x")
    assert isinstance(exc, OSError) and exc.errno == errno.EBUSY
    assert "EBUSY" in str(exc)


def test_util_linux_not_involved(layers: LayerMounts, image: Path) -> None:
    layers.acquire(image, "a:0")
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    assert str(image) not in out


def test_a_guest_s_disk_copy_is_repaired_then_mounted_read_only(tmp_path: Path) -> None:
    """What a microVM's pack_diff does with the copy of a guest's writable disk (disk.py):
    e2fsck repairs what a copy taken mid-write leaves wrong, the mount is read-only, and a
    disk that is not a filesystem at all is refused before the kernel mounts it."""
    img, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    mnt.mkdir()
    disk.blank_image(img, 64, tmp_path / "templates")
    disk.mount_image(img, mnt, 0)
    try:
        (mnt / "upper").mkdir()
        (mnt / "upper" / "new.txt").write_text("written by the guest\n")
    finally:
        umount_quiet(mnt)
    disk.repair(img)  # the free counts, which ext4 without a journal updates lazily
    assert disk.repair(img) == ""  # clean now
    disk.mount_image(img, mnt, MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    try:
        assert (mnt / "upper" / "new.txt").read_text() == "written by the guest\n"
        with pytest.raises(OSError) as err:
            (mnt / "upper" / "more.txt").write_text("x")
        assert err.value.errno == errno.EROFS
    finally:
        umount_quiet(mnt)
    with open(img, "r+b") as f:  # its only superblock (one block group: no backup) zeroed
        f.seek(1024)
        f.write(b"\0" * 1024)
    with pytest.raises(SandboxRuntimeError, match="e2fsck could not repair"):
        disk.repair(img)
