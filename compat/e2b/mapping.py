"""E2B's sandbox model on dsec's, both ways; no I/O here.

- template id/alias -> a dsec environment or image (configurable aliases; anything else is
  tried as an image name as it is, so an unknown one is dsec's ImageNotFound -> 404) and the
  backend it runs on (configurable too: ``desktop`` -> ``vm``; the others dsec's default);
- metadata -> sandbox labels (keys under ``e2b.`` are ours: the template and the resources
  asked for, so GET and list can answer statelessly; they never show up as metadata);
- timeout -> TTL, envVars -> env, network -> a dsec NetworkPolicy;
- SandboxInfo -> E2B's Sandbox / SandboxDetail / ListedSandbox JSON.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl

from compat.config import CompatConfig
from compat.e2b.http import HttpError
from compat.e2b.routing import envd_token
from libdsec import NetworkPolicy, SandboxInfo, SandboxMetric

#: The envd version dsec reports: the SDK turns features on by version
#: (e2b/envd/versions.py, SDK 2.45.1 to 2.63). 0.6.4 = every gate there, each done here:
#: recursive watch (0.1.4), metrics (0.1.5, disk 0.2.4), stdin (0.3.0), default user
#: (0.4.0), close stdin (0.5.2), octet-stream uploads (0.5.7), file metadata (0.6.2,
#: xattrs), entry info in watch events (0.6.3), network-mount watches (0.6.4). A newer
#: SDK's gate above 0.6.4 is not crossed until its feature is done.
ENVD_VERSION = "0.6.4"

LABEL_TEMPLATE = "e2b.template"
LABEL_CPU = "e2b.cpu"
#: The account E2B gives sudo without a password (and runs commands as, in its base template).
E2B_USER = "user"
#: The user a sandbox's commands and file operations run as when the SDK names none.
LABEL_USER = "e2b.user"
LABEL_MEMORY = "e2b.memory_mb"
#: The working directory of a sandbox's commands when the SDK names none (a built template's).
LABEL_WORKDIR = "e2b.workdir"
RESERVED_PREFIX = "e2b."

#: dsec's label limits (the API server checks them too; here to name the metadata key).
MAX_KEY = 63
MAX_VALUE = 255


@dataclass(frozen=True)
class TemplateTarget:
    """What an E2B template is in dsec: an image (or environment) on a backend."""

    image: str
    backend: str  # "" = dsec's default backend (containers)


def target_for(template: str, config: CompatConfig) -> TemplateTarget:
    """``DSEC_COMPAT_TEMPLATES`` (the image; unlisted: the template's name as it is) and
    ``DSEC_COMPAT_TEMPLATE_BACKENDS`` (the backend; unlisted: the default) of ``template``."""
    if not template:
        raise HttpError(400, "templateID is required")
    return TemplateTarget(
        config.templates.get(template, template), config.template_backends.get(template, "")
    )


def labels_for(metadata: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise HttpError(400, "metadata must be an object of strings")
    out: dict[str, str] = {}
    for k, v in metadata.items():
        if not isinstance(v, str):
            raise HttpError(400, f"metadata {k!r}: values must be strings")
        if k.startswith(RESERVED_PREFIX):
            raise HttpError(400, f"metadata {k!r}: keys starting with 'e2b.' are reserved")
        if not k or len(k) > MAX_KEY:
            raise HttpError(400, f"metadata {k!r}: dsec keeps keys of 1..{MAX_KEY} characters")
        if len(v) > MAX_VALUE:
            raise HttpError(
                400, f"metadata {k!r}: dsec keeps values of at most {MAX_VALUE} characters"
            )
        out[k] = v
    return out


def metadata_of(info: SandboxInfo) -> dict[str, str]:
    return {k: v for k, v in info.labels.items() if not k.startswith(RESERVED_PREFIX)}


def env_for(env_vars: Any) -> dict[str, str]:
    if env_vars is None:
        return {}
    if not isinstance(env_vars, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()
    ):
        raise HttpError(400, "envVars must be an object of strings")
    return dict(env_vars)


def timeout_for(body: Mapping[str, Any], config: CompatConfig) -> int:
    timeout = body.get("timeout")
    if timeout is None:
        return config.default_timeout_s
    if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
        raise HttpError(400, "timeout must be a non-negative integer (seconds)")
    # dsec has no "no TTL"; E2B's 0 is not documented as one either: take the default.
    return timeout or config.default_timeout_s


def network_for(body: Mapping[str, Any], config: CompatConfig) -> NetworkPolicy | None:
    """E2B's egress settings as a dsec policy; None = dsec's default (no network)."""
    internet = body.get("allow_internet_access")
    network = body.get("network") or {}
    if not isinstance(network, dict):
        raise HttpError(400, "network must be an object")
    public = network.get("allowPublicTraffic")
    if public is not None and not isinstance(public, bool):
        raise HttpError(400, "network.allowPublicTraffic must be a boolean")
    # true is E2B's default (SDKs <= 2.50 send it with any network= option), so it is taken,
    # but it changes nothing: dsec never serves a sandbox port without the traffic access
    # token (compat.e2b.ports), whatever this says.
    for key in ("egressProxy", "rules", "maskRequestHost"):
        if network.get(key):
            raise HttpError(400, f"network.{key} is not supported by dsec")
    allow = list(network.get("allowOut") or [])
    deny = list(network.get("denyOut") or [])
    if internet is False:
        return NetworkPolicy(allow=allow, deny=deny) if allow else NetworkPolicy()
    if allow and internet is None:
        return NetworkPolicy(allow=allow, deny=deny)
    if internet is True or deny or config.default_network == "open":
        # E2B: allowOut entries take precedence over denyOut; dsec: deny wins. With the
        # internet open an allow entry adds nothing, so only the denials are kept.
        return NetworkPolicy(open=True, deny=[d for d in deny if d not in allow])
    return None


def state_of(info: SandboxInfo) -> str:
    return "paused" if info.state == "PAUSED" else "running"


def _time(dt: datetime | None) -> str:
    """RFC 3339 in UTC with microseconds (fixed width: also the list's sort key)."""
    return (dt or datetime.fromtimestamp(0, UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _int_label(info: SandboxInfo, key: str) -> int:
    try:
        return int(float(info.labels.get(key, "0")))
    except ValueError:
        return 0


def template_of(info: SandboxInfo) -> str:
    return info.labels.get(LABEL_TEMPLATE) or info.image


def sandbox_json(info: SandboxInfo, key: str, config: CompatConfig) -> dict[str, Any]:
    """E2B's ``Sandbox`` (what create and connect return)."""
    template = template_of(info)
    return {
        "templateID": template,
        "alias": template,
        "sandboxID": info.id,
        "clientID": info.edge_id or "dsec",
        "envdVersion": ENVD_VERSION,
        # The caller's own key (for envd bound to this sandbox): see routing.
        "envdAccessToken": envd_token(key, info.id),
        "trafficAccessToken": key,
        "domain": config.domain or None,
    }


def listed_json(info: SandboxInfo) -> dict[str, Any]:
    """E2B's ``ListedSandbox``."""
    template = template_of(info)
    return {
        "templateID": template,
        "alias": template,
        "sandboxID": info.id,
        "clientID": info.edge_id or "dsec",
        "startedAt": _time(info.created_at),
        "endAt": _time(info.expires_at),
        # Known for sandboxes made through this front end (labels); 0 = not known.
        "cpuCount": _int_label(info, LABEL_CPU),
        "memoryMB": _int_label(info, LABEL_MEMORY),
        "diskSizeMB": 0,
        "metadata": metadata_of(info),
        "state": state_of(info),
        "envdVersion": ENVD_VERSION,
    }


def detail_json(info: SandboxInfo, key: str, config: CompatConfig) -> dict[str, Any]:
    """E2B's ``SandboxDetail`` (GET /sandboxes/{id})."""
    return {
        **listed_json(info),
        "envdAccessToken": envd_token(key, info.id),
        "domain": config.domain or None,
    }


# ---------------------------------------------------------------------------- list


@dataclass(frozen=True)
class ListQuery:
    metadata: dict[str, str]
    states: tuple[str, ...]  # dsec states: RUNNING, PAUSED
    template: str
    started_after: datetime | None
    descending: bool
    limit: int
    cursor: tuple[str, str] | None  # (startedAt iso, sandbox id) of the last item sent


def parse_metadata_query(text: str | None) -> dict[str, str]:
    """``metadata=user%3Dabc%26app%3Dprod`` (the SDK URL-encodes keys and values twice)."""
    if not text:
        return {}
    return dict(parse_qsl(text, keep_blank_values=True))


def page_limit(limit: str | None) -> int:
    """A list's ``limit`` query parameter: 1..100, default 100; else 400."""
    try:
        n = int(limit) if limit else 100
    except ValueError:
        raise HttpError(400, f"limit {limit!r} is not an integer") from None
    if not 1 <= n <= 100:
        raise HttpError(400, "limit must be in 1..100")
    return n


def parse_list_query(
    *,
    metadata: str | None,
    states: Sequence[str],
    template: str | None,
    started_after: str | None,
    order: str | None,
    limit: str | None,
    next_token: str | None,
) -> ListQuery:
    wanted: list[str] = []
    for part in ",".join(states).split(","):
        part = part.strip()
        if not part:
            continue
        if part not in ("running", "paused"):
            raise HttpError(400, f"state {part!r}: expected running or paused")
        wanted.append(part.upper())
    after = None
    if started_after:
        try:
            after = datetime.fromisoformat(started_after.replace("Z", "+00:00"))
        except ValueError:
            raise HttpError(400, f"startedAfter {started_after!r} is not a date-time") from None
        if after.tzinfo is None:
            after = after.replace(tzinfo=UTC)
    if order not in (None, "", "asc", "desc"):
        raise HttpError(400, f"order {order!r}: expected asc or desc")
    n = page_limit(limit)
    cursor = None
    if next_token:
        try:
            started, _, sid = base64.urlsafe_b64decode(next_token.encode()).decode().partition("|")
        except (binascii.Error, UnicodeDecodeError):
            raise HttpError(400, "nextToken is not one this API returned") from None
        if not sid:
            raise HttpError(400, "nextToken is not one this API returned")
        cursor = (started, sid)
    return ListQuery(
        metadata=parse_metadata_query(metadata),
        states=tuple(wanted) or ("RUNNING", "PAUSED"),
        template=template or "",
        started_after=after,
        descending=order != "asc",
        limit=n,
        cursor=cursor,
    )


def page(infos: Sequence[SandboxInfo], q: ListQuery) -> tuple[list[SandboxInfo], str, int]:
    """One page in start-time order, the token of the next ("" if none), and how many
    matching sandboxes are running. Stateless: the token is the last item's sort key."""
    chosen = [
        i
        for i in infos
        if i.state in q.states
        and (not q.template or template_of(i) == q.template)
        and (q.started_after is None or (i.created_at and i.created_at >= q.started_after))
    ]
    running = sum(1 for i in chosen if i.state == "RUNNING")
    chosen.sort(key=lambda i: (_time(i.created_at), i.id), reverse=q.descending)
    if q.cursor is not None:
        c = q.cursor
        chosen = [
            i
            for i in chosen
            if (
                (_time(i.created_at), i.id) < c if q.descending else (_time(i.created_at), i.id) > c
            )
        ]
    out = chosen[: q.limit]
    token = ""
    if len(chosen) > q.limit:
        last = out[-1]
        token = base64.urlsafe_b64encode(f"{_time(last.created_at)}|{last.id}".encode()).decode()
    return out, token, running


#: Unix time of 10000-01-01: later does not fit a datetime (nor a protobuf Timestamp).
_YEAR_10000 = 253402300800
#: Sandboxes one ``GET /sandboxes/metrics`` may name.
MAX_METRICS_SANDBOXES = 100


def unix_seconds(text: str | None, name: str) -> int | None:
    """A query parameter of Unix seconds (E2B's metrics window); None when absent."""
    if text is None or text == "":
        return None
    try:
        value = int(text)
    except ValueError:
        raise HttpError(400, f"{name} must be Unix seconds (an integer), got {text!r}") from None
    if not 0 <= value < _YEAR_10000:
        raise HttpError(
            400, f"{name} is out of range (Unix seconds before the year 10000): {value}"
        )
    return value


def metric_json(m: SandboxMetric) -> dict[str, Any]:
    """A dsec sample as E2B's SandboxMetric."""
    return {
        "timestamp": m.at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        "timestampUnix": int(m.at.timestamp()),
        "cpuCount": max(1, round(m.cpu_count)),
        "cpuUsedPct": m.cpu_used_pct,
        "memUsed": m.mem_used_bytes,
        "memTotal": m.mem_total_bytes,
        "memCache": m.mem_cache_bytes,
        "diskUsed": m.disk_used_bytes,
        "diskTotal": m.disk_total_bytes,
    }


@dataclass(frozen=True)
class AutoPause:
    """E2B's autoPause, autoPauseMemory and autoResume as dsec's spec fields."""

    pause: bool  # pause_at_ttl
    files_only: bool  # pause_at_ttl_files_only
    manual_resume: bool


def auto_pause_of(body: Mapping[str, Any]) -> AutoPause:
    """E2B's ``autoPause`` is dsec's ``pause_at_ttl``; ``autoPauseMemory: false`` makes that
    pause keep the files only (``pause_at_ttl_files_only``: the resume boots it afresh),
    which, as in E2B, only an explicit resume (connect) brings back; ``autoResume.enabled:
    false`` is ``manual_resume`` (a call into the paused sandbox does not resume it). Both
    with ``autoResume.enabled: true`` is a contradiction: 400."""
    auto_pause = body.get("autoPause", False)
    if not isinstance(auto_pause, bool):
        raise HttpError(400, "autoPause must be a boolean")
    memory = body.get("autoPauseMemory", True)
    if not isinstance(memory, bool):
        raise HttpError(400, "autoPauseMemory must be a boolean")
    resume = body.get("autoResume")
    enabled: bool | None = None
    if resume is not None:
        if not isinstance(resume, dict) or not isinstance(resume.get("enabled", True), bool):
            raise HttpError(400, "autoResume must be an object {enabled: boolean}")
        enabled = resume.get("enabled", True)
    files_only = auto_pause and not memory
    if files_only and enabled:
        raise HttpError(
            400,
            "autoPauseMemory=false with autoResume.enabled=true: a filesystem-only pause is "
            "resumed by a connect only",
        )
    return AutoPause(
        pause=auto_pause, files_only=files_only, manual_resume=files_only or enabled is False
    )
