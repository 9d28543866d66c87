"""The committed generated code matches the .proto files (regenerated here)."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen-protos.sh"), str(tmp_path)],
        check=True,
        env=env,
        capture_output=True,
    )
    generated = ("dsec", "compat/e2b/envd/gen")
    fresh = sorted(
        p.relative_to(tmp_path) for d in generated for p in (tmp_path / d).rglob("*") if p.is_file()
    )
    committed = sorted(
        p.relative_to(ROOT)
        for d in generated
        for p in (ROOT / d).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert fresh == committed, "run scripts/gen-protos.sh"
    stale = [str(p) for p in fresh if not filecmp.cmp(tmp_path / p, ROOT / p, shallow=False)]
    assert not stale, f"stale generated files (run scripts/gen-protos.sh): {stale}"
