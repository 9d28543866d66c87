"""Style and types as tests: ruff (lint + format) and mypy on our code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_ruff_lint() -> None:
    r = run("ruff", "check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format() -> None:
    r = run("ruff", "format", "--check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy() -> None:
    r = run("mypy")
    assert r.returncode == 0, r.stdout + r.stderr


def _mark_name(decorator: ast.expr) -> str | None:
    """ "skipif" for @pytest.mark.skipif(...) or @pytest.mark.skipif; None for anything else."""
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "pytest"
    ):
        return node.attr
    return None


def test_marks_decorate_tests_only() -> None:
    """A mark on anything but a test (a helper, a fixture) has no effect: pytest skips nothing,
    silently (a skipif on a helper once left its test to fail where the feature is missing).
    And every skipif says why."""
    wrong = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            is_test = node.name.startswith("Test" if isinstance(node, ast.ClassDef) else "test")
            for decorator in node.decorator_list:
                mark = _mark_name(decorator)
                where = f"{path.relative_to(ROOT)}:{decorator.lineno} @pytest.mark.{mark}"
                if mark is not None and not is_test:
                    wrong.append(f"{where} on {node.name}, not a test")
                if mark == "skipif" and not (
                    isinstance(decorator, ast.Call)
                    and any(k.arg == "reason" for k in decorator.keywords)
                ):
                    wrong.append(f"{where} on {node.name} gives no reason")
    assert not wrong, "\n".join(wrong)
