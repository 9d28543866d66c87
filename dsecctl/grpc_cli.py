"""``dsec grpc``: a grpcurl for dsec's services, over their gRPC server reflection.

    dsec grpc list                                     the API server's services
    dsec grpc 127.0.0.1:7102 list dsec.placement.v1.PlacementService      its methods
    dsec grpc describe dsec.apiserver.v1.WatchSandboxesRequest
    dsec grpc dsec.apiserver.v1.ProjectService/WhoAmI
    dsec grpc 127.0.0.1:7102 grpc.health.v1.Health/Check -d '{"service": "dsec.placement.v1.ClusterView"}'
    echo '{"keepaliveIntervalMs": 1000}' | dsec grpc dsec.apiserver.v1.SandboxService/WatchSandboxes -d @

ADDRESS is host:port or unix:/path; without it, the API server of $DSEC_TARGET or of the
local cluster ($DSEC_HOME/cluster.json). The request is JSON (proto3 JSON mapping: field
names in lowerCamelCase or as in the .proto); each response is printed as one JSON document,
so a server stream prints one per message. Unary and server-streaming methods only.

Every call carries "authorization: Bearer <token>" (the token of $DSEC_TOKEN or
$DSEC_HOME/token, as the SDK finds it) unless --no-auth or an -H authorization header is given.

Exit status (grpcurl's): 0 OK; 64 + the gRPC status code when the call fails (Unauthenticated
80, NotFound 69, DeadlineExceeded 68...), its code, message and dsec reason on stderr; 1 when
the address cannot be reached or a service, method or symbol is not there; 2 for bad usage or
a request that is not valid JSON for the method's request message.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import collections
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.descriptor import (
    Descriptor,
    EnumDescriptor,
    MethodDescriptor,
    ServiceDescriptor,
)
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from dsec.types.v1 import types_pb2
from dsecctl.cli_common import run_command
from libdsec._config import resolve
from libdsec.errors import ERROR_TRAILER, DSecError

#: grpcurl's offset for a failed call's exit status (64 + code), so that gRPC's CANCELLED (1)
#: and UNKNOWN (2) are not confused with the tool's own failures.
STATUS_EXIT_OFFSET = 64
#: Connecting and reflection, and a unary call, get this deadline unless --timeout says otherwise.
DEFAULT_TIMEOUT_S = 10.0
VERBS = ("list", "describe")
#: What the API server accepts; also our responses (file downloads come in chunks below this).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
USAGE = "dsec grpc [flags] [ADDRESS] (list [SERVICE] | describe [SYMBOL] | METHOD)"
EPILOG = "ADDRESS is host:port or unix:/path (default: the local cluster's API server)."


class _Failure(Exception):
    """Ends the command: ``message`` on stderr, exit status ``status``."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


# ------------------------------------------------------------------ arguments


def _add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-d",
        "--data",
        default=None,
        metavar="JSON",
        help="the request as a JSON object ('@': read it from stdin); default: an empty request",
    )
    p.add_argument(
        "-H",
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="extra metadata for every request, reflection included (repeatable; a NAME "
        "ending in -bin takes a base64 VALUE); an authorization header replaces the token",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help=f"deadline in seconds for connecting, for reflection and for the call (default: "
        f"{DEFAULT_TIMEOUT_S:g}, except a server stream, which runs until the server ends it "
        f"or Ctrl-C; 0: no deadline for the call)",
    )
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="send no authorization header (by default: the token of $DSEC_TOKEN or "
        "$DSEC_HOME/token)",
    )


def add_parser(sub: Any) -> None:
    """Adds ``grpc`` to the ``dsec`` command's subparsers."""
    p = sub.add_parser(
        "grpc",
        help="list, describe and call the services' gRPC methods (a grpcurl over reflection)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=USAGE,
        epilog=EPILOG,
    )
    _add_flags(p)
    # The words (and flags mixed among them) are parsed again in cmd_grpc: argparse cannot
    # take an optional ADDRESS before a verb, nor flags between positionals, on its own.
    p.add_argument(
        "words",
        nargs=argparse.REMAINDER,
        metavar="...",
        help="[ADDRESS] then 'list [SERVICE]', 'describe [SYMBOL]' or a METHOD "
        "(pkg.Service/Method or pkg.Service.Method)",
    )
    p.set_defaults(fn=cmd_grpc)


def _words_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsec grpc",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=USAGE,
        epilog=EPILOG,
    )
    _add_flags(p)
    p.add_argument("words", nargs="*", metavar="WORD", help="[ADDRESS] then a verb or METHOD")
    return p


def _split_words(words: Sequence[str]) -> tuple[str | None, str, str | None]:
    """``(address or None, "list" | "describe" | "call", symbol or None)``. The first word is
    the address when it is not a verb and either has a colon (host:port, unix:...) or more
    words follow it (a method name never has a colon, and is the last word)."""
    rest = list(words)
    address = None
    if rest and rest[0] not in VERBS and (":" in rest[0] or len(rest) > 1):
        address = rest.pop(0)
    if not rest:
        raise _Failure("dsec grpc: give 'list', 'describe' or a METHOD (see --help)", 2)
    verb = rest.pop(0)
    symbol: str | None
    if verb in VERBS:
        symbol = rest.pop(0) if rest else None
    else:
        verb, symbol = "call", verb
    if rest:
        raise _Failure(f"dsec grpc: unexpected arguments: {' '.join(rest)}", 2)
    return address, verb, symbol


def _metadata(headers: Sequence[str]) -> list[tuple[str, str | bytes]]:
    md: list[tuple[str, str | bytes]] = []
    for header in headers:
        name, colon, value = header.partition(":")
        name, value = name.strip().lower(), value.strip()
        if not colon or not name:
            raise _Failure(f"dsec grpc: a header is 'NAME: VALUE', not {header!r}", 2)
        if name.endswith("-bin"):
            try:
                md.append((name, base64.b64decode(value, validate=True)))
            except binascii.Error as exc:
                raise _Failure(f"dsec grpc: header {name}: not base64 ({exc})", 2) from None
        else:
            md.append((name, value))
    return md


# ------------------------------------------------------------------ connection


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _ReflectionDefaults(grpc.StreamStreamClientInterceptor):  # type: ignore[misc]
    """Gives the reflection calls (which grpc_reflection makes without either) our headers
    and a deadline, so a server that stops answering cannot hang the command."""

    def __init__(self, metadata: list[tuple[str, str | bytes]], timeout_s: float) -> None:
        self.metadata = metadata
        self.timeout_s = timeout_s

    def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        d = client_call_details
        details = _CallDetails(
            d.method,
            d.timeout if d.timeout is not None else self.timeout_s,
            [*(d.metadata or []), *self.metadata],
            d.credentials,
            d.wait_for_ready,
            d.compression,
        )
        return continuation(details, request_iterator)


def _connect(address: str, timeout_s: float) -> grpc.Channel:
    if address.startswith("unix:"):
        path = address.removeprefix("unix:")
        path = "/" + path.lstrip("/") if path.startswith("//") else path
        if not Path(path).exists():
            raise _Failure(f"dsec grpc: cannot reach {address}: no socket at {path}", 1)
    channel = grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise _Failure(
            f"dsec grpc: cannot reach {address}: not connected within {timeout_s:g} s "
            f"(is the service running? `dsec status` shows the local cluster's)",
            1,
        ) from None
    return channel


class _Reflection:
    """The server's services and their descriptors, fetched as they are needed."""

    def __init__(self, channel: grpc.Channel, address: str) -> None:
        self.address = address
        self.db = ProtoReflectionDescriptorDatabase(channel)
        self.pool = descriptor_pool.DescriptorPool(self.db)
        self._services: list[str] | None = None

    def services(self) -> list[str]:
        if self._services is not None:
            return self._services
        try:
            self._services = sorted(self.db.get_services())
            return self._services
        except grpc.RpcError as exc:
            raise _Failure(
                f"dsec grpc: cannot list the services of {self.address} over reflection: "
                f"{_code_name(exc)}: {_details(exc)}",
                1,
            ) from None

    def _find(self, kind: str, name: str) -> Any:
        try:
            return getattr(self.pool, f"Find{kind}ByName")(name)
        except KeyError:
            return None
        except grpc.RpcError as exc:
            raise _Failure(
                f"dsec grpc: reflection on {self.address} failed looking up {name}: "
                f"{_code_name(exc)}: {_details(exc)}",
                1,
            ) from None

    def service(self, name: str) -> ServiceDescriptor:
        found = self._find("Service", name) if name in self.services() else None
        if found is None:
            listing = "".join(f"\n  {s}" for s in self.services())
            raise _Failure(
                f"dsec grpc: {self.address} has no service {name!r}; its services:{listing}", 1
            )
        return found  # type: ignore[no-any-return]

    def method(self, name: str) -> MethodDescriptor:
        """``pkg.Service/Method``, ``pkg.Service.Method`` (or with a leading ``/``)."""
        name = name.lstrip("/")
        if "/" in name:
            service_name, _, method_name = name.partition("/")
        else:
            service_name, _, method_name = name.rpartition(".")
        if not service_name or not method_name:
            raise _Failure(
                f"dsec grpc: {name!r} is not a method: give pkg.Service/Method "
                f"(`dsec grpc list` shows the services)",
                1,
            )
        service = self.service(service_name)
        method = service.methods_by_name.get(method_name)
        if method is None:
            listing = "".join(f"\n  {service.full_name}.{m.name}" for m in service.methods)
            raise _Failure(
                f"dsec grpc: service {service.full_name} has no method {method_name!r}; "
                f"its methods:{listing}",
                1,
            )
        return method

    def symbol(self, name: str) -> tuple[str, Any]:
        """``(what it is, descriptor)`` for a service, method, message or enum."""
        name = name.lstrip(".")
        for kind, what in (
            ("Service", "a service"),
            ("MessageType", "a message"),
            ("EnumType", "an enum"),
        ):
            found = self._find(kind, name)
            if found is not None:
                return what, found
        # Reflection finds a service, not its methods, by name.
        service_name, _, method_name = name.replace("/", ".").rpartition(".")
        service = self._find("Service", service_name) if service_name else None
        if service is not None and method_name in service.methods_by_name:
            return "a method", service.methods_by_name[method_name]
        listing = "".join(f"\n  {s}" for s in self.services())
        raise _Failure(
            f"dsec grpc: {self.address} has no service, method, message or enum {name!r}; "
            f"its services:{listing}",
            1,
        )


# ------------------------------------------------------------------ describe

_SCALARS = {
    descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE: "double",
    descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT: "float",
    descriptor_pb2.FieldDescriptorProto.TYPE_INT64: "int64",
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT64: "uint64",
    descriptor_pb2.FieldDescriptorProto.TYPE_INT32: "int32",
    descriptor_pb2.FieldDescriptorProto.TYPE_FIXED64: "fixed64",
    descriptor_pb2.FieldDescriptorProto.TYPE_FIXED32: "fixed32",
    descriptor_pb2.FieldDescriptorProto.TYPE_BOOL: "bool",
    descriptor_pb2.FieldDescriptorProto.TYPE_STRING: "string",
    descriptor_pb2.FieldDescriptorProto.TYPE_BYTES: "bytes",
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT32: "uint32",
    descriptor_pb2.FieldDescriptorProto.TYPE_SFIXED32: "sfixed32",
    descriptor_pb2.FieldDescriptorProto.TYPE_SFIXED64: "sfixed64",
    descriptor_pb2.FieldDescriptorProto.TYPE_SINT32: "sint32",
    descriptor_pb2.FieldDescriptorProto.TYPE_SINT64: "sint64",
}


def _rpc_text(m: descriptor_pb2.MethodDescriptorProto) -> str:
    req = ("stream " if m.client_streaming else "") + m.input_type
    resp = ("stream " if m.server_streaming else "") + m.output_type
    return f"rpc {m.name} ( {req} ) returns ( {resp} );"


def _service_text(service: ServiceDescriptor) -> str:
    proto = descriptor_pb2.ServiceDescriptorProto()
    service.CopyToProto(proto)
    return "\n".join(
        [f"service {proto.name} {{", *(f"  {_rpc_text(m)}" for m in proto.method), "}"]
    )


def _method_text(method: MethodDescriptor) -> str:
    proto = descriptor_pb2.ServiceDescriptorProto()
    method.containing_service.CopyToProto(proto)
    return _rpc_text(next(m for m in proto.method if m.name == method.name))


def _enum_lines(proto: descriptor_pb2.EnumDescriptorProto, indent: str) -> list[str]:
    return [
        f"{indent}enum {proto.name} {{",
        *(f"{indent}  {v.name} = {v.number};" for v in proto.value),
        f"{indent}}}",
    ]


def _field_type(
    field: descriptor_pb2.FieldDescriptorProto, entries: dict[str, descriptor_pb2.DescriptorProto]
) -> str:
    if field.type in (field.TYPE_MESSAGE, field.TYPE_ENUM, field.TYPE_GROUP):
        entry = entries.get(field.type_name.rsplit(".", 1)[-1])
        if entry is not None and field.label == field.LABEL_REPEATED:
            key, value = entry.field[0], entry.field[1]
            return f"map<{_field_type(key, {})}, {_field_type(value, {})}>"
        return field.type_name
    return _SCALARS[field.type]


def _message_lines(proto: descriptor_pb2.DescriptorProto, proto3: bool, indent: str) -> list[str]:
    entries = {n.name: n for n in proto.nested_type if n.options.map_entry}
    synthetic = {f.oneof_index for f in proto.field if f.proto3_optional}
    lines = [f"{indent}message {proto.name} {{"]
    open_oneof: int | None = None
    for f in proto.field:
        in_oneof = f.HasField("oneof_index") and f.oneof_index not in synthetic
        if open_oneof is not None and (not in_oneof or f.oneof_index != open_oneof):
            lines.append(f"{indent}  }}")
            open_oneof = None
        if in_oneof and open_oneof is None:
            open_oneof = f.oneof_index
            lines.append(f"{indent}  oneof {proto.oneof_decl[f.oneof_index].name} {{")
        type_text = _field_type(f, entries)
        label = ""
        if not type_text.startswith("map<") and f.label == f.LABEL_REPEATED:
            label = "repeated "
        elif f.label == f.LABEL_REQUIRED:
            label = "required "
        elif f.proto3_optional or (not proto3 and not in_oneof):
            label = "optional "
        pad = "    " if open_oneof is not None else "  "
        lines.append(f"{indent}{pad}{label}{type_text} {f.name} = {f.number};")
    if open_oneof is not None:
        lines.append(f"{indent}  }}")
    if proto.reserved_range:
        ranges = [
            str(r.start) if r.end - r.start == 1 else f"{r.start} to {r.end - 1}"
            for r in proto.reserved_range
        ]
        lines.append(f"{indent}  reserved {', '.join(ranges)};")
    if proto.reserved_name:
        lines.append(f"{indent}  reserved {', '.join(repr(n) for n in proto.reserved_name)};")
    for e in proto.enum_type:
        lines += _enum_lines(e, indent + "  ")
    for n in proto.nested_type:
        if not n.options.map_entry:
            lines += _message_lines(n, proto3, indent + "  ")
    lines.append(f"{indent}}}")
    return lines


def describe_text(descriptor: Any) -> str:
    """A service, method, message or enum descriptor as .proto-like text (as grpcurl shows it:
    type names fully qualified, with a leading dot)."""
    if isinstance(descriptor, ServiceDescriptor):
        return _service_text(descriptor)
    if isinstance(descriptor, MethodDescriptor):
        return _method_text(descriptor)
    if isinstance(descriptor, EnumDescriptor):
        enum_proto = descriptor_pb2.EnumDescriptorProto()
        descriptor.CopyToProto(enum_proto)
        return "\n".join(_enum_lines(enum_proto, ""))
    if isinstance(descriptor, Descriptor):
        message_proto = descriptor_pb2.DescriptorProto()
        descriptor.CopyToProto(message_proto)
        file_proto = descriptor_pb2.FileDescriptorProto()
        descriptor.file.CopyToProto(file_proto)
        return "\n".join(_message_lines(message_proto, file_proto.syntax == "proto3", ""))
    raise TypeError(f"cannot describe {descriptor!r}")


# ------------------------------------------------------------------ errors


def _code_name(exc: grpc.RpcError) -> str:
    """grpcurl's (Go's) name of the status code: NotFound, Unauthenticated, Canceled."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    if code == grpc.StatusCode.CANCELLED:
        return "Canceled"
    return "".join(word.capitalize() for word in code.name.split("_"))


def _details(exc: grpc.RpcError) -> str:
    return (exc.details() if hasattr(exc, "details") else None) or str(exc)


def _error_info(exc: grpc.RpcError) -> types_pb2.ErrorInfo | None:
    """The reason and metadata a dsec server put in its error trailer (None: no trailer, as
    when the deadline passed on our side, or a foreign one)."""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == ERROR_TRAILER:
            try:
                return types_pb2.ErrorInfo.FromString(value)
            except Exception:  # corrupt: the code and message still say what happened
                return None
    return None


def _status_exit(exc: grpc.RpcError, token_missing: bool) -> int:
    """Prints a failed call as grpcurl does (plus dsec's reason) and returns its exit status."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    lines = ["ERROR:", f"  Code: {_code_name(exc)}", f"  Message: {_details(exc)}"]
    info = _error_info(exc)
    if info is not None and info.reason:
        lines.append(f"  Reason: {info.reason}")
    if info is not None and info.metadata:
        lines.append("  Metadata: " + ", ".join(f"{k}={v}" for k, v in info.metadata.items()))
    if code == grpc.StatusCode.UNAUTHENTICATED and token_missing:
        lines.append("(no token found: set DSEC_TOKEN, or start a local cluster with `dsec up`)")
    print("\n".join(lines), file=sys.stderr)
    return STATUS_EXIT_OFFSET + int(code.value[0])


# ------------------------------------------------------------------ the command


def _request(method: MethodDescriptor, data: str | None, pool: Any) -> Any:
    text = sys.stdin.read() if data == "@" else data
    request = message_factory.GetMessageClass(method.input_type)()
    if text is None or not text.strip():
        return request
    try:
        json_format.Parse(text, request, descriptor_pool=pool)
    except json_format.ParseError as exc:
        raise _Failure(
            f"dsec grpc: the request is not a valid {method.input_type.full_name} in JSON: {exc}",
            2,
        ) from None
    return request


def _print_message(message: Any, pool: Any) -> None:
    print(json_format.MessageToJson(message, descriptor_pool=pool, indent=2), flush=True)


def _call(
    channel: grpc.Channel,
    reflection: _Reflection,
    method: MethodDescriptor,
    request: Any,
    metadata: list[tuple[str, str | bytes]],
    timeout_s: float | None,
    token_missing: bool,
) -> int:
    if method.client_streaming:
        kind = "bidirectional" if method.server_streaming else "client-streaming"
        raise _Failure(
            f"dsec grpc: {method.full_name} is {kind}; dsec grpc calls unary and "
            f"server-streaming methods only",
            1,
        )
    path = f"/{method.containing_service.full_name}/{method.name}"
    response_class = message_factory.GetMessageClass(method.output_type)
    kwargs: dict[str, Any] = {
        "request_serializer": lambda m: m.SerializeToString(),
        "response_deserializer": response_class.FromString,
    }
    if not method.server_streaming:
        try:
            response = channel.unary_unary(path, **kwargs)(
                request, metadata=metadata, timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return _status_exit(exc, token_missing)
        _print_message(response, reflection.pool)
        return 0
    responses: Iterator[Any] = channel.unary_stream(path, **kwargs)(
        request, metadata=metadata, timeout=timeout_s
    )
    try:
        for response in responses:
            _print_message(response, reflection.pool)
    except grpc.RpcError as exc:
        return _status_exit(exc, token_missing)
    except KeyboardInterrupt:
        responses.cancel()  # type: ignore[attr-defined]
        return 130
    return 0


def _run(args: argparse.Namespace) -> int:
    more = _words_parser().parse_intermixed_args(args.words)
    data = more.data if more.data is not None else args.data
    headers = [*args.header, *more.header]
    timeout_s = more.timeout if more.timeout is not None else args.timeout
    no_auth = args.no_auth or more.no_auth
    if timeout_s is not None and timeout_s < 0:
        raise _Failure("dsec grpc: --timeout must not be negative", 2)
    address, verb, symbol = _split_words(more.words)
    if address is None:
        address = resolve(token="").target
    metadata = _metadata(headers)
    token_missing = False
    if not no_auth and not any(name == "authorization" for name, _ in metadata):
        try:
            token = resolve(target=address).token
        except DSecError:
            token = ""  # none anywhere: call without, and say so if the server minds
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        token_missing = not token
    connect_timeout_s = timeout_s or DEFAULT_TIMEOUT_S
    channel = _connect(address, connect_timeout_s)
    try:
        reflection = _Reflection(
            grpc.intercept_channel(channel, _ReflectionDefaults(metadata, connect_timeout_s)),
            address,
        )
        if verb == "list":
            if symbol is None:
                print("\n".join(reflection.services()))
            else:
                service = reflection.service(symbol)
                print("\n".join(f"{service.full_name}.{m.name}" for m in service.methods))
            return 0
        if verb == "describe":
            names = [symbol] if symbol is not None else reflection.services()
            for name in names:
                what, descriptor = reflection.symbol(name)
                print(f"{descriptor.full_name} is {what}:\n{describe_text(descriptor)}")
            return 0
        assert symbol is not None
        method = reflection.method(symbol)
        request = _request(method, data, reflection.pool)
        if timeout_s is None:  # a stream runs until it ends; a unary call gets the default
            call_timeout_s = None if method.server_streaming else DEFAULT_TIMEOUT_S
        else:
            call_timeout_s = timeout_s or None
        return _call(channel, reflection, method, request, metadata, call_timeout_s, token_missing)
    finally:
        channel.close()


def cmd_grpc(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except _Failure as failure:
        print(str(failure), file=sys.stderr)
        return failure.status


def main(argv: list[str] | None = None) -> int:
    """``python -m dsecctl.grpc_cli ARGS`` is ``dsec grpc ARGS``: the same subcommand parser
    (under a ``dsec`` parser, so its usage and errors read the same) and the same ending."""
    parser = argparse.ArgumentParser(prog="dsec")
    add_parser(parser.add_subparsers(dest="topic", required=True, metavar="COMMAND"))
    args = parser.parse_args(["grpc", *(sys.argv[1:] if argv is None else argv)])
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
