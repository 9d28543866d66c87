"""Compatibility front end configuration (DSEC_COMPAT_*)."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import get_args

from common.config import ConfigError, ServiceConfig
from common.vip import VipConfig
from libdsec.options import Backend

MIB = 1024 * 1024
#: A user name (or numeric uid) as the sandbox's /etc/passwd holds it.
_USER_NAME = re.compile(r"[a-z_][a-z0-9_.-]{0,31}|[0-9]{1,10}")


def _default_templates() -> dict[str, str]:
    # E2B's default template is "base": dsec's e2b-base image has what E2B's has (Debian
    # with bash, sudo, curl, git, python, pip, build tools) and its account `user`
    # (scripts/build-base-images.sh). e2b-desktop's default template is "desktop": dsec's
    # desktop VM image (Xfce, xdotool, x11vnc and noVNC: what that SDK runs inside),
    # scripts/build-vm-images.sh.
    return {"base": "e2b-base", "desktop": "desktop"}


def _default_template_users() -> dict[str, str]:
    # E2B runs commands and file operations as `user` (home /home/user, sudo without a
    # password) unless root is asked for; dsec's own images have root only.
    return {"base": "user"}


def _default_template_backends() -> dict[str, str]:
    # The desktop image is a disk of a full VM: only the vm backend boots it.
    return {"desktop": "vm"}


def _default_sizes() -> dict[str, str]:
    # What a create may name beside a metadata-routed image (slime's "sm"/"md"/"lg"/"xl").
    return {"sm": "1:1024", "md": "2:2048", "lg": "4:4096", "xl": "8:8192"}


def _default_template_memory() -> dict[str, str]:
    # A desktop (Xorg, Xfce, a browser when an agent opens one) does not fit in 512 MB.
    return {"desktop": "1536"}


@dataclass(frozen=True)
class CompatConfig(ServiceConfig, VipConfig):
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
    #: E2B template id/alias -> the dsec backend its sandboxes run on ("desktop=vm"); a
    #: template not listed runs on dsec's default backend (containers).
    template_backends: dict[str, str] = field(default_factory=_default_template_backends)
    #: Sandbox timeout (TTL) when a create gives none; E2B's SDK documents 300 s.
    default_timeout_s: int = 300
    #: Resources of a sandbox created through E2B (E2B templates fix them; dsec asks).
    cpu: float = 1.0
    memory_mb: int = 512
    #: E2B template -> its sandboxes' memory in MB when it is not `memory_mb`
    #: ("desktop=1536"): E2B fixes resources per template.
    template_memory_mb: dict[str, str] = field(default_factory=_default_template_memory)
    #: "none" (dsec's default: no network unless asked) or "open" (E2B's default:
    #: internet on) for a create that says nothing about the network.
    default_network: str = "none"
    #: Returned as the sandbox `domain`; port traffic uses Host {port}-{sandboxID}.{domain}.
    domain: str = ""
    #: Output of one E2B command kept and streamed, per stream (dsec caps it; head+tail).
    max_output_bytes: int = 16 * MIB
    #: E2B template -> the user its sandboxes' commands and file operations run as when the
    #: SDK names none ("base=user"; the account must exist in the template's image).
    template_users: dict[str, str] = field(default_factory=_default_template_users)
    #: ... for a template not listed there.
    default_user: str = "root"
    #: At most this many callers' libdsec clients are kept (LRU); each caller's token is
    #: checked against the API server again after token_check_ttl_s.
    clients_max: int = 256
    token_check_ttl_s: float = 30.0
    #: Largest JSON body of a control-API request.
    max_json_bytes: int = 1 * MIB
    #: Largest request or response body forwarded into a port of a sandbox.
    max_port_body_bytes: int = 16 * MIB
    #: Largest envd upload (``POST /files``), counted after its Content-Encoding is decoded
    #: (all the files of a multipart body together), so a small gzip body cannot inflate
    #: past it: 413. The default is the edge's default sandbox disk (10 GiB), which a
    #: default sandbox fills first anyway (then 507).
    max_upload_bytes: int = 10240 * MIB

    #: A create whose metadata has this key runs that image instead of its template's
    #: (slime's SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY names the key of "your E2B
    #: gateway"): a dsec environment of that name, else the cluster's Docker engine's image
    #: (imported; pulled first when the engine can). "" = metadata never names an image.
    image_metadata_key: str = "dsec/image"
    #: Sizes such a create may name under "<the image key's prefix>/size" (dsec/size):
    #: name -> cpus:memory_mb.
    sizes: dict[str, str] = field(default_factory=_default_sizes)

    # ---- E2B template builds (compat.e2b.templates)
    #: Where uploaded COPY archives are kept, one directory per project.
    template_files_dir: str = "/var/tmp/dsec-e2b-template-files"
    #: At most this much per project there (the least recently used archives go first).
    template_files_max_bytes: int = 4096 * MIB
    #: The largest archive one COPY may upload (413 beyond).
    template_file_max_bytes: int = 1024 * MIB
    #: Signs the upload URLs handed out; "" = a random one per process (set one shared by
    #: front ends behind one virtual IP).
    template_upload_secret: str = ""
    #: A build's sandbox ends after this (the whole build's bound).
    template_build_timeout_s: int = 3600
    #: One RUN (or COPY) step's bound.
    template_step_timeout_s: int = 1800
    #: How long a build waits for the template's ready command to succeed.
    template_ready_timeout_s: int = 300
    #: How long a create from a template with a start command waits for its ready command.
    template_create_ready_timeout_s: int = 60

    # ---- SandboxFusion front end (compat.sandboxfusion): its own listener, same process.
    #: host:port of SandboxFusion's code-execution API; "" = not served.
    sandbox_fusion_listen: str = "127.0.0.1:7131"
    #: A file holding the dsec token used for requests that carry none (no /t/<token>/
    #: prefix, no Authorization header): the listener acts as that token's project. Only
    #: with a loopback listener (anyone who reaches the port gets the project).
    sandbox_fusion_token_file: str = ""
    #: Memory of a job that asks for none (the reference's memory_limit_MB=-1 means "no
    #: limit"; dsec always has one), and the most a job may ask for (FnCall's own bound).
    sandbox_fusion_memory_mb: int = 1024
    sandbox_fusion_max_memory_mb: int = 4096
    #: Output kept per stream of a job (FnCall's limit; past it the job is stopped).
    sandbox_fusion_max_output_bytes: int = 1 * MIB
    #: Code and decoded files of one request together (FnCall's limit is 16 MiB).
    sandbox_fusion_max_files_bytes: int = 16 * MIB
    #: Largest request body (base64 files and stdin included).
    sandbox_fusion_max_body_bytes: int = 64 * MIB
    #: Most cases of one /run_code_batch request.
    sandbox_fusion_max_batch: int = 10_000

    # ---- SWE-ReX front end (compat.swe_rex): its own listener, same process.
    #: host:port of SWE-ReX's remote-runtime API; "" (default) = not served. Needs the
    #: ``swerex`` extra (swe-rex), which the rest of compat does not.
    swerex_listen: str = ""
    #: Largest JSON body of a call (write_file carries the file's content in it).
    swerex_max_body_bytes: int = 64 * MIB
    #: Largest /upload request (the file, or a directory zipped by RemoteRuntime, with the
    #: form around it), counted as it streams in.
    swerex_max_upload_bytes: int = 1024 * MIB

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    @property
    def sandbox_fusion_host(self) -> str:
        return self.sandbox_fusion_listen.rsplit(":", 1)[0].strip("[]")

    @property
    def sandbox_fusion_port(self) -> int:
        return int(self.sandbox_fusion_listen.rsplit(":", 1)[1])

    @property
    def swerex_host(self) -> str:
        return self.swerex_listen.rsplit(":", 1)[0].strip("[]")

    @property
    def swerex_port(self) -> int:
        return int(self.swerex_listen.rsplit(":", 1)[1])

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
        self.validate_vip(self.listen)
        if self.vip and self.sandbox_fusion_listen:
            self.validate_vip(self.sandbox_fusion_listen)
        backends = get_args(Backend)
        for template, backend in self.template_backends.items():
            if backend not in backends:
                raise ConfigError(
                    f"DSEC_COMPAT_TEMPLATE_BACKENDS: template {template!r} names backend "
                    f"{backend!r}; dsec's backends are {', '.join(backends)}"
                )
        for template, mb in self.template_memory_mb.items():
            if not mb.isdigit() or not 16 <= int(mb) <= 1 << 20:
                raise ConfigError(
                    f"DSEC_COMPAT_TEMPLATE_MEMORY_MB: template {template!r}: {mb!r} is not a "
                    "size in MB"
                )
        for template, user in {**self.template_users, "": self.default_user}.items():
            if not _USER_NAME.fullmatch(user):
                where = f"template {template!r}" if template else "DSEC_COMPAT_DEFAULT_USER"
                raise ConfigError(
                    f"DSEC_COMPAT_TEMPLATE_USERS: {where}: {user!r} is not a user name"
                )
        for size, spec in self.sizes.items():
            cpus, _, mb = spec.partition(":")
            try:
                ok = 0 < float(cpus) <= 1024 and mb.isdigit() and 16 <= int(mb) <= 1 << 22
            except ValueError:
                ok = False
            if not ok:
                raise ConfigError(
                    f"DSEC_COMPAT_SIZES: size {size!r}: {spec!r} is not cpus:memory_mb"
                )
        if self.default_network not in {"none", "open"}:
            raise ConfigError("DSEC_COMPAT_DEFAULT_NETWORK must be none or open")
        if self.default_timeout_s < 1 or self.clients_max < 1 or self.token_check_ttl_s < 0:
            raise ConfigError("timeouts and cache sizes must be positive")
        if min(self.max_json_bytes, self.max_port_body_bytes, self.max_upload_bytes) < 1:
            raise ConfigError("DSEC_COMPAT_MAX_*_BYTES must be positive")
        if self.sandbox_fusion_listen:
            self._validate_sandbox_fusion()
        if self.swerex_listen:
            self._validate_swerex()

    def user_for(self, template: str) -> str:
        """The default user of a sandbox of E2B template `template`."""
        return self.template_users.get(template, self.default_user)

    @property
    def size_metadata_key(self) -> str:
        """Where a routed create names its size: beside the image key (slime's rule)."""
        prefix, slash, _ = self.image_metadata_key.rpartition("/")
        return f"{prefix}/size" if slash else "size"

    def size_of(self, name: str) -> tuple[float, int]:
        """(cpus, memory MB) of size ``name``; KeyError if there is none."""
        cpus, _, mb = self.sizes[name].partition(":")
        return float(cpus), int(mb)

    def memory_for(self, template: str) -> int:
        """The memory (MB) of a sandbox of E2B template `template`."""
        return int(self.template_memory_mb.get(template, self.memory_mb))

    def _validate_sandbox_fusion(self) -> None:
        name = "DSEC_COMPAT_SANDBOX_FUSION_LISTEN"
        if ":" not in self.sandbox_fusion_listen:
            raise ConfigError(f"{name} must be host:port (or empty: not served)")
        try:
            port = self.sandbox_fusion_port
        except ValueError:
            raise ConfigError(f"{name}={self.sandbox_fusion_listen!r}: bad port") from None
        if port == self.port and port != 0:
            raise ConfigError(f"{name} must differ from DSEC_COMPAT_LISTEN")
        if self.sandbox_fusion_token_file and not _loopback(self.sandbox_fusion_host):
            # Fail closed: a token for anonymous callers on a reachable port is an open door.
            raise ConfigError(
                "DSEC_COMPAT_SANDBOX_FUSION_TOKEN_FILE needs a loopback "
                f"{name} (127.0.0.0/8, ::1, localhost), not {self.sandbox_fusion_host!r}"
            )
        if not 16 <= self.sandbox_fusion_memory_mb <= self.sandbox_fusion_max_memory_mb:
            raise ConfigError(
                "DSEC_COMPAT_SANDBOX_FUSION_MEMORY_MB must be in "
                "16..DSEC_COMPAT_SANDBOX_FUSION_MAX_MEMORY_MB"
            )
        if (
            min(
                self.sandbox_fusion_max_output_bytes,
                self.sandbox_fusion_max_files_bytes,
                self.sandbox_fusion_max_body_bytes,
                self.sandbox_fusion_max_batch,
            )
            < 1
        ):
            raise ConfigError("DSEC_COMPAT_SANDBOX_FUSION_* sizes must be positive")

    def _validate_swerex(self) -> None:
        name = "DSEC_COMPAT_SWEREX_LISTEN"
        if ":" not in self.swerex_listen:
            raise ConfigError(f"{name} must be host:port (or empty: not served)")
        try:
            port = self.swerex_port
        except ValueError:
            raise ConfigError(f"{name}={self.swerex_listen!r}: bad port") from None
        taken = {self.port, self.sandbox_fusion_port if self.sandbox_fusion_listen else -1}
        if port in taken and port != 0:
            raise ConfigError(f"{name} must differ from the other listeners' ports")
        if min(self.swerex_max_body_bytes, self.swerex_max_upload_bytes) < 1:
            raise ConfigError("DSEC_COMPAT_SWEREX_MAX_*_BYTES must be positive")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
