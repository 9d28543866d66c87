"""Layering rules as tests: domain modules import no gRPC or generated code,
and the SDK imports no server code (so it can ship alone)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

DOMAIN_MODULES = [
    "iam/domain.py",
    "iam/store.py",
    "iam/store_sqlite.py",
    "iam/store_pg.py",
    "placement/policy.py",
    "watcher/view.py",
    "apiserver/statelog.py",
    "watcher/ledger.py",
    "edge/manager.py",
    "edge/admission.py",
    "edge/drain.py",
    "edge/records.py",
    "edge/reaper.py",
    "edge/model.py",
    "edge/backends/contract.py",
    "edge/display.py",
    "edge/backends/vm/input.py",
    *[str(p.relative_to(ROOT)) for p in sorted((ROOT / "edge" / "runtime").glob("*.py"))],
]
SERVER_PACKAGES = {
    "common",
    "iam",
    "apiserver",
    "placement",
    "watcher",
    "edge",
    "aether",
    "chronus",
    "insandbox",
    "dsecctl",
}


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


@pytest.mark.parametrize("module", DOMAIN_MODULES)
def test_domain_modules_import_no_grpc(module: str) -> None:
    bad = {
        m
        for m in imports(ROOT / module)
        if m == "grpc" or m.startswith(("grpc.", "dsec.", "google.protobuf"))
    }
    assert not bad, f"{module} imports {sorted(bad)}"


def test_sdk_imports_no_server_code() -> None:
    for path in (ROOT / "libdsec").rglob("*.py"):
        bad = {m for m in imports(path) if m.split(".")[0] in SERVER_PACKAGES}
        assert not bad, f"{path} imports {sorted(bad)}"


IN_SANDBOX = ("aether", "chronus", "insandbox")


def test_in_sandbox_agents_use_only_the_standard_library() -> None:
    """aether/chronus run in any image from a minimal toolkit: stdlib + the wire schema only."""
    import sys

    for pkg in IN_SANDBOX:
        for path in (ROOT / pkg).rglob("*.py"):
            for m in imports(path):
                top = m.split(".")[0]
                assert (
                    top in sys.stdlib_module_names or top in IN_SANDBOX or m == "dsec.wire_schema"
                ), f"{path} imports {m}"


# Which in-sandbox packages each one may not import: aether and chronus share their code through
# insandbox, which depends on neither. aether starts chronus by name (`aether.server.ENGINE`).
FORBIDDEN_IN_SANDBOX = {
    "aether": {"chronus"},
    "chronus": {"aether"},
    "insandbox": {"aether", "chronus"},
}


@pytest.mark.parametrize("pkg", sorted(FORBIDDEN_IN_SANDBOX))
def test_aether_and_chronus_do_not_import_each_other(pkg: str) -> None:
    """Every import statement, at module level or inside a function or TYPE_CHECKING block."""
    forbidden = FORBIDDEN_IN_SANDBOX[pkg]
    paths = sorted((ROOT / pkg).rglob("*.py"))
    assert paths, f"no modules under {pkg}/"
    bad = {
        f"{path.relative_to(ROOT)} imports {m}"
        for path in paths
        for m in imports(path)
        if m.split(".")[0] in forbidden
    }
    assert not bad, sorted(bad)


def test_the_layering_check_sees_function_level_imports(tmp_path: Path) -> None:
    """The rule above would be empty if `imports` missed the lazy imports the agents use to keep
    their start cheap (aether used to import chronus.engine inside a method)."""
    module = tmp_path / "m.py"
    module.write_text(
        "def start():\n    from chronus.engine import serve_socket\n    import chronus.proc\n"
    )
    assert imports(module) == {"chronus.engine", "chronus.proc"}


def test_in_sandbox_agents_load_no_heavy_stdlib_modules() -> None:
    """Every module aether and chronus import is paid by every sandbox's start (CPU before its
    first command, memory for its life). These pull in collections/functools/... (~4 ms of CPU
    here) and have C-level stand-ins (`chronus.threads`, `insandbox.poller`, `_queue`,
    `_collections`); a fresh interpreter, as in the sandbox, must not load them."""
    import subprocess
    import sys

    heavy = ["threading", "collections", "selectors", "queue", "functools", "typing"]
    heavy += ["dataclasses", "re", "enum", "signal", "socket", "subprocess", "asyncio"]
    code = (
        "import sys\n"
        "import ctypes, insandbox.security, aether.server, chronus.engine, chronus.httpcall\n"
        f"print(' '.join(m for m in {heavy!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            f"import sys; sys.path.insert(0, {str(ROOT)!r})\n{code}",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == []
