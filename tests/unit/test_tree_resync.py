"""The two-pass copy a container fork uses (edge.layers.tree.precopy / resync): a tree copied
while it changes, then brought up to date, equals the tree; what did not change is not copied
again."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from edge.layers.tree import OPAQUE_XATTR, is_opaque, is_whiteout, make_whiteout, precopy, resync

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts and trusted.* need root")


def listing(root: Path) -> dict[str, tuple[object, ...]]:
    """Every entry below root: type, mode, owner, content or link target, opaque mark."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                body: object = p.read_bytes()
            elif stat.S_ISLNK(st.st_mode):
                body = os.readlink(p)
            else:
                body = is_whiteout(st) or is_opaque(p)
            out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_mode & 0o7777, body)
    return out


@needs_root
def test_resync_brings_a_copy_made_under_changes_up_to_date(tmp_path: Path) -> None:
    src, dst = tmp_path / "upper", tmp_path / "copy"
    (src / "keep" / "deep").mkdir(parents=True)
    (src / "keep" / "deep" / "same.txt").write_text("unchanged")
    (src / "edit.txt").write_text("aaaa")
    (src / "gone.txt").write_text("x")
    (src / "becomes-file").mkdir()
    (src / "becomes-file" / "inner").write_text("y")
    (src / "link").symlink_to("edit.txt")
    (src / "mode.sh").write_text("#!/bin/sh\n")
    make_whiteout(src / "deleted-from-image")

    since = time.time_ns()
    seen = precopy(src, dst)
    os.link(dst / "keep" / "deep" / "same.txt", tmp_path / "held")  # its inode stays taken
    kept_inode = os.lstat(tmp_path / "held").st_ino
    assert listing(dst) == listing(src)

    # the sandbox runs on until it is frozen
    (src / "edit.txt").write_text("bbbb")  # same size: only the ctime tells
    (src / "gone.txt").unlink()
    (src / "new.txt").write_text("new")
    for p in (src / "becomes-file").iterdir():
        p.unlink()
    (src / "becomes-file").rmdir()
    (src / "becomes-file").write_text("now a file")
    os.chmod(src / "mode.sh", 0o755)
    (src / "opaque").mkdir()
    os.setxattr(src / "opaque", OPAQUE_XATTR, b"y")
    (src / "a").write_text("linked")
    os.link(src / "a", src / "b")

    # "pre-copy began later": what the pre-copy saw unchanged is old enough to be kept
    stats = resync(src, dst, seen, since + 10 * 10**9)
    assert listing(dst) == listing(src)
    assert os.lstat(dst / "a").st_ino == os.lstat(dst / "b").st_ino  # still one file
    assert os.lstat(dst / "keep" / "deep" / "same.txt").st_ino == kept_inode  # not copied again
    assert stats.whiteouts == 1


@needs_root
def test_an_entry_changed_just_before_the_precopy_is_copied_again(tmp_path: Path) -> None:
    """ctime is coarse: a change in the tick before the pre-copy is not trusted as old."""
    src, dst = tmp_path / "upper", tmp_path / "copy"
    src.mkdir()
    (src / "f").write_text("1")
    since = time.time_ns()
    seen = precopy(src, dst)
    os.link(dst / "f", tmp_path / "held")  # its inode stays taken
    inode = os.lstat(tmp_path / "held").st_ino
    resync(src, dst, seen, since)
    assert os.lstat(dst / "f").st_ino != inode
    assert (dst / "f").read_text() == "1"
