"""The layer store as domain code: real mkfs.erofs, real file-backed mounts, tiny trees.

No services, no sockets; every mount a test makes is undone by its fixtures.
"""

from __future__ import annotations

import ast
import os
import shutil
import stat
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge.layers import Environment, Environments, LayerKind, LayerRef, LayerSettings, erofs
from edge.layers.diff import snapshot
from edge.layers.model import canonical_name, stack
from edge.layers.node import settled_stat
from edge.layers.tree import OPAQUE_XATTR, apply_layer, convert_whiteouts, is_whiteout
from edge.runtime import mounts
from libdsec.errors import (
    ImageNotFound,
    InvalidArgument,
    LayerCorrupt,
    LayerNotFound,
    Unavailable,
)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mkfs.erofs") is None,
    reason="needs root and mkfs.erofs (scripts/setup.sh)",
)


@pytest.fixture
def envs(tmp_path: Path) -> Iterator[Environments]:
    e = Environments(
        LayerSettings(
            store_root=tmp_path / "store",
            cache_dir=tmp_path / "cache",
            node_id="t1",
            gc_grace_s=0.0,
            erofs_chunk_size=4096,
        )
    )
    yield e
    for m in mounts.mounts_under(tmp_path):
        mounts.umount_quiet(m.mountpoint)
    e.close()


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[list[Path]]:
    """Mount points to unmount at the end, deepest first."""
    made: list[Path] = []
    yield made
    for p in reversed(made):
        mounts.umount_quiet(p)


def tree(root: Path, files: dict[str, bytes | str | None], mtime: int = 1_000_000) -> Path:
    """A tree: path -> content (None = directory). Every mtime fixed (reproducible)."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, content in sorted(files.items()):
        p = root / rel
        if content is None:
            p.mkdir(parents=True, exist_ok=True)
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(content.encode() if isinstance(content, str) else content)
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for n in dirnames + filenames:
            os.utime(os.path.join(dirpath, n), (mtime, mtime), follow_symlinks=False)
    os.utime(root, (mtime, mtime))
    return root


def overlay(tmp: Path, lowers: list[Path], mounted: list[Path]) -> Path:
    """A read-only overlay of `lowers` (top-most first)."""
    target = tmp / f"ovl-{len(mounted)}"
    target.mkdir()
    mounts.mount(
        "overlay", target, "overlay", mounts.MS_RDONLY, "lowerdir=" + ":".join(map(str, lowers))
    )
    mounted.append(target)
    return target


def mount_layer(envs: Environments, digest: str, tmp: Path, mounted: list[Path]) -> Path:
    image = envs.node.prepare(digest)
    target = tmp / f"layer-{len(mounted)}"
    target.mkdir()
    mounts.mount(image.image, target, "erofs", mounts.MS_RDONLY, f"device={image.blob}")
    mounted.append(target)
    return target


# ---------------------------------------------------------------- names and stacking


def test_names_are_canonical_and_validated() -> None:
    assert canonical_name("busybox") == "busybox:latest"
    assert canonical_name("swe-bench/django:v2") == "swe-bench/django:v2"
    assert canonical_name("a/b") == "a/b:latest"
    for bad in ("", "UPPER", "../x", "a/../b", "a:b:c/d", "a b"):
        with pytest.raises(InvalidArgument):
            canonical_name(bad)


def test_toolkits_go_below_diffs_and_duplicates_keep_the_top_place() -> None:
    b, w, t1, t2, d = (
        LayerRef(f"sha256:{c * 64}", k)
        for c, k in zip(
            "abcde",
            [
                LayerKind.BASE,
                LayerKind.WORKSPACE,
                LayerKind.TOOLKIT,
                LayerKind.TOOLKIT,
                LayerKind.DIFF,
            ],
            strict=True,
        )
    )
    assert stack([b, w, t1, d], [t2]) == [b, w, t1, t2, d]
    assert stack([b, t1], [t1]) == [b, t1]
    assert stack([b, d], []) == [b, d]


# ------------------------------------------------------------------------- builds


def test_builds_are_reproducible_and_keep_mtimes(tmp_path: Path) -> None:
    files = {"a/x.py": "print(1)\n", "a/big": os.urandom(300_000), "b": None, "c.txt": "c"}
    t1 = tree(tmp_path / "t1", files)
    t2 = tree(tmp_path / "t2", dict(reversed(list(files.items()))))  # created in another order
    d1 = erofs.build(t1, tmp_path / "o1", erofs_chunk_size=4096)
    time.sleep(1.1)  # mkfs.erofs stamps its build time: it must not matter
    d2 = erofs.build(t2, tmp_path / "o2", erofs_chunk_size=4096)
    assert d1.digest == d2.digest
    assert (tmp_path / "o1" / "meta.erofs").read_bytes() == (
        tmp_path / "o2" / "meta.erofs"
    ).read_bytes()
    target = tmp_path / "m"
    target.mkdir()
    mounts.mount(
        tmp_path / "o1" / "meta.erofs",
        target,
        "erofs",
        mounts.MS_RDONLY,
        f"device={tmp_path / 'o1' / 'data.blob'}",
    )
    try:
        assert os.stat(target / "a" / "x.py").st_mtime == 1_000_000
        assert (target / "a" / "big").read_bytes() == files["a/big"]
    finally:
        mounts.umount_quiet(target)


def test_directory_import_is_idempotent_and_deduplicated(
    envs: Environments, tmp_path: Path
) -> None:
    src = tree(tmp_path / "ws", {"repo/main.py": "x = 1\n", "repo/data": os.urandom(50_000)})
    e1 = envs.import_source(f"dir:{src}", "ws:v1")
    e2 = envs.import_source(f"dir:{src}", "ws:v2")
    assert e1.layers == e2.layers
    assert len(envs.list_layers()) == 1
    assert {e.name for e in envs.list_environments()} == {"ws:v1", "ws:v2"}


# ------------------------------------------------------------ whiteouts and opaque dirs


def _tar(path: Path, members: dict[str, bytes | None]) -> Path:
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.mtime = 1_000_000
            if data is None:
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tf.addfile(info)
            else:
                info.size = len(data)
                info.mode = 0o644
                import io

                tf.addfile(info, io.BytesIO(data))
    return path


def test_oci_whiteouts_become_overlay_whiteouts(
    envs: Environments, tmp_path: Path, mounted: list[Path]
) -> None:
    lower = _tar(
        tmp_path / "l1.tar",
        {"etc/": None, "etc/gone": b"1", "etc/kept": b"2", "opq/": None, "opq/old": b"3"},
    )
    upper = _tar(
        tmp_path / "l2.tar",
        {"etc/": None, "etc/.wh.gone": b"", "opq/": None, "opq/.wh..wh..opq": b"", "opq/new": b"4"},
    )
    base = envs.import_source(f"tar:{lower}", "wh:base")
    top = envs.import_source(f"tar:{upper}", "wh:top", base="wh:base", kind=LayerKind.BASE)
    assert len(top.layers) == 2 and top.layers[0] == base.layers[0]
    raw = mount_layer(envs, top.layers[1].digest, tmp_path, mounted)
    assert is_whiteout(os.lstat(raw / "etc" / "gone"))
    assert os.getxattr(raw / "opq", OPAQUE_XATTR) == b"y"
    assert not (raw / "etc" / ".wh.gone").exists()
    l1 = mount_layer(envs, top.layers[0].digest, tmp_path, mounted)
    merged = overlay(tmp_path, [raw, l1], mounted)
    assert sorted(os.listdir(merged / "etc")) == ["kept"]
    assert sorted(os.listdir(merged / "opq")) == ["new"]


def test_convert_whiteouts_in_place(tmp_path: Path) -> None:
    t = tree(tmp_path / "t", {"d/.wh.x": "", "d/.wh..wh..opq": "", "d/y": "y"})
    before = os.lstat(t / "d").st_mtime_ns
    assert convert_whiteouts(t) == 2
    assert is_whiteout(os.lstat(t / "d" / "x"))
    assert os.getxattr(t / "d", OPAQUE_XATTR) == b"y"
    assert os.lstat(t / "d").st_mtime_ns == before  # reproducible: the directory's mtime kept


# ----------------------------------------------------------------- verification


def test_corrupt_or_truncated_blobs_are_never_mounted(envs: Environments, tmp_path: Path) -> None:
    src = tree(tmp_path / "src", {"f": os.urandom(64 * 1024)})
    env = envs.import_source(f"dir:{src}", "v:1")
    digest = env.layers[0].digest
    envs.node.prepare(digest)  # fine as imported
    blob = envs.store.blob_path(digest)
    data = bytearray(blob.read_bytes())
    data[40_000] ^= 0xFF
    blob.write_bytes(bytes(data))  # a flipped byte: the blob changed, so it is checked again
    with pytest.raises(LayerCorrupt) as err:
        envs.resolve("v:1")
    assert err.value.metadata["layer"] == digest and "corrupt" in err.value.message
    with open(blob, "r+b") as f:
        f.truncate(4096)
    with pytest.raises(LayerCorrupt) as err:
        envs.node.prepare(digest)
    assert "truncated" in err.value.message


def test_corrupt_metadata_is_rejected(envs: Environments, tmp_path: Path) -> None:
    env = envs.import_source(f"dir:{tree(tmp_path / 's', {'f': 'x'})}", "m:1")
    digest = env.layers[0].digest
    shutil.rmtree(envs.node.meta_dir)
    envs.node.meta_dir.mkdir()
    meta = envs.store.meta_path(digest)
    raw = bytearray(meta.read_bytes())
    raw[2000] ^= 1
    meta.write_bytes(bytes(raw))
    with pytest.raises(LayerCorrupt, match="metadata image"):
        envs.node.prepare(digest)


def test_missing_layer_and_unknown_name(envs: Environments, tmp_path: Path) -> None:
    env = envs.import_source(f"dir:{tree(tmp_path / 's', {'f': 'x'})}", "gone:1")
    digest = env.layers[0].digest
    shutil.rmtree(envs.store.layer_dir(digest))
    with pytest.raises(LayerNotFound) as err:
        envs.resolve("gone:1")
    assert err.value.metadata["layer"] == digest and digest in err.value.message
    assert err.value.metadata["environment"] == "gone:1"
    with pytest.raises(ImageNotFound):
        envs.resolve("never-imported")


def test_unreachable_store_fails_fast(envs: Environments, tmp_path: Path) -> None:
    envs.import_source(f"dir:{tree(tmp_path / 's', {'f': 'x'})}", "u:1")
    os.rename(envs.store.root, tmp_path / "moved")
    try:
        start = time.monotonic()
        with pytest.raises(Unavailable) as err:
            envs.resolve("u:1")
        assert err.value.reason == "STORE_UNAVAILABLE"
        assert time.monotonic() - start < 1.0
        assert envs.maintain() is None  # maintenance skips, it never recreates the store
        assert not envs.store.root.exists()
    finally:
        os.rename(tmp_path / "moved", envs.store.root)


# ------------------------------------------------------------------------- pack


def test_snapshot_leaves_residue_out(tmp_path: Path) -> None:
    upper = tree(
        tmp_path / "upper",
        {
            "work/answer.txt": "42",
            "tmp/scratch": "x",
            "root/.cache/pip/wheel": "w",
            "root/.bash_history": "cat /answers",
            "var/cache/apt/archives/x.deb": "deb",
            ".dsec": None,
            "proc": None,
            "etc/app.conf": "conf",
        },
    )
    os.mknod(upper / "etc" / "deleted", stat.S_IFCHR, os.makedev(0, 0))
    os.setxattr(upper / "work", "trusted.overlay.origin", b"\x00fh")
    os.setxattr(upper / "etc", OPAQUE_XATTR, b"y")
    stats = snapshot(
        upper, tmp_path / "out", exclude=["/etc/app.conf"], mountpoints=["/proc", "/etc/hosts"]
    )
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["etc", "work"]  # /root had only residue, /proc is runc's
    assert (out / "work" / "answer.txt").read_text() == "42"
    assert is_whiteout(os.lstat(out / "etc" / "deleted"))
    assert os.getxattr(out / "etc", OPAQUE_XATTR) == b"y"
    assert "trusted.overlay.origin" not in os.listxattr(out / "work")
    assert "/tmp" in stats.excluded and "/etc/app.conf" in stats.excluded
    with pytest.raises(InvalidArgument):
        snapshot(upper, tmp_path / "out2", exclude=["relative/path"])


def test_pack_diff_chains_on_the_sandbox_layers(envs: Environments, tmp_path: Path) -> None:
    base = envs.import_source(f"dir:{tree(tmp_path / 'b', {'etc/os': 'base'})}", "base:1")
    upper = tree(tmp_path / "upper", {"work/out": "result", "tmp/x": "residue"})
    r = envs.pack_diff(
        upper=upper, layers=list(base.layers), config={}, name="packed:1", source="pack_diff:test"
    )
    assert [x.kind for x in r.environment.layers] == [LayerKind.BASE, LayerKind.DIFF]
    assert r.layer is not None and r.stats.files == 1
    empty = tree(tmp_path / "empty", {"tmp/x": "only residue"})
    r2 = envs.pack_diff(
        upper=empty, layers=list(r.environment.layers), config={}, name="packed:2", source="t"
    )
    assert r2.layer is None and r2.environment.layers == r.environment.layers


# ------------------------------------------------------------------------ collapse


def test_collapse_matches_the_overlay_view(
    envs: Environments, tmp_path: Path, mounted: list[Path]
) -> None:
    base = envs.import_source(
        f"dir:{tree(tmp_path / 'l0', {'keep': '0', 'gone': '0', 'dir/a': '0', 'over': '0', 'big': os.urandom(200_000)})}",
        "c:0",
    )
    l1 = _tar(tmp_path / "l1.tar", {"dir/": None, "dir/b": b"1", "over": b"1", "new1": b"1"})
    l2 = _tar(
        tmp_path / "l2.tar",
        {".wh.gone": b"", "dir/": None, "dir/.wh..wh..opq": b"", "dir/c": b"2", "new2": b"2"},
    )
    envs.import_source(f"tar:{l1}", "c:1", base="c:0", kind=LayerKind.BASE)
    e2 = envs.import_source(f"tar:{l2}", "c:2", base="c:1", kind=LayerKind.BASE)
    assert len(e2.layers) == 3

    def view(env: Environment) -> dict[str, str]:
        lowers = [mount_layer(envs, r.digest, tmp_path, mounted) for r in reversed(env.layers)]
        root = overlay(tmp_path, lowers, mounted) if len(lowers) > 1 else lowers[0]
        out = {}
        for dirpath, _, files in os.walk(root):
            for f in files:
                if f == "big":  # only there to make the base too big to collapse
                    continue
                p = os.path.join(dirpath, f)
                out[os.path.relpath(p, root)] = Path(p).read_bytes().decode(errors="replace")
        return out

    before = view(e2)
    # the two upper layers collapse (they are small); the base is kept apart: it is too big
    merged = envs.collapse(
        "c:2",
        threshold_bytes=max(envs.store.layer_info(r.digest).size_bytes for r in e2.layers[1:]) + 1,
        new_name="c:flat",
    )
    assert len(merged.layers) == 2 and merged.layers[0] == base.layers[0]
    assert (
        view(merged) == before == {"keep": "0", "dir/c": "2", "over": "1", "new1": "1", "new2": "2"}
    )
    everything = envs.collapse("c:2", threshold_bytes=1 << 30, new_name="c:one")
    assert len(everything.layers) == 1 and view(everything) == before


def test_apply_layer_keeps_whiteouts_for_layers_below(tmp_path: Path) -> None:
    dst = tree(tmp_path / "dst", {"a": "1"})
    src = tree(tmp_path / "src", {})
    os.mknod(src / "b", stat.S_IFCHR, os.makedev(0, 0))
    apply_layer(src, dst, keep_whiteouts=True)
    assert is_whiteout(os.lstat(dst / "b"))


# ----------------------------------------------------------------- gc and recovery


def test_gc_removes_unreferenced_layers_after_the_grace_period(
    envs: Environments, tmp_path: Path
) -> None:
    keep = envs.import_source(f"dir:{tree(tmp_path / 'k', {'f': 'keep'})}", "keep:1")
    drop = envs.import_source(f"dir:{tree(tmp_path / 'd', {'f': 'drop'})}", "drop:1")
    leased = envs.import_source(f"dir:{tree(tmp_path / 'l', {'f': 'leased'})}", "leased:1")
    envs.store.delete_environment("drop:1")
    envs.store.delete_environment("leased:1")
    envs.store.set_leases([])
    (envs.store.leases_dir / "other-node").mkdir()
    (envs.store.leases_dir / "other-node" / leased.layers[0].digest.removeprefix("sha256:")).touch()
    first = envs.store.gc(grace_s=3600)
    assert first.marked == [drop.layers[0].digest] and not first.removed_layers
    assert envs.store.has_layer(drop.layers[0].digest)
    second = envs.store.gc(grace_s=0)
    assert second.removed_layers == [drop.layers[0].digest]
    assert not envs.store.has_layer(drop.layers[0].digest)
    assert envs.store.has_layer(keep.layers[0].digest) and envs.store.has_layer(
        leased.layers[0].digest
    )
    assert envs.node.gc_local() == [drop.layers[0].digest]


@pytest.mark.parametrize("mode", ["file", "loop"])
def test_a_mounted_layer_is_leased_however_it_is_mounted(
    envs: Environments, tmp_path: Path, mounted: list[Path], mode: str
) -> None:
    """The node's leases (what GC must keep) come from the mount table: a layer mounted from
    its file (kernel 6.12) or through a loop device (older kernels: the table names the
    device, whose backing file is the layer's) is in use either way."""
    env = envs.import_source(f"dir:{tree(tmp_path / 's', {'f': 'x'})}", f"lease-{mode}:1")
    digest = env.layers[0].digest
    assert digest not in envs.node.mounted_digests()
    image = envs.node.prepare(digest)
    target = tmp_path / "leased"
    target.mkdir()
    assert mounts.set_erofs_mode(mode) == mode
    try:
        mounts.mount_erofs(image.image, target, mounts.MS_NODEV, image.blob)
    finally:
        mounts.set_erofs_mode("auto")
    mounted.append(target)
    (info,) = [m for m in mounts.read_mountinfo() if m.mountpoint == str(target)]
    assert info.source.startswith("/dev/loop") == (mode == "loop")
    assert (target / "f").read_text() == "x"
    assert digest in envs.node.mounted_digests()
    assert digest in envs.node.refresh_leases()


def test_recover_removes_crash_leftovers(envs: Environments, tmp_path: Path) -> None:
    env = envs.import_source(f"dir:{tree(tmp_path / 's', {'f': 'x'})}", "r:1")
    (envs.node.scratch("docker") / "half-unpacked").mkdir()
    staging = envs.store.staging("build")
    other = envs.store.tmp_dir / "othernode-1-build-abc"
    other.mkdir()
    stray = envs.node.mnt_dir / "stray"
    stray.mkdir()
    image = envs.node.prepare(env.layers[0].digest)
    mounts.mount(image.image, stray, "erofs", mounts.MS_RDONLY, f"device={image.blob}")
    removed = envs.recover()
    assert any(r.startswith("mount:") for r in removed)
    assert not mounts.mounts_under(envs.node.mnt_dir)
    assert not any(envs.node.tmp_dir.iterdir()) and not any(envs.node.mnt_dir.iterdir())
    assert not staging.exists() and other.exists()  # another node's staging is not ours


def test_domain_modules_import_no_grpc() -> None:
    for path in (ROOT / "edge" / "layers").glob("*.py"):
        mods: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods.add(node.module)
        bad = {
            m for m in mods if m == "grpc" or m.startswith(("grpc.", "dsec.", "google.protobuf"))
        }
        assert not bad, f"{path} imports {sorted(bad)}"


def test_tool_cli_lists_a_store(envs: Environments, tmp_path: Path) -> None:
    envs.import_source(f"dir:{tree(tmp_path / 's', {'f': 'x'})}", "cli:1")
    r = subprocess.run(
        [
            os.sys.executable,  # type: ignore[attr-defined]
            "-m",
            "edge.layers",
            "--store",
            str(envs.store.root),
            "--cache",
            str(tmp_path / "toolcache"),
            "list",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "cli:1" in r.stdout


def test_sampled_verification_quarantines_in_the_background(tmp_path: Path) -> None:
    e = Environments(
        LayerSettings(
            store_root=tmp_path / "store",
            cache_dir=tmp_path / "cache",
            node_id="s1",
            verify="sampled",
        )
    )
    try:
        e.node.sample_chunks = 0  # first and last chunk only: the middle one goes unchecked
        src = tree(tmp_path / "src", {"big": os.urandom(12 << 20)})
        env = e.import_source(f"dir:{src}", "sampled:1")
        digest = env.layers[0].digest
        blob = e.store.blob_path(digest)
        with open(blob, "r+b") as f:
            f.seek(6 << 20)
            f.write(b"\0" * 16)
        e.resolve("sampled:1")  # size and the sampled chunks pass: start time stays flat
        assert e.node.verify_pending() == [digest]
        with pytest.raises(LayerCorrupt, match="quarantined"):
            e.resolve("sampled:1")
    finally:
        e.close()


def test_store_verification_hashes_a_blob_once_per_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify="store": the importing node records its hash in the store; another node that
    finds the record matching the blob mounts without reading the data; a rewritten blob is
    hashed again (and refused when corrupt)."""
    import edge.layers.node as node_mod

    def node(name: str) -> Environments:
        return Environments(
            LayerSettings(
                store_root=tmp_path / "store",
                cache_dir=tmp_path / f"cache-{name}",
                node_id=name,
                verify="store",
            )
        )

    hashed: list[str] = []
    real_check = node_mod.check_blob

    def counting(digest: str, *args: object, **kw: object) -> None:
        hashed.append(digest)
        real_check(digest, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(node_mod, "check_blob", counting)
    a, b, c = node("a"), node("b"), node("c")
    try:
        src = tree(tmp_path / "src", {"big": os.urandom(6 << 20)})
        digest = a.import_source(f"dir:{src}", "store:1").layers[0].digest
        assert (a.store.layer_dir(digest) / "verified.json").is_file()
        b.resolve("store:1")
        assert hashed == []  # node b read none of the blob
        # Rewritten in place (same size): its ctime changes, so node c hashes it and refuses.
        blob = a.store.blob_path(digest)
        with open(blob, "r+b") as f:
            f.seek(3 << 20)
            f.write(b"\0" * 16)
        with pytest.raises(LayerCorrupt):
            c.resolve("store:1")
        assert hashed == [digest]
    finally:
        for e in (a, b, c):
            e.close()


def test_a_lock_file_create_racing_another_node_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MooseFS answered EEXIST to an O_CREAT open (no O_EXCL) racing another node's create."""
    from edge.layers import service

    real_open = os.open
    calls = []

    def racing_open(path: object, flags: int, mode: int = 0o777) -> int:
        calls.append(path)
        if len(calls) == 1:
            real_open(path, flags, mode)  # the other node's create lands first ...
            raise FileExistsError(17, "File exists")  # ... and ours reports EEXIST
        return real_open(path, flags, mode)

    monkeypatch.setattr(service.os, "open", racing_open)
    fd = service._open_lock_file(tmp_path / ".lock-x")
    try:
        assert len(calls) == 2 and (tmp_path / ".lock-x").exists()
    finally:
        os.close(fd)


def test_a_blob_just_written_is_recorded_with_whole_second_times(tmp_path: Path) -> None:
    """What the writer records is what another node of a shared store reads back (MooseFS keeps
    whole seconds; the writer's own view had a later second)."""
    blob = tmp_path / "blob"
    blob.write_bytes(b"x" * 4096)
    os.utime(blob, ns=(1_796_522_485_700_000_000, 1_796_522_485_700_000_000))
    st = settled_stat(blob)
    assert st.st_mtime_ns == 1_796_522_485_000_000_000
    again = os.stat(blob)
    assert (again.st_mtime_ns, again.st_ctime_ns, again.st_ino) == (
        st.st_mtime_ns,
        st.st_ctime_ns,
        st.st_ino,
    )
