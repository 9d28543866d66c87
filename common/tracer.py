"""dsec's tracer provider: OpenTelemetry's tracing API, recorded and exported over OTLP/gRPC at
a fraction of the OpenTelemetry SDK's cost per span.

Everything that makes spans calls the API (``opentelemetry-api``): OpenTelemetry's gRPC
instrumentation, compat's HTTP spans, libdsec. What answers those calls in a service is the
provider that :func:`common.telemetry.setup_tracing` installs, this one by default. The SDK's
``TracerProvider`` + ``BatchSpanProcessor`` + ``OTLPSpanExporter`` cost ~60 us of CPU per
recorded span in a service (bench/bench_tracing.py: a 100% sampled ``run("true")`` took 26%
more cluster CPU than tracing off, against the issue's 10%): ~17 us to start and end a span
(attribute limits and cleaning, locks, a sampler result object, processor fan-out), ~20 us to
encode it (a protobuf object per attribute and value), and the export thread around that. Here
a span is a plain object, and a batch is written to OTLP's wire format directly, with each
attribute's encoding cached.

Kept from the SDK, so that a trace reads the same in any backend (tests/unit/test_tracer.py
sends the same spans through both to a real OTLP receiver and compares what arrives):

- sampling: parent-based; a root span is kept with the root ratio, decided on the trace id
  exactly as ``TraceIdRatioBased`` does (so 1% here and in an SDK-traced caller agree);
- ids from ``random.getrandbits`` (the SDK's ``RandomIdGenerator``), never zero;
- span status rules (OK is final, UNSET never overwrites), exception events as the SDK writes
  them, attribute values cleaned as the SDK cleans them (invalid ones dropped), at most 128
  attributes, events and links per span (the SDK's default limits; the excess is counted in
  the ``dropped_*`` fields);
- OTLP's encoding: resource > scope > spans, the span flags, trace state;
- ``OTEL_BSP_SCHEDULE_DELAY`` (ms), ``OTEL_BSP_MAX_QUEUE_SIZE``,
  ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``, and a flush at exit.

Different on purpose: a span whose trace is sampled is recorded only if this process exports
(otherwise its context, sampled flag included, is still propagated); a batch the receiver does
not take is dropped, not retried (counted in :attr:`OtlpExporter.dropped`, logged once per
failure streak): a collector that is down must not make the services buffer or spin.
``DSEC_TRACE_PROVIDER=sdk`` installs the SDK's provider instead (bench/bench_tracing.py
compares both).
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import struct
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

import grpc
from opentelemetry import trace
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.util._decorator import _agnosticcontextmanager

from common.version import DSEC_VERSION

log = logging.getLogger(__name__)

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
#: TraceIdRatioBased's: the low 64 bits of a trace id are compared with the ratio's bound.
_ID_LIMIT = (1 << 64) - 1
#: The SDK's default span limits (OTEL_SPAN_*_COUNT_LIMIT).
MAX_ATTRIBUTES = MAX_EVENTS = MAX_LINKS = 128
_UNSET = Status(StatusCode.UNSET)
_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _env_int(name: str, default: int) -> int:
    try:
        value = int(os.environ.get(name, "") or default)
    except ValueError:
        log.warning("%s is not an integer: %r; using %d", name, os.environ[name], default)
        return default
    return value if value > 0 else default


# ------------------------------------------------------------------------------ spans


class SpanSink(Protocol):
    """Where ended spans go: :class:`OtlpExporter` (or a test's list)."""

    def put(self, span: RecordedSpan) -> None: ...


class RecordedSpan(trace.Span):
    """A span being recorded (its trace is sampled and this process exports)."""

    __slots__ = (
        "_exporter",
        "_on_exit",
        "attributes",
        "context",
        "dropped_attributes",
        "dropped_events",
        "dropped_links",
        "end_time",
        "events",
        "kind",
        "links",
        "name",
        "parent",
        "resource",
        "scope",
        "start_time",
        "status",
    )

    def __init__(
        self,
        exporter: SpanSink,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        resource: bytes,
        scope: Scope,
        start_time: int,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> None:
        self._exporter = exporter
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self.resource = resource
        self.scope = scope
        self.start_time = start_time
        self.end_time: int | None = None
        self.attributes: dict[str, Any] = {}
        self.events: list[tuple[str, dict[str, Any], int]] = []
        self.links: list[tuple[SpanContext, dict[str, Any]]] = []
        self.status = _UNSET
        self.dropped_attributes = self.dropped_events = self.dropped_links = 0
        self._on_exit = (record_exception, set_status_on_exception)

    # The API's Span
    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self.end_time is not None:
            return
        if not key:
            return
        value = clean_attribute(value)
        attributes = self.attributes
        if key in attributes:
            del attributes[key]  # the SDK's order: a set key moves to the end
        elif len(attributes) >= MAX_ATTRIBUTES:  # the SDK's limit: the oldest goes
            del attributes[next(iter(attributes))]
            self.dropped_attributes += 1
        attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(
        self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None
    ) -> None:
        if self.end_time is not None:
            return
        if len(self.events) >= MAX_EVENTS:
            self.dropped_events += 1
            return
        self.events.append((name, clean_attributes(attributes), timestamp or time.time_ns()))

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self.end_time is not None or not context.is_valid:
            return
        if len(self.links) >= MAX_LINKS:
            self.dropped_links += 1
            return
        self.links.append((context, clean_attributes(attributes)))

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self.end_time is not None or self.status.status_code is StatusCode.OK:
            return  # OK is final
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if status.status_code is not StatusCode.UNSET:
            self.status = status

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        cls = type(exception)
        module = cls.__module__
        event: dict[str, Any] = {
            "exception.type": (
                f"{module}.{cls.__qualname__}"
                if module and module != "builtins"
                else cls.__qualname__
            ),
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            event.update(attributes)
        self.add_event("exception", event, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        self.end_time = end_time or time.time_ns()
        self._exporter.put(self)

    def __exit__(self, exc_type: Any, exc_val: BaseException | None, exc_tb: Any) -> None:
        # As the SDK's span: used as a context manager, it records what escaped it.
        if exc_val is not None and self.end_time is None:
            record, set_status = self._on_exit
            if record:
                self.record_exception(exc_val, escaped=True)
            if set_status:
                self.set_status(Status(StatusCode.ERROR, f"{type(exc_val).__name__}: {exc_val}"))
        self.end()


_SCALARS = (bool, str, bytes, int, float)
#: An encoded InstrumentationScope message and its schema URL.
Scope = tuple[bytes, bytes]


def clean_attribute(value: Any) -> Any:
    """An attribute value as the SDK keeps it: a scalar or None as it is, a sequence as a tuple
    and a mapping as a dict (both cleaned in turn, a mapping's keys non-empty strings);
    anything else becomes None."""
    if value is None or isinstance(value, _SCALARS):
        return value
    if isinstance(value, Sequence):
        return tuple(clean_attribute(v) for v in value)
    if isinstance(value, Mapping):
        out = {}
        for key, val in value.items():
            if key and isinstance(key, str):
                out[key] = clean_attribute(val)
        return out
    return None


def clean_attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (attributes or {}).items():
        if key and len(out) < MAX_ATTRIBUTES:
            out[key] = clean_attribute(value)
    return out


# ------------------------------------------------------------------------------ the provider


class Tracer(trace.Tracer):
    def __init__(self, provider: TracerProvider, scope: Scope) -> None:
        self._provider = provider
        self._scope = scope

    def start_span(
        self,
        name: str,
        context: Any = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        provider = self._provider
        parent: SpanContext | None = trace.get_current_span(context).get_span_context()
        if parent is not None and parent.is_valid:
            trace_id, sampled, state = (
                parent.trace_id,
                parent.trace_flags.sampled,
                parent.trace_state,
            )
        else:
            parent, state = None, None
            trace_id = random.getrandbits(128) or 1
            sampled = (trace_id & _ID_LIMIT) < provider.root_bound
        ctx = SpanContext(
            trace_id,
            random.getrandbits(64) or 1,
            is_remote=False,
            trace_flags=_SAMPLED if sampled else _NOT_SAMPLED,
            trace_state=state,
        )
        exporter = provider.exporter
        if not sampled or exporter is None:
            return NonRecordingSpan(ctx)
        span = RecordedSpan(
            exporter,
            name,
            ctx,
            parent,
            kind,
            provider.resource,
            self._scope,
            start_time or time.time_ns(),
            record_exception,
            set_status_on_exception,
        )
        if attributes:
            span.set_attributes(attributes)
        for link in links or ():
            span.add_link(link.context, link.attributes)
        return span

    @_agnosticcontextmanager
    def start_as_current_span(
        self,
        name: str,
        context: Any = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with trace.use_span(
            span,
            end_on_exit=end_on_exit,
            record_exception=record_exception,
            set_status_on_exception=set_status_on_exception,
        ) as current:
            yield current


class TracerProvider(trace.TracerProvider):
    """Spans of service ``dsec-<service>``; a root span is kept with probability
    ``root_ratio`` (0: none, parent-based only); recorded only with an ``exporter``."""

    def __init__(self, service: str, root_ratio: float, exporter: SpanSink | None) -> None:
        self.service = service
        self.root_bound = round(max(0.0, min(1.0, root_ratio)) * (_ID_LIMIT + 1))
        self.exporter = exporter
        self.resource = encode_resource(f"dsec-{service}")
        self._tracers: dict[tuple[str, str, str], Tracer] = {}
        self._resources: dict[str, bytes] = {}

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Any = None,
    ) -> Tracer:
        key = (instrumenting_module_name, instrumenting_library_version or "", schema_url or "")
        tracer = self._tracers.get(key)
        if tracer is None:
            tracer = self._tracers[key] = Tracer(self, encode_scope(*key))
        return tracer

    def record(
        self,
        service: str,
        name: str,
        context: SpanContext,
        parent: SpanContext,
        start_time: int,
        end_time: int,
        attributes: Mapping[str, Any],
        status: Status,
    ) -> None:
        """Exports a span recorded elsewhere (inside a sandbox) as service ``dsec-<service>``'s."""
        if self.exporter is None:
            return
        resource = self._resources.get(service)
        if resource is None:
            resource = self._resources[service] = encode_resource(f"dsec-{service}")
        span = RecordedSpan(
            self.exporter,
            name,
            context,
            parent,
            SpanKind.INTERNAL,
            resource,
            _IN_SANDBOX,
            start_time,
        )
        span.set_attributes(attributes)
        span.set_status(status)
        span.end(end_time)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if isinstance(self.exporter, OtlpExporter):
            return self.exporter.flush(timeout_millis / 1000)
        return True

    def shutdown(self) -> None:
        if isinstance(self.exporter, OtlpExporter):
            self.exporter.shutdown()


# ------------------------------------------------------------------------------ export


class OtlpExporter:
    """Ended spans, queued and sent in batches to an OTLP/gRPC endpoint by one thread: every
    ``OTEL_BSP_SCHEDULE_DELAY`` ms (default 5000), or as soon as a batch is full."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.delay_s = _env_int("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self.max_queue = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self.max_batch = min(_env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512), self.max_queue)
        #: Spans sent and taken by the receiver; spans dropped (queue full or export failed).
        self.exported = self.dropped = 0
        self._queue: deque[RecordedSpan] = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # one export at a time
        self._stopping = False
        self._failing = ""
        url = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
        target = url.netloc or endpoint
        if url.scheme == "https":
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials())
        else:
            self._channel = grpc.insecure_channel(target)
        self._send = self._channel.unary_unary(_EXPORT_METHOD)  # bytes in, bytes out
        self._thread = threading.Thread(target=self._run, name="dsec-otlp", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)

    def put(self, span: RecordedSpan) -> None:
        queue = self._queue
        if len(queue) >= self.max_queue:
            self.dropped += 1
            return
        queue.append(span)
        if len(queue) >= self.max_batch:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.delay_s)
            self._wake.clear()
            self._export_queued(time.monotonic() + 10.0)

    def _export_queued(self, deadline: float) -> bool:
        with self._lock:
            queue = self._queue
            while queue:
                n = min(len(queue), self.max_batch)
                batch = [queue.popleft() for _ in range(n)]
                if not self._export(batch, max(0.1, deadline - time.monotonic())):
                    return False
            return True

    def _export(self, batch: list[RecordedSpan], timeout_s: float) -> bool:
        try:
            self._send(encode_request(batch), timeout=min(timeout_s, 10.0))
        except grpc.RpcError as err:
            self.dropped += len(batch)
            why = f"{err.code().name}: {err.details()}"  # type: ignore[attr-defined]
            if not self._failing:
                log.warning(
                    "OTLP export to %s failed (%s): spans are dropped until it answers",
                    self.endpoint,
                    why,
                )
            self._failing = why
            return False
        if self._failing:
            log.info("OTLP export to %s works again", self.endpoint)
            self._failing = ""
        self.exported += len(batch)
        return True

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Sends everything queued now; False if an export failed."""
        return self._export_queued(time.monotonic() + timeout_s)

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(5.0)
        self.flush(5.0)
        self._channel.close()


# ------------------------------------------------------------------------------ OTLP encoding
# opentelemetry/proto/collector/trace/v1/trace_service.proto and trace/v1/trace.proto, written
# field by field. Tags: (field << 3) | wire type (0 varint, 1 fixed64, 2 bytes, 5 fixed32).

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_F64 = struct.Struct("<d")
#: SpanFlags: SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK, SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK.
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (``tag`` already encoded)."""
    return tag + _varint(len(payload)) + payload


def _any_value(value: Any) -> bytes:
    """An AnyValue message."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _field(b"\x0a", value.encode())
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)
    if isinstance(value, float):
        return b"\x21" + _F64.pack(value)
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if value is None:
        return b""
    if isinstance(value, Mapping):  # a KeyValueList
        return _field(b"\x32", b"".join(_key_values(b"\x0a", value)))
    # A sequence: an ArrayValue of AnyValues.
    return _field(b"\x2a", b"".join(_field(b"\x0a", _any_value(v)) for v in value))


_kv_cache: dict[tuple[bytes, str, type, Any], bytes] = {}
#: The values worth a cache entry (a True is not taken for a 1: the type is in the key).
_CACHED = frozenset({str, int, bool})
#: Attribute values repeat (method names, status codes); a value that does not (a sandbox id)
#: is encoded each time once the cache is this full.
_KV_CACHE_MAX = 4096


def _key_values(tag: bytes, attributes: Mapping[str, Any]) -> list[bytes]:
    """Each attribute as a KeyValue field of number ``tag``."""
    out = []
    for key, value in attributes.items():
        kind = type(value)
        cached = kind in _CACHED
        encoded = _kv_cache.get((tag, key, kind, value)) if cached else None
        if encoded is None:
            kv = _field(b"\x0a", key.encode()) + _field(b"\x12", _any_value(value))
            encoded = _field(tag, kv)
            if cached and len(_kv_cache) < _KV_CACHE_MAX:
                _kv_cache[(tag, key, kind, value)] = encoded
        out.append(encoded)
    return out


def encode_resource(service_name: str) -> bytes:
    """A Resource message: service.name and the telemetry.sdk.* attributes."""
    attributes = {
        "telemetry.sdk.language": "python",
        "telemetry.sdk.name": "dsec",
        "telemetry.sdk.version": DSEC_VERSION,
        "service.name": service_name,
    }
    return b"".join(_key_values(b"\x0a", attributes))


def encode_scope(name: str, version: str = "", schema_url: str = "") -> Scope:
    """An InstrumentationScope message, and the scope's schema URL."""
    scope = _field(b"\x0a", name.encode())
    if version:
        scope += _field(b"\x12", version.encode())
    return scope, schema_url.encode()


#: The scope of spans recorded inside sandboxes (chronus runs no OpenTelemetry).
_IN_SANDBOX = encode_scope("dsec.insandbox")


def _flags(parent: SpanContext | None) -> bytes:
    flags = _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0)
    return b"\x85\x01" + _U32.pack(flags)


def encode_span(span: RecordedSpan) -> bytes:
    """A Span message."""
    ctx = span.context
    parts = [
        b"\x0a\x10",
        ctx.trace_id.to_bytes(16, "big"),
        b"\x12\x08",
        ctx.span_id.to_bytes(8, "big"),
    ]
    if ctx.trace_state:
        parts.append(_field(b"\x1a", ctx.trace_state.to_header().encode()))
    if span.parent is not None:
        parts += (b"\x22\x08", span.parent.span_id.to_bytes(8, "big"))
    parts += (
        _field(b"\x2a", span.name.encode()),
        b"\x30",
        _varint(span.kind.value + 1),  # OTLP's SpanKind counts from UNSPECIFIED
        b"\x39",
        _U64.pack(span.start_time),
        b"\x41",
        _U64.pack(span.end_time or span.start_time),
    )
    parts += _key_values(b"\x4a", span.attributes)
    if span.dropped_attributes:
        parts += (b"\x50", _varint(span.dropped_attributes))
    for name, attributes, timestamp in span.events:
        event = [b"\x09", _U64.pack(timestamp), _field(b"\x12", name.encode())]
        event += _key_values(b"\x1a", attributes)
        parts.append(_field(b"\x5a", b"".join(event)))
    if span.dropped_events:
        parts += (b"\x60", _varint(span.dropped_events))
    for context, attributes in span.links:
        link = [b"\x0a\x10", context.trace_id.to_bytes(16, "big")]
        link += (b"\x12\x08", context.span_id.to_bytes(8, "big"))
        link += _key_values(b"\x22", attributes)
        link.append(b"\x35" + _U32.pack(_HAS_IS_REMOTE | (_IS_REMOTE if context.is_remote else 0)))
        parts.append(_field(b"\x6a", b"".join(link)))
    if span.dropped_links:
        parts += (b"\x70", _varint(span.dropped_links))
    status = span.status
    body = b""
    if status.description:
        body += _field(b"\x12", status.description.encode())
    if status.status_code.value:
        body += b"\x18" + _varint(status.status_code.value)
    parts.append(_field(b"\x7a", body))
    parts.append(_flags(span.parent))
    return b"".join(parts)


def encode_request(spans: Sequence[RecordedSpan]) -> bytes:
    """An ExportTraceServiceRequest: the spans grouped by resource, then by scope."""
    groups: dict[bytes, dict[Scope, list[bytes]]] = {}
    for span in spans:
        groups.setdefault(span.resource, {}).setdefault(span.scope, []).append(encode_span(span))
    out = []
    for resource, scopes in groups.items():
        body = [_field(b"\x0a", resource)]
        for scope, encoded in scopes.items():
            message, schema_url = scope
            scope_spans = [_field(b"\x0a", message)]
            scope_spans += (_field(b"\x12", s) for s in encoded)
            if schema_url:
                scope_spans.append(_field(b"\x1a", schema_url))
            body.append(_field(b"\x12", b"".join(scope_spans)))
        out.append(_field(b"\x0a", b"".join(body)))
    return b"".join(out)
