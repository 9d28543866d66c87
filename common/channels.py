"""Outbound gRPC channels between services.

Every channel gets the options every dsec channel has (keepalives: a dead peer is noticed
within seconds, not at the next TCP timeout; message limits), the tracing client
interceptors, and a retry policy for UNAVAILABLE on services the caller marks idempotent.
The options and the retry config are defined once, in ``libdsec/_transport.py``, for the SDK
and the services alike; the services' policy is :data:`SERVICE_RETRY` there.
Every call still needs its own deadline: use :data:`DEFAULT_DEADLINE_S`.
"""

from __future__ import annotations

import grpc

from common.telemetry import client_interceptors
from libdsec._transport import SERVICE_RETRY, channel_options, retry_service_config

DEFAULT_DEADLINE_S = 10.0


def open_channel(
    target: str,
    caller: str,
    *,
    retry_services: list[str] | None = None,
    own_connection: bool = False,
) -> grpc.aio.Channel:
    """An insecure channel to another dsec service (cluster-internal traffic).

    ``retry_services`` lists fully-qualified services whose every method is
    idempotent, e.g. ``["dsec.watcher.v1.WatcherService"]``.
    ``own_connection``: the channel connects on its own. By default gRPC shares a connection
    (a subchannel) among the process's channels with the same target and options, and with
    it the reconnect backoff one of them entered while the peer was down: a new channel to a
    peer that is back would wait that out too.
    """
    config = retry_service_config(retry_services, SERVICE_RETRY) if retry_services else None
    options = channel_options(config)
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    return grpc.aio.insecure_channel(
        target, options=options, interceptors=client_interceptors(caller)
    )
