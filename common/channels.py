"""Outbound gRPC channels between services.

Every channel gets keepalives (a dead peer is noticed within seconds, not at
the next TCP timeout), the tracing client interceptors, and a retry policy for
UNAVAILABLE on methods the caller marks idempotent (grpc's service config).
Every call still needs its own deadline: use :data:`DEFAULT_DEADLINE_S`.
"""

from __future__ import annotations

import json

import grpc

from common.telemetry import client_interceptors

DEFAULT_DEADLINE_S = 10.0

CHANNEL_OPTIONS: list[tuple[str, str | int]] = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 1),
]


def retry_service_config(services: list[str]) -> str:
    """Retries UNAVAILABLE up to 4 attempts with backoff for the given services."""
    return json.dumps(
        {
            "methodConfig": [
                {
                    "name": [{"service": s} for s in services],
                    "retryPolicy": {
                        "maxAttempts": 4,
                        "initialBackoff": "0.05s",
                        "maxBackoff": "1s",
                        "backoffMultiplier": 2,
                        "retryableStatusCodes": ["UNAVAILABLE"],
                    },
                }
            ]
        }
    )


def open_channel(
    target: str, caller: str, *, retry_services: list[str] | None = None
) -> grpc.aio.Channel:
    """An insecure channel to another dsec service (cluster-internal traffic).

    ``retry_services`` lists fully-qualified services whose every method is
    idempotent, e.g. ``["dsec.watcher.v1.WatcherService"]``.
    """
    options: list[tuple[str, str | int]] = list(CHANNEL_OPTIONS)
    if retry_services:
        options.append(("grpc.service_config", retry_service_config(retry_services)))
    return grpc.aio.insecure_channel(
        target, options=options, interceptors=client_interceptors(caller)
    )
