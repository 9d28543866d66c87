"""The SDK's public surface: every public name importable where users import it, and the
sync client offering what the async one does."""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "libdsec": [
        "AsyncClient",
        "AsyncFiles",
        "AsyncProcess",
        "AsyncSandbox",
        "AsyncSession",
        "Client",
        "DSecError",
        "Files",
        "Process",
        "Sandbox",
        "Session",
        "SandboxInfo",
        "NetworkPolicy",
        "Quota",
    ],
    "libdsec.aio": [
        "AsyncClient",
        "AsyncFiles",
        "AsyncProcess",
        "AsyncSandbox",
        "AsyncSession",
        "CHANNEL_OPTIONS",
        "CHUNK",
        "DEFAULT_TIMEOUT_S",
        "STREAM_IDLE_TIMEOUT_S",
        "ExitStatus",
        "make_spec",
    ],
    "libdsec.sync": ["Client", "Files", "Process", "Sandbox", "Session"],
    "libdsec.errors": [
        "DSecError",
        "from_rpc_error",
        "status_for",
        "code_number",
        "error_trailer",
        "error_class_for",
    ],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_import_where_they_always_did(module: str) -> None:
    m = importlib.import_module(module)
    missing = [n for n in PUBLIC[module] if not hasattr(m, n)]
    assert not missing, f"{module} lacks {missing}"
    assert set(PUBLIC[module]) <= set(m.__all__)


def test_one_class_per_name_across_import_paths() -> None:
    import libdsec
    import libdsec.aio
    import libdsec.sync

    assert libdsec.AsyncSandbox is libdsec.aio.AsyncSandbox
    assert libdsec.Client is libdsec.sync.Client
