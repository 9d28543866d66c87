"""The SDK's public surface: every public name importable where users import it, and the
sync client offering what the async one does."""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "libdsec": [
        "AsyncClient",
        "AsyncDisplay",
        "Display",
        "AsyncFiles",
        "AsyncProcess",
        "AsyncSandbox",
        "AsyncSession",
        "AsyncWatch",
        "Client",
        "DSecError",
        "Files",
        "Process",
        "Sandbox",
        "Session",
        "Watch",
        "SandboxInfo",
        "NetworkPolicy",
        "Quota",
        "TaskResult",
        "TaskSandboxResult",
        "TaskEdgeError",
    ],
    "libdsec.aio": [
        "AsyncClient",
        "AsyncDisplay",
        "AsyncFiles",
        "AsyncProcess",
        "AsyncSandbox",
        "AsyncSession",
        "AsyncWatch",
        "CHANNEL_OPTIONS",
        "CHUNK",
        "DEFAULT_TIMEOUT_S",
        "STREAM_IDLE_TIMEOUT_S",
        "ExitStatus",
        "make_spec",
    ],
    "libdsec.sync": ["Client", "Display", "Files", "Process", "Sandbox", "Session", "Watch"],
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


def test_watch_takes_the_same_keywords_in_both_clients() -> None:
    import inspect

    from libdsec import AsyncClient, Client

    sync = inspect.signature(Client.watch).parameters
    aio = inspect.signature(AsyncClient.watch).parameters
    assert [(p.name, p.kind, p.default) for p in sync.values()] == [
        (p.name, p.kind, p.default) for p in aio.values()
    ]
    assert list(sync)[1:4] == ["task_id", "labels", "timeout"]


@pytest.mark.parametrize("method", ["pause_task", "resume_task", "stop_task"])
def test_task_operations_take_the_same_arguments_in_both_clients(method: str) -> None:
    import inspect

    from libdsec import AsyncClient, Client

    sync = inspect.signature(getattr(Client, method)).parameters
    aio = inspect.signature(getattr(AsyncClient, method)).parameters
    assert [(p.name, p.kind, p.default) for p in sync.values()] == [
        (p.name, p.kind, p.default) for p in aio.values()
    ]
    assert list(sync)[1] == "task_id"
