"""The gRPC boundary and run loop every service shares.

:class:`GrpcServer` registers servicers from their protobuf service
descriptors (not the generated ``add_*_to_server`` helpers) so that one place
decides, for every method of every service:

- a request that does not parse is answered INVALID_ARGUMENT (grpc's own
  default would be INTERNAL) and the server keeps serving;
- a :class:`~libdsec.errors.DSecError` becomes its status code plus an
  ``ErrorInfo`` trailer; any other exception is logged with an incident id
  and reaches the caller as INTERNAL without a stack trace;
- ``CancelledError`` is never swallowed.

It also adds gRPC health and reflection (what `dsec grpc` and grpcurl need), the tracing
interceptor, every call counted by method and status with its duration (when the service has
:class:`~common.metrics.Metrics`, served by its metrics endpoint), and graceful shutdown:
health NOT_SERVING -> stop(grace) -> cancel background tasks -> close resources.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from contextlib import AsyncExitStack
from typing import Any

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from common.metrics import LATENCY_BUCKETS_S, Authorize, Metrics, MetricsEndpoint
from common.telemetry import record_error, server_interceptors
from libdsec.errors import DSecError, InvalidArgument, error_trailer

log = logging.getLogger(__name__)

#: Options for every server: generous message size (uploads are chunked, but
#: batch creates are big), keepalive so dead clients free their streams.
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
]


class _Malformed:
    """Stand-in for a request whose bytes did not parse."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _deserializer(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception as exc:  # DecodeError and friends
            return _Malformed(exc)

    return parse


def _serializer(msg: Any) -> bytes:
    return msg.SerializeToString()  # type: ignore[no-any-return]


async def _abort(context: grpc.aio.ServicerContext, err: DSecError) -> None:
    record_error(err.code, err.reason)  # the server span: status code and dsec's reason
    await context.abort(err.code, err.message, trailing_metadata=error_trailer(err))


def internal_error(context_method: str, exc: BaseException) -> DSecError:
    """Logs an unexpected exception with an incident id; the INTERNAL error to send instead."""
    incident = uuid.uuid4().hex[:12]
    log.error(
        "unhandled error in %s (incident %s)",
        context_method,
        incident,
        exc_info=exc,
        extra={"incident": incident, "method": context_method},
    )
    from libdsec.errors import Internal

    return Internal(f"internal error (incident {incident})", metadata={"incident": incident})


def _check(request: Any, method: str) -> None:
    if isinstance(request, _Malformed):
        raise InvalidArgument(
            f"malformed {method} request: {request.error}", reason="MALFORMED_REQUEST"
        )


async def _checked_iter(requests: AsyncIterator[Any], method: str) -> AsyncIterator[Any]:
    async for item in requests:
        _check(item, method)
        yield item


class RpcMetrics:
    """Every call a server answers: a count by method and status code, and its duration (a
    stream's from open to end). Bounded labels: the service's methods and the 17 codes."""

    def __init__(self, metrics: Metrics) -> None:
        meter = metrics.meter
        self.calls = meter.create_counter(
            "dsec_rpc_server_calls", description="gRPC calls answered, by method and status code"
        )
        self.duration = meter.create_histogram(
            "dsec_rpc_server_duration_seconds",
            unit="s",
            description="gRPC call duration (a stream's: open to end), by method and code",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )

    def record(self, method: str, code: str, started: float) -> None:
        labels = {"method": method, "code": code}
        self.calls.add(1, labels)
        self.duration.record(time.perf_counter() - started, labels)


def _code(context: grpc.aio.ServicerContext, default: str) -> str:
    """The status an aborted call went out with (``default`` when grpc does not say)."""
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else default


def _wrap(
    method: MethodDescriptor, fn: Callable[..., Any], rpc: RpcMetrics | None = None
) -> Callable[..., Any]:
    name = method.full_name
    short = f"{method.containing_service.name}/{method.name}"
    client_stream = method.client_streaming
    if method.server_streaming:

        async def stream_handler(
            request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            started, code = time.perf_counter(), "OK"
            try:
                if client_stream:
                    request = _checked_iter(request, name)
                else:
                    _check(request, name)
                async for item in fn(request, context):
                    yield item
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except grpc.aio.AbortError:
                code = _code(context, "UNKNOWN")
                raise
            except DSecError as err:
                code = err.code.name
                await _abort(context, err)
            except Exception as exc:
                code = "INTERNAL"
                await _abort(context, internal_error(name, exc))
            finally:
                if rpc is not None:
                    rpc.record(short, code, started)

        return stream_handler

    async def unary_handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started, code = time.perf_counter(), "OK"
        try:
            if client_stream:
                request = _checked_iter(request, name)
            else:
                _check(request, name)
            return await fn(request, context)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except grpc.aio.AbortError:
            code = _code(context, "UNKNOWN")
            raise
        except DSecError as err:
            code = err.code.name
            await _abort(context, err)
        except Exception as exc:
            code = "INTERNAL"
            await _abort(context, internal_error(name, exc))
        finally:
            if rpc is not None:
                rpc.record(short, code, started)

    return unary_handler


def service_handler(
    servicer: object, service: ServiceDescriptor, rpc: RpcMetrics | None = None
) -> grpc.GenericRpcHandler:
    """A generic handler serving every method of ``service`` from ``servicer``.

    A method the servicer does not define answers UNIMPLEMENTED with the
    method's name, so a contract can be complete before its implementation.
    """
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        req_cls = message_factory.GetMessageClass(method.input_type)
        fn = getattr(servicer, method.name, None)
        if fn is None:
            fn = _unimplemented(method)
        elif method.server_streaming and not inspect.isasyncgenfunction(fn):
            raise TypeError(f"{type(servicer).__name__}.{method.name} must be an async generator")
        wrapped = _wrap(method, fn, rpc)
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            wrapped, request_deserializer=_deserializer(req_cls), response_serializer=_serializer
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _unimplemented(method: MethodDescriptor) -> Callable[..., Any]:
    from libdsec.errors import Unimplemented

    if method.server_streaming:

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            raise Unimplemented(f"{method.full_name} is not implemented by this server yet")
            yield  # pragma: no cover

        return stream

    async def unary(request: Any, context: Any) -> Any:
        raise Unimplemented(f"{method.full_name} is not implemented by this server yet")

    return unary


def find_service(full_name: str) -> ServiceDescriptor:
    """The descriptor of a service by name (its _pb2 module must be imported)."""
    return descriptor_pool.Default().FindServiceByName(full_name)


class GrpcServer:
    """One service process: servicers, health, reflection, background tasks.

    Usage, in a service's ``server.py`` (the composition root)::

        server = GrpcServer("iam", cfg.listen)
        server.add(IamServicer(store), "dsec.iam.v1.IamService")
        server.background(reaper.run)           # runs in the server's TaskGroup
        server.on_close(store.close)
        await server.run()                      # until SIGTERM/SIGINT
    """

    def __init__(
        self,
        name: str,
        listen: str,
        *,
        grace_s: float = 5.0,
        metrics: Metrics | None = None,
        metrics_listen: str = "",
        metrics_authorize: Authorize | None = None,
    ) -> None:
        self.name = name
        self.listen = listen
        self.grace_s = grace_s
        #: The service's metrics (RPCs counted here); served on ``metrics_listen`` unless "".
        self.metrics = metrics
        self._rpc = RpcMetrics(metrics) if metrics is not None else None
        self.metrics_endpoint = (
            MetricsEndpoint(metrics, metrics_listen, metrics_authorize)
            if metrics is not None and metrics_listen
            else None
        )
        self._services: list[tuple[object, ServiceDescriptor]] = []
        self._background: list[Callable[[], Awaitable[None]]] = []
        self._closers: list[Callable[[], Awaitable[object] | None]] = []
        self._on_stop: list[Callable[[], Awaitable[None]]] = []
        #: Conditions the whole process needs besides its servicers (e.g. its virtual IP's
        #: route agent): name -> why it is not met. Health "" is SERVING only with none.
        self._unmet: dict[str, str] = {}
        self._stop = asyncio.Event()
        self.server: grpc.aio.Server | None = None
        self.health = health_aio.HealthServicer()
        self.bound_port: int | None = None

    def add(self, servicer: object, service_full_name: str) -> None:
        self._services.append((servicer, find_service(service_full_name)))

    def background(self, fn: Callable[[], Awaitable[None]]) -> None:
        """A long-running coroutine (probe loop, reaper) owned by this server."""
        self._background.append(fn)

    def on_close(self, fn: Callable[[], Awaitable[object] | None]) -> None:
        self._closers.append(fn)

    def on_stop(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Runs first when the server is asked to stop, while it still serves (e.g. withdraw
        its virtual IP's route, so that no new connection arrives)."""
        self._on_stop.append(fn)

    def require(self, name: str, reason: str) -> None:
        """Health "" stays NOT_SERVING until :meth:`met` ``name`` (``reason``: why not yet)."""
        self._unmet[name] = reason

    async def met(self, name: str, ok: bool, reason: str = "") -> None:
        """Condition ``name`` is met (or no longer, because of ``reason``); health "" follows."""
        if ok:
            self._unmet.pop(name, None)
        else:
            self._unmet[name] = reason
        if self.server is not None and not self._stop.is_set():
            await self.health.set("", self._overall())

    def _overall(self) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
        if self._unmet:
            return health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse.SERVING

    def request_stop(self) -> None:
        self._stop.set()

    async def start(self) -> None:
        server = grpc.aio.server(
            interceptors=server_interceptors(self.name), options=SERVER_OPTIONS
        )
        names: list[str] = []
        for servicer, desc in self._services:
            server.add_generic_rpc_handlers((service_handler(servicer, desc, self._rpc),))
            names.append(desc.full_name)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names += [
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(names, server)
        self.bound_port = server.add_insecure_port(self.listen)
        if self.bound_port == 0 and not self.listen.startswith("unix"):
            raise OSError(f"{self.name}: cannot listen on {self.listen}")
        await server.start()
        self.server = server
        if self.metrics_endpoint is not None:
            await self.metrics_endpoint.start()
        for _, desc in self._services:
            await self.health.set(desc.full_name, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", self._overall())
        log.info("%s serving on %s", self.name, self.address, extra={"services": ",".join(names)})
        for name, reason in self._unmet.items():
            log.warning("%s: not SERVING until %s: %s", self.name, name, reason)

    @property
    def address(self) -> str:
        if self.listen.startswith("unix"):
            return self.listen
        host = self.listen.rsplit(":", 1)[0]
        return f"{host}:{self.bound_port}"

    async def run(self) -> None:
        """Serves until SIGTERM/SIGINT or :meth:`request_stop`, then shuts down gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        await self.start()
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._supervise(fn)) for fn in self._background]
                await self._stop.wait()
                log.info("%s shutting down", self.name)
                for fn in self._on_stop:
                    try:
                        await fn()
                    except Exception:
                        log.exception("%s: error in a stop hook", self.name)
                await self.health.enter_graceful_shutdown()
                assert self.server is not None
                await self.server.stop(self.grace_s)
                for task in tasks:
                    task.cancel()
        finally:
            await self._close()
            log.info("%s stopped", self.name)

    async def _supervise(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Restarts a crashed background loop (after a pause) instead of killing the server."""
        while not self._stop.is_set():
            try:
                await fn()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception(
                    "%s: background task %s crashed; restarting in 1 s",
                    self.name,
                    getattr(fn, "__qualname__", fn),
                )
                await asyncio.sleep(1.0)

    async def _close(self) -> None:
        if self.metrics_endpoint is not None:
            await self.metrics_endpoint.close()
        if self.metrics is not None:
            self.metrics.shutdown()
        async with AsyncExitStack():
            for fn in reversed(self._closers):
                try:
                    result = fn()
                    if inspect.isawaitable(result):
                        await result
                except Exception:
                    log.exception("%s: error while closing", self.name)


def run_service(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Runs a service's async main on a uvloop event loop."""
    import uvloop

    uvloop.run(main())


def service_names(servicers: Iterable[tuple[object, str]]) -> list[str]:
    return [name for _, name in servicers]
