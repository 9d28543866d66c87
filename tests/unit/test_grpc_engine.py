"""common/grpc_engine.py: every gRPC service's entry point picks gRPC's I/O engine before
grpc loads, and an operator's own GRPC_EXPERIMENTS wins."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ["apiserver", "edge", "iam", "placement", "watcher"]


@pytest.mark.parametrize("service", SERVICES)
def test_entry_point_imports_it_first(service: str) -> None:
    tree = ast.parse((ROOT / service / "__main__.py").read_text())
    imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    first = imports[0]
    assert isinstance(first, ast.Import) and first.names[0].name == "common.grpc_engine", service


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_sets_the_experiments_before_grpc_loads() -> None:
    r = _run("import os, common.grpc_engine, grpc; print(os.environ['GRPC_EXPERIMENTS'])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["-event_engine_client,-event_engine_listener"]


def test_the_operators_value_wins() -> None:
    r = _run(
        "import os, common.grpc_engine; print(repr(os.environ['GRPC_EXPERIMENTS']))",
        GRPC_EXPERIMENTS="",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "''"


def test_says_so_when_it_comes_after_grpc() -> None:
    r = _run("import os, grpc, common.grpc_engine; print(os.environ.get('GRPC_EXPERIMENTS'))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "None"
    assert "imported after grpc" in r.stderr
