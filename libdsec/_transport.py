"""The transport under the SDK: gRPC channel options and retries, the channel to the API
servers with the caller's token, and the call wrappers (typed errors, stream stall timeouts).

The channel options and the retry service config are the one definition for every dsec
channel: the SDK's here, the services' through ``common/channels.py``. Each side keeps its own
policy of what is retried (:data:`SDK_RETRY` on the idempotent methods of the public API,
:data:`SERVICE_RETRY` on the whole services a caller marks idempotent); both retry only
UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from dsec.apiserver.v1 import apiserver_pb2_grpc
from libdsec.errors import DeadlineExceeded, from_rpc_error

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


#: The SDK to the API servers: a client can wait a little longer for a restarting server.
SDK_RETRY = RetryPolicy(max_attempts=5, initial_backoff_s=0.1, max_backoff_s=2.0)
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
#: idempotent).
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
    "dsec.apiserver.v1.ExecService": ("WaitExec", "ListExecs", "ListSessions"),
    "dsec.apiserver.v1.FileService": ("ReadFile", "ListDir", "StatPath"),
    "dsec.apiserver.v1.ProjectService": ("WhoAmI", "GetProject", "ListProjects", "ListTokens"),
    "dsec.apiserver.v1.EnvironmentService": ("ListEnvironments", "GetEnvironment", "ListLayers"),
}

#: The SDK's channel options (its retry policy on :data:`SDK_IDEMPOTENT`).
CHANNEL_OPTIONS = channel_options(
    retry_service_config(
        [f"{svc}/{m}" for svc, methods in SDK_IDEMPOTENT.items() for m in methods], SDK_RETRY
    )
)

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


async def unary(call: Any) -> Any:
    """Awaits a unary call; a failed call raises its typed :class:`~libdsec.errors.DSecError`."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc) from exc


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
                raise from_rpc_error(exc) from exc
            yield item
    finally:
        call.cancel()


class Transport:
    """One channel to the API servers, the caller's token, and a stub per public service."""

    def __init__(self, target: str, token: str) -> None:
        self.target = target
        #: The bearer token, sent as metadata with every call.
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),)
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.sandboxes = apiserver_pb2_grpc.SandboxServiceStub(self.channel)
        self.exec = apiserver_pb2_grpc.ExecServiceStub(self.channel)
        self.files = apiserver_pb2_grpc.FileServiceStub(self.channel)
        self.projects = apiserver_pb2_grpc.ProjectServiceStub(self.channel)
        self.environments = apiserver_pb2_grpc.EnvironmentServiceStub(self.channel)
        self.functions = apiserver_pb2_grpc.FunctionServiceStub(self.channel)

    async def unary(
        self, method: Callable[..., Any], request: Any, *, timeout: float | None
    ) -> Any:
        """Calls ``method`` (a stub's unary or client-streaming method) with the token."""
        return await unary(method(request, metadata=self.metadata, timeout=timeout))

    def stream(
        self,
        method: Callable[..., Any],
        request: Any,
        *,
        idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S,
    ) -> AsyncIterator[Any]:
        """Opens the server stream ``method(request)`` with the token; see :func:`stream`."""
        return stream(method(request, metadata=self.metadata), idle_timeout_s)

    async def close(self) -> None:
        await self.channel.close()
