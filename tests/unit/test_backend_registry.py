"""The backend registry (edge/backends/registry.py): a backend registered twice, or one whose
declared capabilities do not match its methods, is refused at edge start with a message naming
it (edge exits 2, like a missing control); the real registry's lines all load."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from edge import server
from edge.backends import Capability, NullBackend, registry
from edge.backends.registry import REGISTRY, BackendRefused, Built, Registration
from edge.config import EdgeConfig
from edge.controls import Control


class _Liar(NullBackend):
    """Declares pause, implements none of it."""

    name = "liar"
    capabilities = frozenset({Capability.PAUSE})


def make_null(cfg: EdgeConfig, node: Any) -> Built:
    return Built(NullBackend(), (Control("null", "enforced", "starts nothing", status_line=True),))


def make_liar(cfg: EdgeConfig, node: Any) -> Built:
    return Built(_Liar())


def make_absent(cfg: EdgeConfig, node: Any) -> Built:
    return Built(None, (Control("absent", "absent", "not on this node"),))


HERE = __name__
NULL = Registration("null", f"{HERE}:make_null", "")
LIAR = Registration("liar", f"{HERE}:make_liar", "")
ABSENT = Registration("absent", f"{HERE}:make_absent", "")
NODE: Any = SimpleNamespace(disk_guard=None)  # the factories above need no node service


def test_backends_are_built_in_registry_order_with_their_controls() -> None:
    backends, controls = registry.build(EdgeConfig(), NODE, [NULL, ABSENT])
    assert [b.name for b in backends] == ["null"]  # absent offers no backend, only its control
    assert [c.name for c in controls] == ["null", "absent"]
    assert controls[0].status_line and not controls[1].status_line


def test_a_backend_registered_twice_is_refused_by_name() -> None:
    twice = [NULL, ABSENT, Registration("null", f"{HERE}:make_null", "other")]
    with pytest.raises(BackendRefused, match="backend null is registered twice"):
        registry.build(EdgeConfig(), NODE, twice)


def test_a_backend_declaring_a_capability_it_lacks_is_refused_by_name() -> None:
    with pytest.raises(BackendRefused) as info:
        registry.build(EdgeConfig(), NODE, [NULL, LIAR])
    assert str(info.value) == (
        "backend liar refused: backend liar declares pause but does not implement Pausable"
    )


def test_a_factory_that_cannot_be_loaded_or_builds_another_backend_is_refused() -> None:
    missing = Registration("ghost", f"{HERE}:no_such_factory", "")
    with pytest.raises(BackendRefused, match=r"backend ghost: its factory .* cannot be loaded"):
        registry.build(EdgeConfig(), NODE, [missing])
    renamed = Registration("other", f"{HERE}:make_null", "")
    with pytest.raises(BackendRefused, match=r"backend other: its factory built .*'null'"):
        registry.build(EdgeConfig(), NODE, [renamed])


def test_a_config_section_the_edge_config_lacks_is_refused() -> None:
    unknown = Registration("null", f"{HERE}:make_null", "hypervisor")
    with pytest.raises(BackendRefused, match="backend null: its config section 'hypervisor'"):
        registry.build(EdgeConfig(), NODE, [unknown])


def test_the_registry_lines_load_and_name_distinct_backends() -> None:
    registry.check_names(REGISTRY)
    for reg in REGISTRY:
        registry.check_section(reg)
        assert callable(registry.factory_of(reg)), reg.name


def test_the_edge_exits_2_naming_a_refused_backend(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the edge's own start (server.main): refused like a missing control."""
    monkeypatch.setenv("DSEC_EDGE_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("DSEC_EDGE_EDGE_ID", "refused")
    monkeypatch.setattr(server, "setup_logging", lambda *a, **kw: None)
    monkeypatch.setattr(server, "setup_tracing", lambda *a, **kw: None)
    monkeypatch.setattr(server, "check_controls", lambda cfg: [])
    monkeypatch.setattr(server.NodeServices, "build", classmethod(lambda cls, cfg: NODE))
    monkeypatch.setattr(registry, "REGISTRY", (NULL, LIAR))
    with caplog.at_level(logging.CRITICAL), pytest.raises(SystemExit) as exited:
        asyncio.run(server.main())
    assert exited.value.code == 2
    assert "edge refused cannot start: backend liar refused" in caplog.text
