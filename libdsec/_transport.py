"""The transport under the SDK: gRPC channel options and retries, the channel to the API
servers with the caller's token, and the call wrappers (typed errors, retries, stream stall
timeouts).

The channel options and the retry service config are the one definition for every dsec
channel: the SDK's here, the services' through ``common/channels.py``. The services let gRPC
retry UNAVAILABLE (:data:`SERVICE_RETRY`, on the whole services a caller marks idempotent); the
SDK retries its idempotent calls itself (:meth:`Transport.unary`), until the call's deadline, so
that a client rides through a restart of the API server or of a service behind it.

Traces: when the caller has configured an OpenTelemetry tracer provider, every call carries
W3C trace context and makes a client span (OpenTelemetry's gRPC instrumentation): the SDK
starts a trace, or continues the caller's current one, through the API server down to the
command in the sandbox. Without one nothing is added to the channel (:func:`tracing_interceptors`).
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from dsec.apiserver.v1 import apiserver_pb2_grpc
from libdsec.errors import (
    ERROR_TRAILER,
    ClientClosed,
    DeadlineExceeded,
    DSecError,
    Unavailable,
    from_rpc_error,
)

#: The largest message either way (a file chunk, a fncall job, a big listing).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options(service_config: str | None = None) -> list[tuple[str, str | int]]:
    """Options of every dsec channel: message limits, HTTP/2 keepalives (a dead peer is
    noticed within seconds, not at the next TCP timeout) and retries enabled, plus a
    ``service_config`` (see :func:`retry_service_config`) if given."""
    options: list[tuple[str, str | int]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 1),
        # Reconnect soon after a peer comes back (a restarted service): gRPC's default backoff
        # grows to 120 s, and calls on a channel in backoff fail at once with UNAVAILABLE
        # (seen: a restarted edge probed as down for seconds after it was serving, and marked
        # UNHEALTHY by the watcher).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    if service_config is not None:
        options.append(("grpc.service_config", service_config))
    return options


@dataclass(frozen=True)
class RetryPolicy:
    """gRPC's retry policy (exponential backoff) for UNAVAILABLE."""

    max_attempts: int
    initial_backoff_s: float
    max_backoff_s: float
    backoff_multiplier: float = 2.0


#: Service to service: short, the caller (an API server, an edge) has its own deadline to keep.
SERVICE_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.05, max_backoff_s=1.0)


def retry_service_config(names: Iterable[str], policy: RetryPolicy) -> str:
    """A gRPC service config retrying UNAVAILABLE under ``policy`` on ``names``: each a whole
    service (``"dsec.iam.v1.IamService"``) or one method (``"dsec.iam.v1.IamService/GetProject"``).
    Name only what is idempotent: a retried call may have run once already."""
    entries: list[dict[str, str]] = []
    for name in names:
        service, _, method = name.partition("/")
        entries.append({"service": service, "method": method} if method else {"service": service})
    return json.dumps(
        {
            "methodConfig": [
                {
                    "name": entries,
                    "retryPolicy": {
                        "maxAttempts": policy.max_attempts,
                        "initialBackoff": f"{policy.initial_backoff_s:g}s",
                        "maxBackoff": f"{policy.max_backoff_s:g}s",
                        "backoffMultiplier": policy.backoff_multiplier,
                        "retryableStatusCodes": ["UNAVAILABLE"],
                    },
                }
            ]
        }
    )


#: Methods of the public API safe to retry on UNAVAILABLE (they change nothing, or are
#: idempotent). A create is too when every sandbox it asks for carries an idempotency key
#: (:func:`idempotent`).
SDK_IDEMPOTENT: Mapping[str, tuple[str, ...]] = {
    "dsec.apiserver.v1.SandboxService": (
        "GetSandbox",
        "ListSandboxes",
        "StopSandbox",
        "PauseSandbox",
        "ResumeSandbox",
        # Task operations: a retry pauses what is not yet paused, resumes what is still paused,
        # and answers a stopped sandbox as it ended.
        "PauseTask",
        "ResumeTask",
        "StopTask",
    ),
    "dsec.apiserver.v1.ExecService": ("WaitExec", "ListExecs", "ListSessions", "WaitForPort"),
    "dsec.apiserver.v1.FileService": ("ReadFile", "ListDir", "StatPath"),
    "dsec.apiserver.v1.DisplayService": ("GetDisplayInfo", "Screenshot"),
    "dsec.apiserver.v1.ProjectService": ("WhoAmI", "GetProject", "ListProjects", "ListTokens"),
    "dsec.apiserver.v1.EnvironmentService": ("ListEnvironments", "GetEnvironment", "ListLayers"),
}
_IDEMPOTENT_METHODS = frozenset(
    f"{service}/{method}" for service, methods in SDK_IDEMPOTENT.items() for method in methods
)

#: The reasons of the UNAVAILABLE an idempotent call is retried on: something on the way is
#: down or restarting. The API server itself (gRPC's own status, no reason: it cannot be
#: reached or the connection dropped; or it is shutting down), a service behind it (the API
#: server's ``<SERVICE>_UNAVAILABLE``), the channel into the sandbox (``CHANNEL_CLOSED``), or a
#: create with the same idempotency key still in progress. Other reasons (``STORE_UNAVAILABLE``,
#: ``SANDBOX_NOT_READY``, ``NETWORK_EXHAUSTED``, ...) describe one resource: raised at once.
RETRIED_REASONS = frozenset(
    {
        "UNAVAILABLE",
        "IAM_UNAVAILABLE",
        "PLACEMENT_UNAVAILABLE",
        "WATCHER_UNAVAILABLE",
        "EDGE_UNAVAILABLE",
        "CHANNEL_CLOSED",
        "CREATE_IN_PROGRESS",
        "CLUSTER_VIEW_WARMING",  # placement after a watcher restart: edges not registered yet
    }
)
#: The backoff between the attempts of a retried call: jittered, doubling from the first to
#: the cap (a restarted API server serves again within 1-3 s; the cap keeps the wait after it
#: came back short).
RETRY_FIRST_BACKOFF_S = 0.05
RETRY_MAX_BACKOFF_S = 1.0


def retry_pauses() -> Iterator[float]:
    """The pauses between the attempts of a retried call: jittered, doubling from
    RETRY_FIRST_BACKOFF_S to RETRY_MAX_BACKOFF_S."""
    backoff = RETRY_FIRST_BACKOFF_S
    while True:
        yield backoff * random.uniform(0.5, 1.0)
        backoff = min(backoff * 2, RETRY_MAX_BACKOFF_S)


#: The SDK's channel options (no gRPC retry policy: :meth:`Transport.unary` retries).
#: The SDK's HTTP/2 keepalive period toward the API servers. Behind a virtual IP, a ping on a
#: connection to an instance whose route was withdrawn (hung) reaches another instance, which
#: resets it: the connection moves within one period instead of waiting out its calls'
#: deadlines. Above the API servers' 5 s ping floor (common/grpc_server.py SERVER_OPTIONS).
SDK_KEEPALIVE_MS = 6_000

CHANNEL_OPTIONS = [
    *(o for o in channel_options() if o[0] != "grpc.keepalive_time_ms"),
    ("grpc.keepalive_time_ms", SDK_KEEPALIVE_MS),
    # No BDP pings: one sent to an instance as it hangs is never answered, and gRPC sends no
    # keepalive while a ping is outstanding, so the connection would wait out its calls.
    ("grpc.http2.bdp_probe", 0),
    # ... and without them the stream window does not grow by itself: start it large enough
    # for file transfers at data-centre round trips (4 MiB in flight per stream).
    ("grpc.http2.lookahead_bytes", 4 * 1024 * 1024),
    # A connection of its own per client: gRPC otherwise shares one TCP connection between
    # every channel of a process to the same target, and behind a virtual IP with ECMP (one
    # instance per connection) a trainer's thousand clients would all land on one API server.
    ("grpc.use_local_subchannel_pool", 1),
]

#: How often the SDK asks a server stream for a keepalive when it has nothing else to say.
STREAM_KEEPALIVE_INTERVAL_S = 5.0
#: A stream silent this many keepalive intervals (no message, not even a keepalive) is dead.
STREAM_STALL_MARGIN = 6
#: A stream with no message (not even a keepalive) for this long is dead.
STREAM_IDLE_TIMEOUT_S = STREAM_KEEPALIVE_INTERVAL_S * STREAM_STALL_MARGIN
DEFAULT_TIMEOUT_S = 30.0


def stalled(idle_timeout_s: float) -> DeadlineExceeded:
    """The error of a stream that said nothing (not even a keepalive) for ``idle_timeout_s``."""
    return DeadlineExceeded(
        f"no message (not even a keepalive) for {idle_timeout_s:.0f} s", reason="STREAM_STALLED"
    )


def method_name(method: Any) -> str:
    """``"<service>/<method>"`` of a stub's method (gRPC keeps its path, ``b"/<service>/<method>"``)."""
    path: bytes = method._method
    return path.decode().lstrip("/")


def idempotent(name: str, request: Any) -> bool:
    """Whether the call ``name`` (see :func:`method_name`) of ``request`` may be sent twice:
    one of :data:`SDK_IDEMPOTENT`; a create whose every sandbox carries an idempotency key (a
    repeated create returns the first one's sandbox); or a call into a sandbox with an
    operation id (its edge runs it once and answers a repeat with the logged result)."""
    if name == "dsec.apiserver.v1.SandboxService/CreateSandbox":
        return bool(request.idempotency_key)
    if name == "dsec.apiserver.v1.SandboxService/CreateSandboxes":
        return all(item.idempotency_key for item in request.items)
    return name in _IDEMPOTENT_METHODS or bool(getattr(request, "operation_id", ""))


def new_operation_id() -> str:
    """An operation id the SDK makes for a call given none: unique, and reused by the SDK's
    own retries of that call (a caller that may itself retry a step, e.g. after a restart,
    passes its own: ``operation_id="ep17-turn3"``). ``sdk-<time><random>``, as the SDK's
    idempotency keys: ids made later sort later, so the edge's index of them grows at its end
    instead of dirtying a random page per operation."""
    return f"sdk-{time.time_ns():016x}{secrets.token_hex(10)}"


def retried(err: DSecError) -> bool:
    """Whether a failed idempotent call is tried again (see :data:`RETRIED_REASONS`)."""
    return isinstance(err, Unavailable) and err.reason in RETRIED_REASONS


async def unary(call: Any) -> Any:
    """Awaits a unary call; a failed call raises its typed :class:`~libdsec.errors.DSecError`."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc) from exc


def stream_error(exc: grpc.aio.AioRpcError) -> DSecError:
    """The typed error of a failed server stream of the API server. A stream gRPC itself ended
    with UNAVAILABLE (no dsec error trailer: the connection dropped, e.g. the API server died
    or restarted) says so; anything else is the server's own error (:func:`from_rpc_error`)."""
    err = from_rpc_error(exc)
    from_server = any(key == ERROR_TRAILER for key, _ in exc.trailing_metadata() or ())
    if exc.code() == grpc.StatusCode.UNAVAILABLE and not from_server:
        return Unavailable(f"the API server went away: {err.message}")
    return err


async def stream(call: Any, idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S) -> AsyncIterator[Any]:
    """Iterates a server stream; a stalled stream raises instead of hanging, a failed one its
    typed error. The call is cancelled when the iteration ends, however it ends."""
    it = call.__aiter__()
    try:
        while True:
            try:
                item = await asyncio.wait_for(it.__anext__(), timeout=idle_timeout_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise stalled(idle_timeout_s) from None
            except grpc.aio.AioRpcError as exc:
                raise stream_error(exc) from exc
            yield item
    finally:
        call.cancel()


def tracing_interceptors() -> list[grpc.aio.ClientInterceptor] | None:
    """OpenTelemetry's gRPC client interceptors if the caller configured a tracer provider
    (``opentelemetry.trace.set_tracer_provider``, before the client is made), else None.

    The default no-op provider means nothing changes and nothing costs: no interceptor on
    the channel, and OpenTelemetry is not even imported by the SDK (a program that set a
    provider has imported it already)."""
    if "opentelemetry.trace" not in sys.modules:
        return None
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    try:
        from opentelemetry.instrumentation.grpc import aio_client_interceptors
    except ImportError:  # libdsec installed without it: no traces from the SDK
        return None
    interceptors: list[grpc.aio.ClientInterceptor] = aio_client_interceptors(
        tracer_provider=provider
    )
    return interceptors


class Transport:
    """One channel to the API servers, the caller's token, and a stub per public service."""

    def __init__(self, target: str, token: str) -> None:
        self.target = target
        self.closed = False
        #: The bearer token (a live-view URL carries it: AsyncDisplay.viewer_url).
        self.token = token
        #: The bearer token, sent as metadata with every call.
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),)
        self.channel = grpc.aio.insecure_channel(
            target, options=CHANNEL_OPTIONS, interceptors=tracing_interceptors()
        )
        self.sandboxes = apiserver_pb2_grpc.SandboxServiceStub(self.channel)
        self.exec = apiserver_pb2_grpc.ExecServiceStub(self.channel)
        self.files = apiserver_pb2_grpc.FileServiceStub(self.channel)
        self.display = apiserver_pb2_grpc.DisplayServiceStub(self.channel)
        self.projects = apiserver_pb2_grpc.ProjectServiceStub(self.channel)
        self.environments = apiserver_pb2_grpc.EnvironmentServiceStub(self.channel)
        self.functions = apiserver_pb2_grpc.FunctionServiceStub(self.channel)

    async def unary(
        self, method: Callable[..., Any], request: Any, *, timeout: float | None
    ) -> Any:
        """Calls ``method`` (a stub's unary or client-streaming method) with the token.

        An idempotent call (:func:`idempotent`) that fails with a transient UNAVAILABLE
        (:func:`retried`) is tried again after a jittered, doubling backoff
        (:data:`RETRY_FIRST_BACKOFF_S` to :data:`RETRY_MAX_BACKOFF_S`) until ``timeout``
        (None: :data:`DEFAULT_TIMEOUT_S`), each attempt with the time left; then it raises
        :class:`~libdsec.errors.DeadlineExceeded` naming the last error. Any other call, or
        error, is raised at once.

        Every call with a deadline waits for the channel (``wait_for_ready``): one made while
        the API server is down (restarting) is sent once it is back, instead of failing at
        once; that is safe for any call, as nothing was sent. A call whose connection drops
        while it is under way is what the rules above are for.
        """
        self.check_open()
        try:
            return await self._unary(method, request, timeout)
        except DeadlineExceeded as err:
            state = self.channel.get_state()
            if state == grpc.ChannelConnectivity.READY:
                raise
            # It never got through: say so, rather than gRPC's bare "Deadline Exceeded".
            raise DeadlineExceeded(
                f"no answer within {timeout or DEFAULT_TIMEOUT_S:g} s: the API server at "
                f"{self.target} cannot be reached (connection {state.name}); is it running?"
            ) from err

    async def _unary(self, method: Callable[..., Any], request: Any, timeout: float | None) -> Any:
        name = method_name(method)
        if not idempotent(name, request):
            return await unary(
                method(
                    request,
                    metadata=self.metadata,
                    timeout=timeout,
                    wait_for_ready=timeout is not None,
                )
            )
        budget = DEFAULT_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + budget
        pauses = retry_pauses()
        attempts = 0
        while True:
            attempts += 1
            left = deadline - time.monotonic()
            try:
                return await unary(
                    method(request, metadata=self.metadata, timeout=left, wait_for_ready=True)
                )
            except DSecError as err:
                if not retried(err):
                    raise
                last = err
            pause = next(pauses)
            if time.monotonic() + pause >= deadline:
                raise DeadlineExceeded(
                    f"{name.rpartition('/')[2]}: no answer within {budget:g} s"
                    f" ({attempts} attempts); the last failed with {last}"
                ) from last
            await asyncio.sleep(pause)

    def stream(
        self,
        method: Callable[..., Any],
        request: Any,
        *,
        idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S,
    ) -> AsyncIterator[Any]:
        """Opens the server stream ``method(request)`` with the token; see :func:`stream`.
        It waits for the channel as :meth:`unary` does, within ``idle_timeout_s``."""
        self.check_open()
        return stream(method(request, metadata=self.metadata, wait_for_ready=True), idle_timeout_s)

    async def close(self) -> None:
        self.closed = True
        await self.channel.close()

    def check_open(self) -> None:
        """Raises :class:`~libdsec.errors.ClientClosed` once :meth:`close` was called (gRPC
        itself would fail with a bare "Channel is closed", or worse)."""
        if self.closed:
            raise ClientClosed(
                f"the client of the API server at {self.target} was closed; open a new one "
                "(the sandboxes live on: client.get(sandbox_id))"
            )


class Link(Protocol):
    """What the sandbox and files handles (``_sandbox.py``, ``_files.py``) need of the client
    that made them: its :class:`Transport` (the stubs, calls with the token, retries, stream
    stall timeouts, typed errors) and its default deadline. :class:`~libdsec.aio.AsyncClient`
    is one; the handles depend on this, not on the client's module (no import circle)."""

    @property
    def transport(self) -> Transport:
        """The client's channel to the API servers."""
        ...

    @property
    def timeout(self) -> float:
        """The default deadline of a unary call, in seconds."""
        ...
