"""E2B's template build API on dsec environments.

What the SDK's ``Template.build`` / ``AsyncTemplate.build`` call, and how each is done here:

- ``POST /v3/templates`` (name[:tag], tags, cpu, memory) -> a build id; the template id is
  the name. ``GET /templates/{id}/files/{hash}`` -> whether that COPY archive is cached and a
  signed URL to ``PUT`` it to (``/_dsec/e2b/template-files/{token}``). Archives are kept per
  project in a bounded cache directory (:class:`FileCache`).
- ``POST /v2/templates/{id}/builds/{buildID}`` (base, steps, start/ready commands) starts the
  build in the background: a container sandbox from the base (E2B's ``e2bdev/base`` and the
  ``base`` template -> dsec's ``e2b-base``; another template of this project -> its
  environment; any other image -> a dsec environment of that name, else the edge's Docker
  engine, which pulls it when it can), then RUN / COPY / ENV / WORKDIR / USER step by step and
  the start + ready commands, then ``pack_diff`` into the environment ``name:tag`` (E2B's
  default tag is ``default``), one more per extra tag. The environment's config carries the
  template: its user, workdir, env, start and ready commands, build id (``e2b.*``, ``env.*``,
  ``workdir``) and its owner project (``dsec.project``, set by the API server).
- ``GET /templates/{id}/builds/{buildID}/status?logsOffset=`` -> building | ready | error,
  log entries from the offset, the failing step and its output.
- ``GET /templates/aliases/{name}`` (exists), tags (``POST``/``DELETE /templates/tags``,
  ``GET /templates/{id}/tags``), ``DELETE /templates/{id}``.

State: a finished template is its environments (dsec-side: any front end behind the virtual
IP answers for it, and a restart loses nothing). A build under way and a failed build's logs
live in the front end that runs it, bounded (:data:`MAX_BUILDS`); after a restart a ready
build is still answered from its environment, one under way or failed is 404.

Templates are per project: environments are cluster-wide names, so a name another project
built is refused (409) at build and is 404 everywhere else.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse, Response

from compat.clients import ClientPool
from compat.config import CompatConfig
from compat.e2b.http import HttpError, Request, bounded, read_json
from libdsec import AsyncClient, AsyncSandbox, Environment, NetworkPolicy
from libdsec.errors import DSecError, ImageNotFound, NotFound

log = logging.getLogger(__name__)

#: Builds remembered by this front end (the oldest finished ones are forgotten first).
MAX_BUILDS = 1000
#: Log entries one status call returns when it asks for no limit (E2B's page).
LOG_PAGE = 100
#: Log entries kept per build (the first and the last ones: a step's output is capped too).
MAX_LOG_ENTRIES = 20_000
#: Output of one step kept in the logs, per stream.
STEP_OUTPUT_BYTES = 1024 * 1024

#: Environment config keys of a template (besides ``env.*`` and ``workdir``).
K_TEMPLATE = "e2b.template"
K_TAG = "e2b.tag"
K_BUILD = "e2b.build_id"
K_USER = "e2b.user"
K_START = "e2b.start_cmd"
K_READY = "e2b.ready_cmd"
K_CPU = "e2b.cpu"
K_MEMORY = "e2b.memory_mb"
K_OWNER = "dsec.project"
ENV_PREFIX = "env."
WORKDIR_KEY = "workdir"

DEFAULT_TAG = "default"
#: E2B's default base image and its dsec counterpart.
E2B_BASE_IMAGES = ("e2bdev/base", "e2bdev/base:latest", "docker.io/e2bdev/base")
#: E2B's default user of a template (created when the base lacks it).
TEMPLATE_USER = "user"
#: E2B's ready command when a start command has none: settle for 20 s.
DEFAULT_READY = "sleep 20"

_NAME = re.compile(r"[a-z0-9_-]+")
_TAG = re.compile(r"[a-z0-9_.-]+")
_HASH = re.compile(r"[0-9a-f]{64}")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def check_tag(tag: str) -> str:
    t = tag.strip().lower()
    if not _TAG.fullmatch(t) or _UUID.fullmatch(t):
        raise HttpError(
            400, f"invalid tag {tag!r}: a tag is [a-z0-9_.-]+ (and not a UUID), without ':'"
        )
    return t


def parse_name(text: str) -> tuple[str, str | None]:
    """E2B's ``name[:tag]`` -> (name, tag or None); 400 naming what is wrong."""
    name, sep, tag = text.strip().partition(":")
    name = name.lower()
    if not _NAME.fullmatch(name):
        raise HttpError(400, f"invalid template name {text!r}: a name is [a-z0-9_-]+")
    if sep:
        return name, check_tag(tag)
    return name, None


def env_name(name: str, tag: str | None) -> str:
    return f"{name}:{tag or DEFAULT_TAG}"


# ----------------------------------------------------------------------------- logs


@dataclass
class LogEntry:
    at: str
    level: str
    message: str
    step: str = ""

    def json(self) -> dict[str, Any]:
        out = {"timestamp": self.at, "level": self.level, "message": self.message}
        if self.step:
            out["step"] = self.step
        return out


@dataclass
class Build:
    build_id: str
    project: str
    name: str
    tags: list[str]  # the first is the one built; the others are assigned after
    cpu: int
    memory_mb: int
    status: str = "waiting"  # waiting (requested) -> building -> ready | error
    logs: list[LogEntry] = field(default_factory=list)
    reason: dict[str, Any] | None = None
    dropped_logs: int = 0
    task: asyncio.Task[None] | None = None

    def log(self, message: str, level: str = "info", step: str = "") -> None:
        if len(self.logs) >= MAX_LOG_ENTRIES:
            self.dropped_logs += 1
            return
        self.logs.append(LogEntry(now_iso(), level, message, step))

    def status_json(self, offset: int, limit: int, level: str) -> dict[str, Any]:
        order = ["debug", "info", "warn", "error"]
        entries = self.logs[offset : offset + limit]
        if level in order:
            entries = [e for e in entries if order.index(e.level) >= order.index(level)]
        out: dict[str, Any] = {
            "templateID": self.name,
            "buildID": self.build_id,
            "status": self.status,
            "logEntries": [e.json() for e in entries],
            "logs": [f"[{e.at}] {e.message}" for e in entries],
        }
        if self.reason is not None:
            out["reason"] = self.reason
        return out


class StepFailed(Exception):
    """A build step failed: the message E2B's SDK raises, the step (its index, "base" or
    "finalize") and the output that shows why."""

    def __init__(self, message: str, step: str, output: list[str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.step = step
        self.output = output or []


# ------------------------------------------------------------------------ file cache


class FileCache:
    """COPY archives by files hash, per project, in ``directory/<project>/<hash>``; at most
    ``max_bytes`` per project (the least recently used go first) and ``max_file_bytes`` per
    archive (413 beyond it). Upload URLs are signed (HMAC) with a secret: the configured one
    (shared by front ends behind one virtual IP), else one of this process."""

    def __init__(self, directory: str, max_bytes: int, max_file_bytes: int, secret: str) -> None:
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.max_file_bytes = max_file_bytes
        self.secret = (secret or secrets.token_hex(32)).encode()

    def path(self, project: str, files_hash: str) -> Path:
        return self.dir / _safe(project) / files_hash

    def present(self, project: str, files_hash: str) -> bool:
        p = self.path(project, files_hash)
        if p.is_file():
            with contextlib.suppress(OSError):
                os.utime(p)
            return True
        return False

    def token(self, project: str, files_hash: str, ttl_s: int = 3600) -> str:
        body = json.dumps({"p": project, "h": files_hash, "e": int(time.time()) + ttl_s})
        raw = base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")
        sig = hmac.new(self.secret, raw.encode(), hashlib.sha256).hexdigest()
        return f"{raw}.{sig}"

    def check(self, token: str) -> tuple[str, str]:
        raw, _, sig = token.partition(".")
        want = hmac.new(self.secret, raw.encode(), hashlib.sha256).hexdigest()
        if not sig or not hmac.compare_digest(sig, want):
            raise HttpError(403, "upload URL is not one this front end signed")
        try:
            body = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
            project, files_hash, expiry = str(body["p"]), str(body["h"]), int(body["e"])
        except (ValueError, KeyError, TypeError):
            raise HttpError(403, "upload URL is malformed") from None
        if expiry < time.time():
            raise HttpError(403, "upload URL has expired: ask for the files hash again")
        return project, files_hash

    async def store(self, project: str, files_hash: str, body: AsyncIterator[bytes]) -> int:
        dest = self.path(project, files_hash)
        await asyncio.to_thread(dest.parent.mkdir, parents=True, exist_ok=True)
        tmp = dest.with_name(f".{files_hash}.{secrets.token_hex(4)}")
        size = 0
        try:
            with open(tmp, "wb") as fh:
                async for chunk in bounded(body, self.max_file_bytes, "template files archive"):
                    size += len(chunk)
                    await asyncio.to_thread(fh.write, chunk)
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        await asyncio.to_thread(self._evict, dest.parent, dest)
        return size

    def _evict(self, directory: Path, keep: Path) -> None:
        files = []
        for p in directory.iterdir():
            with contextlib.suppress(OSError):
                st = p.stat()
                files.append((st.st_mtime, st.st_size, p))
        total = sum(s for _, s, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            if p == keep:
                continue
            with contextlib.suppress(OSError):
                p.unlink()
                total -= size


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text) or "_"


async def image_environment(client: AsyncClient, image: str) -> Environment:
    """The dsec environment of image ``image``: an environment of that name, else the
    Docker image of the cluster's engine, imported (the engine pulls it first when it can).
    NotFound naming both when neither has it."""
    with contextlib.suppress(ImageNotFound, NotFound):
        return await client.get_environment(image)
    try:
        return await client.import_image(f"docker:{image}")
    except DSecError as exc:
        raise NotFound(
            f"image {image!r} is neither a dsec environment nor an image the cluster's "
            f"Docker engine has or can pull: {exc.message}",
            reason="IMAGE_NOT_FOUND",
        ) from None


# --------------------------------------------------------------------------- builder


@dataclass
class Base:
    image: str  # the dsec environment the build starts from
    user: str  # its default user ("" = not known: E2B's `user`, created if missing)
    config: dict[str, str] = field(default_factory=dict)  # a template base's e2b.* config


@dataclass
class BuildState:
    user: str
    workdir: str = ""
    env: dict[str, str] = field(default_factory=dict)


# A COPY: the archive's entry `src` (unpacked under `unpack`) to `dest`, Docker's way: a
# directory is merged into dest; a file or symlink becomes dest, or goes inside it when dest
# ends in "/". Relative dest = relative to the workdir (else the user's home).
_COPY_SCRIPT = r"""
set -e
unpack="$1"; src="$2"; dest="$3"; owner="$4"; mode="$5"; workdir="$6"; user="$7"
if [ -z "$workdir" ]; then workdir=$(getent passwd "$user" | cut -d: -f6); fi
case "$dest" in /*) target="$dest" ;; *) target="${workdir:-/}/$dest" ;; esac
cd "$unpack"
if [ ! -e "$src" ] && [ ! -L "$src" ]; then echo "no such file or directory in the upload: $src" >&2; exit 1; fi
if [ -L "$src" ] || [ -f "$src" ]; then
  chown -h "$owner" "$src"
  if [ -n "$mode" ] && [ ! -L "$src" ]; then chmod "$mode" "$src"; fi
  case "$target" in */) mkdir -p "$target" ;; *) mkdir -p "$(dirname "$target")" ;; esac
  mv -f "$src" "$target"
elif [ -d "$src" ]; then
  chown -R "$owner" "$src"
  if [ -n "$mode" ]; then chmod -R "$mode" "$src"; fi
  mkdir -p "$target"
  (cd "$src" && tar -cf - .) | tar -xf - -C "$target" --keep-directory-symlink --no-overwrite-dir
else
  echo "not a file, directory or symlink: $src" >&2; exit 1
fi
"""

# WORKDIR: create what is missing, owned by the current user.
_WORKDIR_SCRIPT = r"""
set -e
target="$1"; owner="$2"
first=""; p="$target"
while [ ! -e "$p" ]; do first="$p"; p=$(dirname "$p"); done
if [ -n "$first" ]; then mkdir -p "$target"; chown -R "$owner" "$first"; fi
"""

# USER: the account, created when missing; its home its own (an image made with every file
# root's, as `mkfs.erofs --all-root` makes them, has the user's home root's).
_ENSURE_USER = r"""
if ! id -u "$1" >/dev/null 2>&1; then
  command -v useradd >/dev/null 2>&1 || exit 3
  useradd --create-home --shell /bin/bash "$1" || exit 1
fi
home=$(getent passwd "$1" | cut -d: -f6)
if [ "$1" != root ] && [ -d "$home" ] && [ "$(stat -c %u "$home")" = 0 ]; then
  chown "$1:" "$home"
fi
exit 0
"""


def _glob_base(src: str) -> str:
    """The part of a COPY source before its first glob (the SDK expands globs itself and
    archives paths relative to the context), without trailing slashes."""
    parts = []
    for part in src.split("/"):
        if any(c in part for c in "*?[{"):
            break
        parts.append(part)
    return "/".join(p for p in parts if p not in ("", ".")) or "."


def _tail(data: bytes, lines: int = 20) -> list[str]:
    text = data.decode(errors="replace").rstrip("\n")
    return text.split("\n")[-lines:] if text else []


class Builder:
    """One build: a sandbox from the base, the steps, then pack_diff."""

    def __init__(
        self, api: TemplatesApi, client: AsyncClient, build: Build, body: dict[str, Any]
    ) -> None:
        self.api = api
        self.config = api.config
        self.client = client
        self.build = build
        self.body = body

    async def run(self) -> None:
        b = self.build
        b.status = "building"
        outcome = "error"
        packed: list[str] = []  # environments made (removed again if the build fails)
        sb: AsyncSandbox | None = None
        try:
            base = await self.resolve_base()
            b.log(f"Base: {base.image}", step="base")
            try:
                sb = await self.client.create(
                    image=base.image,
                    ttl_s=self.config.template_build_timeout_s,
                    cpu=float(b.cpu),
                    memory_mb=b.memory_mb,
                    network=NetworkPolicy(open=True),
                    labels={"e2b.template_build": b.build_id},
                )
            except DSecError as exc:
                raise StepFailed(
                    f"could not start the build sandbox: {exc.message}", "base"
                ) from None
            state = await self.initial_state(sb, base)
            steps = self.body.get("steps") or []
            for i, step in enumerate(steps, start=1):
                await self.step(sb, state, i, step)
            config = await self.finalize(sb, state, base)
            name = env_name(b.name, b.tags[0])
            b.log(f"Packing the template as dsec environment {name}", step="finalize")
            try:
                env = await sb.pack_diff(name, config=config)
                packed.append(env.name)
                for tag in b.tags[1:]:
                    tagged = await self.client.compose_environment(
                        env_name(b.name, tag), base=env.name
                    )
                    packed.append(tagged.name)
            except DSecError as exc:
                raise StepFailed(f"packing failed: {exc.message}", "finalize") from None
            b.log(f"Template {b.name} is ready (tags: {', '.join(b.tags)})")
            outcome = "ready"
        except StepFailed as exc:
            b.log(exc.message, level="error", step=exc.step)
            b.reason = {
                "message": exc.message,
                "step": exc.step,
                "logEntries": [
                    LogEntry(now_iso(), "error", line, exc.step).json() for line in exc.output
                ],
            }
        except Exception as exc:  # ours: the build fails with the reason, the server goes on
            log.exception("e2b template build %s failed", b.build_id)
            message = exc.message if isinstance(exc, DSecError) else f"internal error: {exc}"
            b.log(message, level="error")
            b.reason = {"message": message}
        finally:
            # the build sandbox is gone before the status says the build is over
            if sb is not None:
                with contextlib.suppress(DSecError):
                    await sb.stop(grace_s=0)
            if outcome != "ready":
                for made in packed:
                    with contextlib.suppress(DSecError):
                        await self.client.delete_environment(made)
            b.status = outcome

    # ------------------------------------------------------------------- base

    async def resolve_base(self) -> Base:
        body = self.body
        if body.get("fromImageRegistry"):
            raise StepFailed(
                "fromImageRegistry (registry credentials) is not supported by dsec: a base "
                "image comes from dsec's environments or the edges' Docker engine",
                "base",
            )
        template = body.get("fromTemplate")
        if template:
            if not isinstance(template, str):
                raise StepFailed("fromTemplate must be a string", "base")
            found = await self.api.template_target(self.client, self.build.project, template)
            if found is None:
                raise StepFailed(f"template {template!r} not found", "base")
            return found
        image = body.get("fromImage") or E2B_BASE_IMAGES[0]
        if not isinstance(image, str):
            raise StepFailed("fromImage must be a string", "base")
        if image in E2B_BASE_IMAGES:
            return Base(self.config.templates.get("base", "e2b-base"), self.config.user_for("base"))
        try:
            env = await image_environment(self.client, image)
        except DSecError as exc:
            raise StepFailed(exc.message, "base") from None
        return Base(env.name, env.config.get(K_USER, env.config.get("user", "")))

    async def initial_state(self, sb: AsyncSandbox, base: Base) -> BuildState:
        if base.config:  # a template of ours: its user, workdir and env
            env = {
                k.removeprefix(ENV_PREFIX): v
                for k, v in base.config.items()
                if k.startswith(ENV_PREFIX)
            }
            return BuildState(
                base.config.get(K_USER, TEMPLATE_USER), base.config.get(WORKDIR_KEY, ""), env
            )
        user = base.user or TEMPLATE_USER
        if user != "root":
            r = await sb.run(["sh", "-c", _ENSURE_USER, "sh", user], timeout_s=60)
            if r.exit_code != 0:
                self.build.log(
                    f"the base has no user {user!r} and cannot create one: using root", "warn"
                )
                user = "root"
        return BuildState(user)

    # ------------------------------------------------------------------ steps

    async def step(self, sb: AsyncSandbox, state: BuildState, i: int, step: Any) -> None:
        if not isinstance(step, dict):
            raise StepFailed(f"step {i} is not an object", str(i))
        kind = str(step.get("type", "")).upper()
        args = [str(a) for a in step.get("args") or []]
        label = f"[builder {i}/{len(self.body.get('steps') or [])}] {kind} {' '.join(args)}"
        self.build.log(label.strip(), step=str(i))
        if kind == "RUN":
            await self.run_step(sb, state, i, args)
        elif kind == "COPY":
            await self.copy_step(sb, state, i, args, step.get("filesHash"))
        elif kind == "ENV":
            if len(args) % 2:
                raise StepFailed("ENV takes key value pairs", str(i))
            for k, v in zip(args[::2], args[1::2], strict=True):
                state.env[k] = v
        elif kind == "WORKDIR":
            if not args:
                raise StepFailed("WORKDIR needs a path", str(i))
            target = args[0]
            if not target.startswith("/"):
                target = (
                    (state.workdir or await self.home(sb, state.user)).rstrip("/") + "/" + target
                )
            await self.root(
                sb,
                i,
                "WORKDIR",
                ["sh", "-c", _WORKDIR_SCRIPT, "sh", target, f"{state.user}:{state.user}"],
            )
            state.workdir = target
        elif kind == "USER":
            if not args:
                raise StepFailed("USER needs a name", str(i))
            await self.root(sb, i, "USER", ["sh", "-c", _ENSURE_USER, "sh", args[0]])
            state.user = args[0]
        else:
            raise StepFailed(
                f"instruction {kind or '?'!r} is not supported by dsec's template builds "
                "(RUN, COPY, ENV, WORKDIR and USER are)",
                str(i),
            )

    async def home(self, sb: AsyncSandbox, user: str) -> str:
        r = await sb.run(["sh", "-c", 'getent passwd "$0" | cut -d: -f6', user], timeout_s=30)
        return r.stdout.decode().strip() or ("/root" if user == "root" else f"/home/{user}")

    async def root(self, sb: AsyncSandbox, i: int, what: str, argv: list[str]) -> None:
        r = await sb.run(argv, timeout_s=self.config.template_step_timeout_s)
        if r.exit_code != 0:
            out = _tail(r.stdout) + _tail(r.stderr)
            raise StepFailed(f"{what} failed (exit status {r.exit_code})", str(i), out)

    async def user_exists(self, sb: AsyncSandbox, user: str) -> bool:
        r = await sb.run(["id", "-u", user], timeout_s=30)
        return r.exit_code == 0

    async def run_step(self, sb: AsyncSandbox, state: BuildState, i: int, args: list[str]) -> None:
        if not args:
            raise StepFailed("RUN needs a command", str(i))
        cmd = args[0]
        user = args[1] if len(args) > 1 and args[1] else state.user
        if not await self.user_exists(sb, user):
            raise StepFailed(
                f"failed to run command {cmd!r}: user {user!r} does not exist in the template",
                str(i),
            )
        cwd = state.workdir or await self.home(sb, user)
        r = await sb.run(
            [
                "/bin/sh",
                "-c",
                'if [ -x /bin/bash ]; then exec /bin/bash -c "$0"; fi; exec /bin/sh -c "$0"',
                cmd,
            ],
            user="" if user == "root" else user,
            cwd=cwd,
            env=state.env,
            timeout_s=self.config.template_step_timeout_s,
            max_output_bytes=STEP_OUTPUT_BYTES,
        )
        for line in _tail(r.stdout, 1000):
            self.build.log(line, step=str(i))
        for line in _tail(r.stderr, 1000):
            self.build.log(line, step=str(i))
        if r.timed_out:
            raise StepFailed(
                f"failed to run command {cmd!r}: timed out after "
                f"{self.config.template_step_timeout_s} s",
                str(i),
                _tail(r.stdout) + _tail(r.stderr),
            )
        if r.exit_code != 0:
            last = (_tail(r.stderr, 1) or _tail(r.stdout, 1) or [""])[0]
            raise StepFailed(
                f"failed to run command {cmd!r}: exit status {r.exit_code}"
                + (f": {last[:500]}" if last else ""),
                str(i),
                _tail(r.stdout) + _tail(r.stderr),
            )

    async def copy_step(
        self, sb: AsyncSandbox, state: BuildState, i: int, args: list[str], files_hash: Any
    ) -> None:
        if len(args) < 2:
            raise StepFailed("COPY needs a source and a destination", str(i))
        if not isinstance(files_hash, str) or not _HASH.fullmatch(files_hash):
            raise StepFailed("COPY needs the filesHash of its uploaded files", str(i))
        archive = self.api.files.path(self.build.project, files_hash)
        if not archive.is_file():
            raise StepFailed(
                f"COPY {args[0]}: the files of hash {files_hash} were not uploaded (or were "
                "evicted from the cache): build again",
                str(i),
            )
        src, dest = args[0], args[1]
        owner = args[2] if len(args) > 2 and args[2] else state.user
        if ":" not in owner:
            owner = f"{owner}:{owner}"
        mode = args[3] if len(args) > 3 else ""
        unpack = f"/tmp/e2b-copy-{files_hash[:16]}-{i}"
        await sb.files.upload(str(archive), unpack + ".tar")
        await self.root(
            sb,
            i,
            f"COPY {src}",
            ["sh", "-c", 'mkdir -p "$0" && tar -xf "$0.tar" -C "$0" && rm -f "$0.tar"', unpack],
        )
        try:
            await self.root(
                sb,
                i,
                f"COPY {src} {dest}",
                [
                    "bash",
                    "-c",
                    _COPY_SCRIPT,
                    "bash",
                    unpack,
                    _glob_base(src),
                    dest,
                    owner,
                    mode,
                    state.workdir,
                    state.user,
                ],
            )
        finally:
            with contextlib.suppress(DSecError):
                await sb.run(["rm", "-rf", unpack], timeout_s=60)

    # --------------------------------------------------------------- finalize

    async def finalize(self, sb: AsyncSandbox, state: BuildState, base: Base) -> dict[str, str]:
        b = self.build
        start = self.body.get("startCmd") or ""
        ready = self.body.get("readyCmd") or ""
        if not isinstance(start, str) or not isinstance(ready, str):
            raise StepFailed("startCmd and readyCmd must be strings", "finalize")
        if start:
            b.log(f"Running the start command: {start}", step="finalize")
            await start_command(sb, start, state.user, state.workdir, state.env)
        if start or ready:
            check = ready or DEFAULT_READY
            b.log(f"Waiting for the ready command: {check}", step="finalize")
            ok, out = await wait_ready(
                sb,
                check,
                state.user,
                state.workdir,
                state.env,
                self.config.template_ready_timeout_s,
            )
            if not ok:
                raise StepFailed(
                    f"the ready command {check!r} did not succeed within "
                    f"{self.config.template_ready_timeout_s} s",
                    "finalize",
                    out,
                )
        config = {
            K_TEMPLATE: b.name,
            K_TAG: b.tags[0],
            K_BUILD: b.build_id,
            K_USER: state.user,
            K_CPU: str(b.cpu),
            K_MEMORY: str(b.memory_mb),
            **{ENV_PREFIX + k: v for k, v in state.env.items()},
        }
        if state.workdir:
            config[WORKDIR_KEY] = state.workdir
        if start:
            config[K_START] = start
        if ready:
            config[K_READY] = ready
        return config


async def start_command(
    sb: AsyncSandbox, start: str, user: str, workdir: str, env: dict[str, str]
) -> None:
    """The template's start command, in the background (E2B's sandboxes run it from their
    start); tagged so E2B's process list shows it."""
    await sb.start(
        ["/bin/sh", "-c", start],
        user="" if user == "root" else user,
        cwd=workdir or None,
        env=env,
        labels={"e2b.tag": "start_cmd"},
    )


async def wait_ready(
    sb: AsyncSandbox,
    check: str,
    user: str,
    workdir: str,
    env: dict[str, str],
    timeout_s: float,
) -> tuple[bool, list[str]]:
    """Runs ``check`` until it exits 0 (True) or ``timeout_s`` passes (False, its last
    output)."""
    deadline = time.monotonic() + timeout_s
    out: list[str] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False, out
        r = await sb.run(
            ["/bin/sh", "-c", check],
            user="" if user == "root" else user,
            cwd=workdir or None,
            env=env,
            timeout_s=max(1.0, left),
            max_output_bytes=64 * 1024,
        )
        if r.exit_code == 0 and not r.timed_out:
            return True, []
        out = _tail(r.stdout) + _tail(r.stderr)
        await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


# ----------------------------------------------------------------------------- API


class TemplatesApi:
    def __init__(self, config: CompatConfig, pool: ClientPool) -> None:
        self.config = config
        self.pool = pool
        self.builds: OrderedDict[str, Build] = OrderedDict()
        self.files = FileCache(
            config.template_files_dir,
            config.template_files_max_bytes,
            config.template_file_max_bytes,
            config.template_upload_secret,
        )
        self._projects: dict[str, str] = {}

    async def project(self, client: AsyncClient, key: str) -> str:
        """The caller's project (templates and snapshots are per project), by key."""
        project = self._projects.get(key)
        if project is None:
            project = (await client.whoami()).project_id
            if len(self._projects) >= self.config.clients_max:
                self._projects.clear()
            self._projects[key] = project
        return project

    # -------------------------------------------------------------- lookups

    async def owned(self, client: AsyncClient, project: str, name: str) -> list[Environment]:
        """The environments of template ``name`` of ``project`` (each tag one)."""
        envs = await client.list_environments(f"{name}:")
        return [
            e
            for e in envs
            if e.name.partition(":")[0] == name
            and e.config.get(K_TEMPLATE) == name
            and e.config.get(K_OWNER) == project
        ]

    async def foreign(self, client: AsyncClient, project: str, name: str) -> bool:
        envs = await client.list_environments(f"{name}:")
        return any(
            e.name.partition(":")[0] == name and e.config.get(K_OWNER) != project for e in envs
        )

    async def template_env(
        self, client: AsyncClient, project: str, template: str
    ) -> Environment | None:
        """This project's environment of E2B template ``name[:tag]``; None if there is none
        (or it is another project's)."""
        env = await self.lookup(client, template)
        if env is None or env.config.get(K_OWNER) != project:
            return None
        return env

    async def lookup(self, client: AsyncClient, template: str) -> Environment | None:
        """The environment of E2B template ``name[:tag]`` built here, whoever owns it."""
        try:
            name, tag = parse_name(template)
        except HttpError:
            return None
        try:
            env = await client.get_environment(env_name(name, tag))
        except (ImageNotFound, NotFound):
            return None
        return env if env.config.get(K_TEMPLATE) == name else None

    async def template_target(
        self, client: AsyncClient, project: str, template: str
    ) -> Base | None:
        if template in self.config.templates:
            return Base(self.config.templates[template], self.config.user_for(template))
        env = await self.template_env(client, project, template)
        if env is None:
            return None
        return Base(env.name, env.config.get(K_USER, TEMPLATE_USER), dict(env.config))

    # --------------------------------------------------------------- routes

    def _remember(self, build: Build) -> None:
        self.builds[build.build_id] = build
        while len(self.builds) > MAX_BUILDS:
            oldest = next(
                (k for k, v in self.builds.items() if v.status in ("ready", "error")), None
            )
            if oldest is None:
                break
            del self.builds[oldest]

    async def request_build(self, client: AsyncClient, key: str, request: Request) -> Response:
        body = await read_json(request, self.config.max_json_bytes)
        raw = body.get("name") or body.get("alias")
        if not isinstance(raw, str) or not raw:
            raise HttpError(400, "name is required")
        name, tag = parse_name(raw)
        tags = [tag or DEFAULT_TAG] if tag or not body.get("tags") else []
        extra = body.get("tags") or []
        if not isinstance(extra, list) or not all(isinstance(t, str) for t in extra):
            raise HttpError(400, "tags must be a list of strings")
        for t in extra:
            t = check_tag(t)
            if t not in tags:
                tags.append(t)
        cpu = body.get("cpuCount", 2)
        memory = body.get("memoryMB", 1024)
        if not isinstance(cpu, int) or isinstance(cpu, bool) or not 1 <= cpu <= 64:
            raise HttpError(400, "cpuCount must be an integer in 1..64")
        if not isinstance(memory, int) or isinstance(memory, bool) or not 128 <= memory <= 262144:
            raise HttpError(400, "memoryMB must be an integer in 128..262144")
        if name in self.config.templates:
            raise HttpError(
                409, f"template name {name!r} is one of this front end's configured templates"
            )
        project = await self.project(client, key)
        if await self.foreign(client, project, name):
            raise HttpError(
                409,
                f"template name {name!r} is taken in this dsec cluster by another project "
                "(templates are dsec environments, whose names are cluster-wide)",
            )
        build = Build(str(uuid.uuid4()), project, name, tags, cpu, memory)
        self._remember(build)
        return JSONResponse(
            {
                "templateID": name,
                "buildID": build.build_id,
                "public": False,
                "names": [name],
                "aliases": [name],
                "tags": tags,
            },
            202,
        )

    def _build(self, project: str, template_id: str, build_id: str) -> Build:
        b = self.builds.get(build_id)
        if b is None or b.project != project or b.name != template_id.lower():
            raise HttpError(404, f"build {build_id!r} of template {template_id!r} not found")
        return b

    async def files_link(self, client: AsyncClient, key: str, request: Request) -> Response:
        files_hash = request.path_params["hash"]
        if not _HASH.fullmatch(files_hash):
            raise HttpError(400, f"files hash {files_hash!r} is not 64 hex digits")
        project = await self.project(client, key)
        present = self.files.present(project, files_hash)
        base = str(request.base_url).rstrip("/")
        url = f"{base}/_dsec/e2b/template-files/{self.files.token(project, files_hash)}"
        return JSONResponse({"present": present, "url": url}, 201)

    async def upload(self, request: Request) -> Response:
        """The signed upload URL (no API key: the SDK sends the archive alone)."""
        project, files_hash = self.files.check(request.path_params["token"])
        await self.files.store(project, files_hash, request.stream())
        return Response(status_code=200)

    async def start_build(self, client: AsyncClient, key: str, request: Request) -> Response:
        body = await read_json(request, self.config.max_json_bytes)
        project = await self.project(client, key)
        b = self._build(project, request.path_params["id"], request.path_params["build"])
        if b.task is not None:
            raise HttpError(409, f"build {b.build_id!r} was started already")
        if not isinstance(body.get("steps", []), list):
            raise HttpError(400, "steps must be a list")
        b.task = asyncio.create_task(self._run(key, b, body), name=f"e2b-build-{b.build_id}")
        return Response(status_code=202)

    async def _run(self, key: str, build: Build, body: dict[str, Any]) -> None:
        async with self.pool.lease(key) as client:
            await Builder(self, client, build, body).run()

    async def close(self) -> None:
        tasks = [b.task for b in self.builds.values() if b.task is not None and not b.task.done()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def build_status(self, client: AsyncClient, key: str, request: Request) -> Response:
        project = await self.project(client, key)
        template_id = request.path_params["id"].lower()
        build_id = request.path_params["build"]
        q = request.query_params
        try:
            offset = int(q.get("logsOffset") or 0)
            limit = int(q.get("limit") or LOG_PAGE)
        except ValueError:
            raise HttpError(400, "logsOffset and limit must be integers") from None
        if offset < 0 or not 0 <= limit <= LOG_PAGE:
            raise HttpError(400, f"logsOffset must be >= 0 and limit in 0..{LOG_PAGE}")
        b = self.builds.get(build_id)
        if b is not None and b.project == project and b.name == template_id:
            return JSONResponse(b.status_json(offset, limit, q.get("level") or ""))
        # Not this front end's (or forgotten): a finished build is its environment.
        for env in await self.owned(client, project, template_id):
            if env.config.get(K_BUILD) == build_id:
                done = Build(build_id, project, template_id, [], 0, 0, status="ready")
                return JSONResponse(done.status_json(offset, limit, ""))
        raise HttpError(404, f"build {build_id!r} of template {template_id!r} not found")

    async def alias(self, client: AsyncClient, key: str, request: Request) -> Response:
        alias = request.path_params["alias"]
        if alias in self.config.templates:
            return JSONResponse({"templateID": alias, "public": True})
        try:
            name, _ = parse_name(alias)
        except HttpError:
            raise HttpError(404, f"template {alias!r} not found") from None
        project = await self.project(client, key)
        if not await self.owned(client, project, name):
            raise HttpError(404, f"template {alias!r} not found")
        return JSONResponse({"templateID": name, "public": False})

    async def _tagged(
        self, client: AsyncClient, project: str, target: str
    ) -> tuple[str, Environment]:
        name, tag = parse_name(target)
        env = await self.template_env(client, project, env_name(name, tag))
        if env is None:
            raise HttpError(404, f"template {target!r} not found")
        return name, env

    async def assign_tags(self, client: AsyncClient, key: str, request: Request) -> Response:
        body = await read_json(request, self.config.max_json_bytes)
        target, tags = body.get("target"), body.get("tags")
        if not isinstance(target, str) or not isinstance(tags, list) or not tags:
            raise HttpError(400, "target (name:tag) and tags (a non-empty list) are required")
        clean = [check_tag(t) if isinstance(t, str) else check_tag(str(t)) for t in tags]
        project = await self.project(client, key)
        name, env = await self._tagged(client, project, target)
        for t in clean:
            await client.compose_environment(env_name(name, t), base=env.name)
        return JSONResponse(
            {"buildID": env.config.get(K_BUILD, str(uuid.UUID(int=0))), "tags": clean}, 201
        )

    async def remove_tags(self, client: AsyncClient, key: str, request: Request) -> Response:
        body = await read_json(request, self.config.max_json_bytes)
        raw, tags = body.get("name"), body.get("tags")
        if not isinstance(raw, str) or not isinstance(tags, list) or not tags:
            raise HttpError(400, "name and tags (a non-empty list) are required")
        clean = [check_tag(str(t)) for t in tags]
        name, _ = parse_name(raw)
        project = await self.project(client, key)
        have = {e.name.partition(":")[2]: e for e in await self.owned(client, project, name)}
        if not have:
            raise HttpError(404, f"template {raw!r} not found")
        missing = [t for t in clean if t not in have]
        if missing:
            raise HttpError(404, f"template {name!r} has no tag {', '.join(missing)}")
        for t in clean:
            await client.delete_environment(have[t].name)
        return Response(status_code=204)

    async def list_tags(self, client: AsyncClient, key: str, request: Request) -> Response:
        name, _ = parse_name(request.path_params["id"])
        project = await self.project(client, key)
        envs = await self.owned(client, project, name)
        if not envs:
            raise HttpError(404, f"template {name!r} not found")
        return JSONResponse(
            [
                {
                    "tag": e.name.partition(":")[2],
                    "buildID": e.config.get(K_BUILD, str(uuid.UUID(int=0))),
                    "createdAt": (e.created_at or datetime.now(UTC))
                    .astimezone(UTC)
                    .strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                }
                for e in sorted(envs, key=lambda e: e.name)
            ]
        )

    async def delete(self, client: AsyncClient, key: str, request: Request) -> Response:
        name, _ = parse_name(request.path_params["id"])
        project = await self.project(client, key)
        envs = await self.owned(client, project, name)
        if not envs:
            raise HttpError(404, f"template {name!r} not found")
        for e in envs:
            await client.delete_environment(e.name)
        return Response(status_code=204)
