"""Typed service configuration read once from ``DSEC_<SVC>_*`` variables.

Each service declares a frozen dataclass whose fields have defaults;
:func:`load` fills it from the environment, converting by annotation, and
raises :class:`ConfigError` naming the variable on a bad value::

    @dataclass(frozen=True)
    class IamConfig(ServiceConfig):
        database: str = "sqlite:///var/lib/dsec/iam.db"

    cfg = load(IamConfig, "IAM")      # reads DSEC_IAM_LISTEN, DSEC_IAM_DATABASE, ...
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

#: For this long after the watcher (re)starts it may not know every edge yet: edges register
#: again every few seconds (the watcher's `reregister_interval_s`, 5 s). The API server and
#: placement both treat "no edge" as "not yet" (UNAVAILABLE, retried) meanwhile.
WATCHER_WARMUP_S = 15.0


class ConfigError(ValueError):
    """A configuration variable is missing or malformed."""


@dataclass(frozen=True)
class ServiceConfig:
    """Fields every service has."""

    #: gRPC listen address: "host:port" or "unix:/path/to.sock".
    listen: str = "127.0.0.1:0"
    #: DEBUG, INFO, WARNING, ERROR.
    log_level: str = "INFO"
    #: "json" (one object per line) or "text".
    log_format: str = "json"
    #: OTLP/gRPC endpoint for traces, e.g. "localhost:4317"; "" = no exporter.
    otlp_endpoint: str = ""
    #: "on": the service measures itself (common/metrics.py); "off": every instrument is a
    #: no-op (what the metrics cost is measured against it: bench/bench_observability.py).
    metrics: str = "on"
    #: Prometheus endpoint: "host:port" serving GET /metrics (port 0: any free one, logged);
    #: "" = none.
    metrics_addr: str = ""
    #: Seconds between OTLP metric pushes to ``otlp_endpoint``; 0 = metrics over OTLP off.
    otlp_metrics_interval_s: float = 0.0
    #: Of the traces this service starts (a front door's calls that arrive without a trace
    #: context), the fraction recorded: 1.0 = all. A caller's own decision is always kept.
    trace_sample_ratio: float = 1.0
    #: Seconds in-flight calls get to finish on SIGTERM.
    shutdown_grace_s: float = 5.0

    def validate(self) -> None:
        if self.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ConfigError(
                f"log_level must be DEBUG, INFO, WARNING or ERROR, not {self.log_level!r}"
            )
        if self.log_format not in {"json", "text"}:
            raise ConfigError(f"log_format must be json or text, not {self.log_format!r}")
        if not self.listen:
            raise ConfigError("listen must not be empty")
        if self.shutdown_grace_s < 0:
            raise ConfigError("shutdown_grace_s must be >= 0")
        if not 0.0 <= self.trace_sample_ratio <= 1.0:  # NaN too
            raise ConfigError("trace_sample_ratio must be between 0 and 1")
        if self.metrics not in ("on", "off"):
            raise ConfigError(f"metrics must be on or off, not {self.metrics!r}")
        if self.metrics == "off" and (self.metrics_addr or self.otlp_metrics_interval_s):
            raise ConfigError("metrics is off: metrics_addr and otlp_metrics_interval_s need it on")
        if self.metrics_addr and not _host_port(self.metrics_addr):
            raise ConfigError(f"metrics_addr must be host:port, not {self.metrics_addr!r}")
        if self.otlp_metrics_interval_s < 0:
            raise ConfigError("otlp_metrics_interval_s must be >= 0")
        if self.otlp_metrics_interval_s and not self.otlp_endpoint:
            raise ConfigError("otlp_metrics_interval_s needs otlp_endpoint (where to push)")


def _host_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and int(port) < 65536)


C = TypeVar("C", bound=ServiceConfig)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(raw: str, typ: Any, var: str) -> Any:
    origin = typing.get_origin(typ)
    if origin is typing.Union or origin is getattr(__import__("types"), "UnionType", None):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if raw == "":
            return None
        return _convert(raw, args[0], var)
    if typ is bool:
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"{var}={raw!r}: expected a boolean (true/false/1/0)")
    if typ is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{var}={raw!r}: expected an integer") from None
    if typ is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{var}={raw!r}: expected a number") from None
    if typ is Path:
        return Path(raw).expanduser()
    if origin is tuple:
        (item,) = {a for a in typing.get_args(typ) if a is not Ellipsis}
        return tuple(_convert(p.strip(), item, var) for p in raw.split(",") if p.strip())
    if origin is dict:
        out: dict[str, str] = {}
        for part in raw.split(","):
            if not part.strip():
                continue
            if "=" not in part:
                raise ConfigError(f"{var}={raw!r}: expected key=value[,key=value]")
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip()
        return out
    return raw


def load(cls: type[C], service: str, environ: Mapping[str, str] | None = None) -> C:
    """Builds ``cls`` from ``DSEC_<SERVICE>_<FIELD>`` variables, then validates it."""
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        var = f"DSEC_{service.upper()}_{field.name.upper()}"
        if var in env:
            values[field.name] = _convert(env[var], hints[field.name], var)
    try:
        cfg = cls(**values)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None
    cfg.validate()
    return cfg


def env_names(cls: type[ServiceConfig], service: str) -> list[str]:
    """The variables a config class reads (for --help and docs)."""
    return [f"DSEC_{service.upper()}_{f.name.upper()}" for f in dataclasses.fields(cls)]
