"""Which lower-layer files a sandbox changed: the walk of an overlay upper directory."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from edge.runtime.integrity import ModifiedFile, modified_files

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts need mknod (root)")


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_modified_deleted_and_opaque(tmp_path: Path) -> None:
    lower1, lower2, upper = tmp_path / "l1", tmp_path / "l2", tmp_path / "u"
    _tree(lower1, {"bin/bash": "real", "etc/passwd": "root", "opt/tool/a": "1", "opt/tool/b": "2"})
    _tree(lower2, {"usr/bin/diff": "diff", "etc/passwd": "older"})
    _tree(upper, {"bin/bash": "fake", "work/new.py": "mine", "opt/tool/b": "again"})
    (upper / "usr/bin").mkdir(parents=True)
    os.mknod(upper / "usr/bin/diff", stat.S_IFCHR, 0)  # a whiteout: deleted
    (upper / "etc").mkdir()
    os.mknod(upper / "etc/gone", stat.S_IFCHR, 0)  # a whiteout of something no lower has
    os.symlink("/tmp", upper / "etc/passwd")  # a file replaced by a symlink
    os.setxattr(upper / "opt/tool", "trusted.overlay.opaque", b"y")
    got = modified_files(upper, [lower1, lower2])
    assert got == [
        ModifiedFile("/bin/bash", False),
        ModifiedFile("/etc/passwd", False),
        ModifiedFile("/opt/tool/a", True),  # hidden by the opaque directory
        ModifiedFile("/opt/tool/b", False),
        ModifiedFile("/usr/bin/diff", True),
    ]


def test_limit(tmp_path: Path) -> None:
    lower, upper = tmp_path / "l", tmp_path / "u"
    _tree(lower, {f"f{i}": "x" for i in range(10)})
    _tree(upper, {f"f{i}": "y" for i in range(10)})
    assert len(modified_files(upper, [lower], limit=3)) == 3
