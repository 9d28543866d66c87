"""Spans for the steps of one operation (where a create's milliseconds go).

The gRPC spans (common/telemetry.py) show each call between services; these show what one
service does inside a call: the edge's create is ``edge.container.prepare`` ->
``edge.runc.layers`` -> ... -> ``edge.aether.hello``. They are made only inside a recorded
trace, so they cost one lookup of the current span otherwise, and they need only
OpenTelemetry's API (the runtime uses them without the services' telemetry setup).
``bench/bench_create_profile.py`` reads them back into a table; docs/ARCHITECTURE.md has it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry import trace

_SCOPE = "dsec.steps"


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """One step as a child of the current span (and current itself while it runs). Works
    across ``asyncio.to_thread``, which copies the context into the thread."""
    if not trace.get_current_span().is_recording():
        yield
        return
    with trace.get_tracer(_SCOPE).start_as_current_span(name):
        yield


class Phases:
    """Consecutive steps as sibling spans under the current span: ``next(name)`` ends the step
    under way and starts the next; leaving the ``with`` ends the last. For straight-line code
    where nesting each step in a ``with`` would not read (the runtime's create)::

        with Phases() as ph:
            ph.next("edge.runc.layers")
            ...
            ph.next("edge.runc.run")
    """

    def __init__(self) -> None:
        self._on = trace.get_current_span().is_recording()
        self._span: trace.Span | None = None

    def next(self, name: str) -> None:
        if not self._on:
            return
        if self._span is not None:
            self._span.end()
        self._span = trace.get_tracer(_SCOPE).start_span(name)

    def __enter__(self) -> Phases:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._span is not None:
            self._span.end()
            self._span = None
