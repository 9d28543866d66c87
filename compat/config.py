"""Compatibility front end configuration (DSEC_COMPAT_*)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.config import ConfigError, ServiceConfig

MIB = 1024 * 1024


def _default_templates() -> dict[str, str]:
    # E2B's default template is "base" (Debian with bash); bookworm is dsec's Debian image.
    return {"base": "bookworm"}


@dataclass(frozen=True)
class CompatConfig(ServiceConfig):
    #: HTTP/1.1 listen address, host:port (the e2b SDK needs a URL, so no Unix sockets).
    listen: str = "127.0.0.1:7130"
    #: The API server this front end is a client of (libdsec target).
    apiserver: str = "127.0.0.1:7100"
    #: TLS: both set = HTTPS on the same listener.
    tls_cert: str = ""
    tls_key: str = ""
    #: E2B template id/alias -> dsec environment or image ("base=bookworm,py=python").
    #: A template not listed is tried as a dsec image name as it is.
    templates: dict[str, str] = field(default_factory=_default_templates)
    #: Sandbox timeout (TTL) when a create gives none; E2B's SDK documents 300 s.
    default_timeout_s: int = 300
    #: Resources of a sandbox created through E2B (E2B templates fix them; dsec asks).
    cpu: float = 1.0
    memory_mb: int = 512
    #: "none" (dsec's default: no network unless asked) or "open" (E2B's default:
    #: internet on) for a create that says nothing about the network.
    default_network: str = "none"
    #: Returned as the sandbox `domain`; port traffic uses Host {port}-{sandboxID}.{domain}.
    domain: str = ""
    #: Output of one E2B command kept and streamed, per stream (dsec caps it; head+tail).
    max_output_bytes: int = 16 * MIB
    #: The user commands and file operations run as when the SDK names none.
    default_user: str = "root"
    #: At most this many callers' libdsec clients are kept (LRU); each caller's token is
    #: checked against the API server again after token_check_ttl_s.
    clients_max: int = 256
    token_check_ttl_s: float = 30.0
    #: Largest JSON body of a control-API request.
    max_json_bytes: int = 1 * MIB
    #: Largest request or response body forwarded into a port of a sandbox.
    max_port_body_bytes: int = 16 * MIB

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    def validate(self) -> None:
        super().validate()
        if self.listen.startswith("unix:") or ":" not in self.listen:
            raise ConfigError("DSEC_COMPAT_LISTEN must be host:port (HTTP clients need a URL)")
        try:
            self.port  # noqa: B018
        except ValueError:
            raise ConfigError(f"DSEC_COMPAT_LISTEN={self.listen!r}: bad port") from None
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("DSEC_COMPAT_TLS_CERT and DSEC_COMPAT_TLS_KEY go together")
        if self.default_network not in {"none", "open"}:
            raise ConfigError("DSEC_COMPAT_DEFAULT_NETWORK must be none or open")
        if self.default_timeout_s < 1 or self.clients_max < 1 or self.token_check_ttl_s < 0:
            raise ConfigError("timeouts and cache sizes must be positive")
