"""The edge's backends, one line each: the table `edge.server` builds every backend from.

A line names the backend (its ``name``, as in ``DSEC_EDGE_*`` settings and ``dsec status``),
where its factory is ("module:attribute", imported only on an edge that builds it: a null edge
never loads runc or QEMU code), and its config section (the ``DSEC_EDGE_<SECTION>_*`` settings
of ``edge.config.EdgeConfig`` it reads, beside the node's). A factory takes the edge's
configuration and the node's services (``edge.node.NodeServices``, built once) and returns a
:class:`Built`: the backend, or None when the node cannot offer it (the controls say why).

At edge start (:func:`build`) a name registered twice, a factory that is not there, a config
section EdgeConfig does not have, and a backend whose declared capabilities do not match its
methods (``contract.check_declared``) are
refused with a :class:`BackendRefused` naming it; the edge exits 2, as for a missing control.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from edge.backends.contract import SandboxBackend, check_declared
from edge.controls import Control

if TYPE_CHECKING:
    from edge.config import EdgeConfig
    from edge.node import NodeServices


@dataclass(frozen=True)
class Registration:
    name: str
    #: "module:attribute" of a Factory (e.g. a backend class's `from_config`).
    factory: str
    #: The EdgeConfig settings it reads beyond the node's: DSEC_EDGE_<SECTION>_* ("" = none).
    section: str


REGISTRY: tuple[Registration, ...] = (
    Registration("container", "edge.backends.container.backend:ContainerBackend.from_config", ""),
    Registration("microvm", "edge.backends.microvm.backend:MicrovmBackend.from_config", "microvm"),
    Registration("vm", "edge.backends.vm.backend:VmBackend.from_config", "vm"),
)


@dataclass(frozen=True)
class Built:
    """What a factory made: the backend (None: not offered on this node) and what to report of
    it in the edge's controls (`dsec status`)."""

    backend: SandboxBackend | None
    controls: tuple[Control, ...] = ()


Factory = Callable[["EdgeConfig", "NodeServices"], Built]


class BackendRefused(RuntimeError):
    """A registered backend the edge refuses to start with (the message names it and why)."""


def check_names(registry: Iterable[Registration]) -> None:
    """Every backend registered once."""
    seen: set[str] = set()
    for reg in registry:
        if reg.name in seen:
            raise BackendRefused(f"backend {reg.name} is registered twice (edge.backends.registry)")
        seen.add(reg.name)


def check_section(reg: Registration) -> None:
    """The config section a line names is the prefix of settings EdgeConfig has."""
    from edge.config import EdgeConfig

    if reg.section and not any(
        f.name == reg.section or f.name.startswith(reg.section + "_")
        for f in dataclasses.fields(EdgeConfig)
    ):
        raise BackendRefused(
            f"backend {reg.name}: its config section {reg.section!r} names no setting of "
            "edge.config.EdgeConfig"
        )


def factory_of(reg: Registration) -> Factory:
    """The registration's factory, imported now."""
    module, _, attr = reg.factory.partition(":")
    try:
        obj: object = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise BackendRefused(
            f"backend {reg.name}: its factory {reg.factory} cannot be loaded: {exc}"
        ) from None
    if not callable(obj):
        raise BackendRefused(f"backend {reg.name}: its factory {reg.factory} is not callable")
    return cast(Factory, obj)


def check_backend(reg: Registration, backend: SandboxBackend) -> None:
    """A built backend is the one registered, implements the contract and every capability it
    declares."""
    if getattr(backend, "name", None) != reg.name:
        raise BackendRefused(
            f"backend {reg.name}: its factory built a backend named "
            f"{getattr(backend, 'name', None)!r}"
        )
    try:
        check_declared(backend)
    except TypeError as exc:
        raise BackendRefused(f"backend {reg.name} refused: {exc}") from None


def build(
    cfg: EdgeConfig, node: NodeServices, registry: Iterable[Registration] | None = None
) -> tuple[list[SandboxBackend], list[Control]]:
    """Every backend of `registry` (default: REGISTRY) this node offers, in order, and their
    controls. Raises BackendRefused (and what a factory raises: ControlMissing, ...)."""
    registry = tuple(REGISTRY if registry is None else registry)
    check_names(registry)
    backends: list[SandboxBackend] = []
    controls: list[Control] = []
    for reg in registry:
        check_section(reg)
        built = factory_of(reg)(cfg, node)
        controls += built.controls
        if built.backend is not None:
            check_backend(reg, built.backend)
            backends.append(built.backend)
    return backends, controls
