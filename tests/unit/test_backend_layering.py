"""No backend imports another: a module under edge/backends/<x>/ imports nothing of
edge/backends/<y>/ for another backend folder <y>. What backends share (the contract, warm
pools, memory sampling, channels, QoS) lives beside the contract in edge/backends/, and what
the node shares (layer store, network, toolkit, swap area) in edge/node.py."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ROOT / "edge" / "backends"


def _backend_folders() -> list[str]:
    return sorted(p.name for p in BACKENDS.iterdir() if (p / "backend.py").exists())


def _imported(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (also under TYPE_CHECKING or in a function)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_the_backend_folders_are_found() -> None:
    assert {"container", "microvm"} <= set(_backend_folders())


def test_no_backend_imports_another_backend() -> None:
    folders = _backend_folders()
    bad = []
    for x in folders:
        for path in sorted((BACKENDS / x).rglob("*.py")):
            for module in _imported(path):
                parts = module.split(".")
                if parts[:2] == ["edge", "backends"] and len(parts) > 2:
                    if parts[2] in folders and parts[2] != x:
                        bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, "\n".join(bad)


def test_shared_backend_modules_import_no_backend() -> None:
    """What backends share (edge/backends/*.py) depends on no backend folder; the registry
    names its backends' factories only as strings (imported when an edge builds them)."""
    folders = _backend_folders()
    for path in sorted(BACKENDS.glob("*.py")):
        for module in _imported(path):
            parts = module.split(".")
            assert not (
                parts[:2] == ["edge", "backends"] and len(parts) > 2 and parts[2] in folders
            ), f"{path.relative_to(ROOT)} imports {module}"
