"""Domain code of the runtime imports no gRPC and no generated protobuf code (STYLE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

EDGE = Path(__file__).resolve().parents[2] / "edge"
FORBIDDEN = ("grpc", "google.protobuf", "dsec")  # dsec = the generated contracts package


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_runtime_and_toolkit_import_no_grpc_or_generated_code() -> None:
    files = [*sorted((EDGE / "runtime").rglob("*.py")), EDGE / "toolkit.py"]
    assert len(files) > 5
    for f in files:
        bad = {n for n in _imports(f) if any(n == p or n.startswith(p + ".") for p in FORBIDDEN)}
        assert not bad, f"{f} imports {bad}"
