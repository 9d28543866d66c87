"""Calls into a sandbox, forwarded from one table built from the contracts.

The API server and the edge pass most calls into a sandbox (exec, sessions, HTTP, ports, files,
watchers) on unchanged: the API server to the sandbox's owning edge, the edge to chronus over
the sandbox's channel. Which methods those are, and whether each is unary or streams, is in the
contracts (the methods whose request is a ``dsec.types.v1`` message); so the table is built from
the service descriptors once, at import, and :func:`install` gives the servicer class one
method per route. A servicer supplies the hop itself as up to four methods, one per call
shape::

    async def forward_unary(self, route, request, context) -> Message
    def forward_server_stream(self, route, request, context) -> AsyncIterator[Message]
    async def forward_client_stream(self, route, requests, context) -> Message
    def forward_bidi_stream(self, route, requests, context) -> AsyncIterator[Message]

What differs per method and is only metadata (the next hop's name for the call, a deadline
read from the request) is in its :class:`Route`. A method that does more than forward is
written by hand on the class and is left out of the table (``skip``). The methods are
ordinary attributes of the class, so ``common.grpc_server`` registers them as any other
(the error mapping, malformed-request answer, reflection and health are unchanged), and
nothing is looked up per call.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message

from libdsec.errors import InvalidArgument

#: The package of the messages a sandbox call carries (its request names the sandbox).
SANDBOX_PACKAGE = "dsec.types.v1"

#: The call metadata naming the caller's principal, sent by the API server with every call it
#: passes to an edge (the edge's operation log records who called).
PRINCIPAL_METADATA = "dsec-principal"

#: A deadline read from a request, in seconds (e.g. an exec's timeout plus a margin).
Deadline = Callable[[Any], float]


@dataclass(frozen=True, slots=True)
class Route:
    """One forwarded method: its contract name, the next hop's name for it, its call shape,
    and its metadata."""

    method: str
    target: str
    request_name: str  # the request message's name, e.g. "UploadFileRequest"
    client_streaming: bool
    server_streaming: bool
    deadline: Deadline | None = None
    #: A client stream's opening field: the member of the first message's oneof (``oneof``)
    #: that names the sandbox (``start`` of ExecInput's ``input``, ``header`` of
    #: UploadFileRequest's ``part``).
    opener: str = ""
    oneof: str = ""


def snake_case(name: str) -> str:
    """``ListExecs`` -> ``list_execs``: chronus's names for the calls."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _opener(method: MethodDescriptor) -> tuple[str, str]:
    """The oneof member of a client stream's request that carries the sandbox id, and its
    oneof's name."""
    if not method.client_streaming:
        return "", ""
    for field in method.input_type.fields:
        if (
            field.containing_oneof is not None
            and field.message_type is not None
            and "sandbox_id" in field.message_type.fields_by_name
        ):
            return str(field.name), str(field.containing_oneof.name)
    raise TypeError(f"{method.full_name}: no opening message names the sandbox")


def routes(
    service: ServiceDescriptor,
    *,
    skip: Collection[str] = (),
    target: Callable[[str], str] = str,
    deadlines: Mapping[str, Deadline] | None = None,
) -> dict[str, Route]:
    """The forwarded methods of ``service`` by name: its sandbox calls (requests of
    :data:`SANDBOX_PACKAGE`) but those in ``skip``; ``target`` names each for the next hop;
    ``deadlines`` gives a method its deadline. A name in ``skip`` or ``deadlines`` that the
    service lacks is refused (a typo would silently forward, or silently lose a deadline)."""
    deadlines = dict(deadlines or {})
    methods = {m.name: m for m in service.methods}
    unknown = (set(skip) | set(deadlines)) - methods.keys()
    if unknown:
        raise ValueError(f"{service.full_name} has no method {sorted(unknown)}")
    out: dict[str, Route] = {}
    for name, m in methods.items():
        if name in skip or m.input_type.file.package != SANDBOX_PACKAGE:
            continue
        opener, oneof = _opener(m)
        out[name] = Route(
            method=name,
            target=target(name),
            request_name=m.input_type.name,
            client_streaming=m.client_streaming,
            server_streaming=m.server_streaming,
            deadline=deadlines.pop(name, None),
            opener=opener,
            oneof=oneof,
        )
    if deadlines:
        raise ValueError(f"{service.full_name}: deadlines for skipped methods {sorted(deadlines)}")
    return out


async def opened(route: Route, requests: AsyncIterator[Any]) -> tuple[str, AsyncIterator[Any]]:
    """A client stream's sandbox, read from its first message (which must carry
    ``route.opener``; InvalidArgument otherwise), and the whole stream to pass on, that first
    message put back in front."""
    first = await anext(requests, None)
    if first is None or first.WhichOneof(route.oneof) != route.opener:
        raise InvalidArgument(f"the first {route.request_name} must carry `{route.opener}`")

    async def whole() -> AsyncIterator[Any]:
        yield first
        async for item in requests:
            yield item

    return getattr(first, route.opener).sandbox_id, whole()


def _method(cls: type, route: Route) -> Callable[..., Any]:
    """The servicer method for ``route``: a call of the class's hop for its call shape."""
    hook = {
        (False, False): "forward_unary",
        (False, True): "forward_server_stream",
        (True, False): "forward_client_stream",
        (True, True): "forward_bidi_stream",
    }[(route.client_streaming, route.server_streaming)]
    hop = getattr(cls, hook, None)  # bound once: no lookup per call
    if not callable(hop):
        raise TypeError(f"{cls.__name__} forwards {route.method} but has no {hook}")
    if route.server_streaming:
        # An async generator, as the gRPC boundary requires of a streaming method.
        async def stream(self: Any, request: Any, context: Any) -> AsyncIterator[Message]:
            async for item in hop(self, route, request, context):
                yield item

        method: Callable[..., Any] = stream
    else:

        async def unary(self: Any, request: Any, context: Any) -> Message:
            result: Message = await hop(self, route, request, context)
            return result

        method = unary
    method.__name__ = method.__qualname__ = route.method
    method.__doc__ = f"Forwards {route.method} (to {route.target!r}): see common/forwarding.py."
    return method


def install(cls: type, table: Mapping[str, Route]) -> None:
    """Gives ``cls`` one method per route of ``table``; a method ``cls`` defines by hand
    already is a mistake in the table (it would be shadowed), refused at import."""
    for name, route in table.items():
        if name in vars(cls):
            raise TypeError(f"{cls.__name__}.{name} is written by hand: skip it in its table")
        setattr(cls, name, _method(cls, route))
