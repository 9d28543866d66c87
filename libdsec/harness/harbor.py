"""A Harbor environment on dsec sandboxes: ``harbor run --env libdsec.harness.harbor:DSecEnvironment``.

Harbor (PyPI ``harbor``, Terminal-Bench's successor) runs an agent and then a task's verifier
in an *environment*, one of its built-in providers (docker, daytona, e2b, modal, ...) or any
``module:Class`` subclass of its ``BaseEnvironment`` named on the command line. This is that
class for dsec: one trial, one container sandbox, reached through :class:`libdsec.AsyncClient`
(``DSEC_TARGET`` / ``DSEC_TOKEN``, else the local cluster of ``dsec up``).

What maps to what:

- The task's image. ``[environment] docker_image = "<ref>"`` is a Docker image of the dsec
  node's engine: it is imported into dsec's layer store (``import_image("docker:<ref>")``, the
  environment ``docker/<repo>:<tag>``) on first use; later trials find it there (the import is
  skipped while the engine's image id is unchanged). A task with ``environment/Dockerfile``
  instead (or with both, under ``--force-build``) is built by the local ``docker build``
  (tagged ``harbor-dsec/<task>:<content hash>``; Docker's build cache makes an unchanged task's
  build a cache hit) and then imported the same way. An import reads the Docker engine of
  whichever node it reaches: on several machines the image must be in every node's engine, and
  a Dockerfile task (built where Harbor runs) needs a one-machine cluster. An image that cannot be built or imported raises Harbor's
  ``SandboxBuildFailedError`` with dsec's reason.
- ``start`` creates the sandbox (cpus, memory_mb, storage_mb as its limits, the task's env, no
  network for ``network_mode = "no-network"``, open egress for ``"public"``);
  ``stop`` stops it.
- ``exec`` runs the command under bash (sh where the image has no bash), as ``user``, in the
  task's workdir (else the image's) unless told otherwise, as ``docker exec`` does, streaming
  output to Harbor's callbacks; ``timeout_sec`` is enforced by dsec, which kills the command's
  process group in the sandbox, and then raises ``RuntimeError`` as Harbor's docker
  environment does. A Harbor timeout around ``exec`` (the agent's, the verifier's) cancels
  the exec stream, which kills the command too.
- ``upload_file`` / ``download_file`` stream one file; directories travel as one gzipped tar
  archive (Harbor's own packing and tar commands, as its e2b environment uses them).

Not supported (Harbor rejects the task before start, from :attr:`capabilities`, or this class
does, with ValueError): docker-compose tasks, network allow-lists, GPUs, Windows, host mounts,
SSH stream mode.
"""

from __future__ import annotations

import asyncio
import codecs
import os
import re
import shlex
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult, SandboxBuildFailedError
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.environments.definition import (
    COMPOSE_FILE_NAME,
    DOCKERFILE_NAME,
    should_use_prebuilt_docker_image,
)
from harbor.environments.options import EnvironmentOptions
from harbor.environments.tar_transfer import (
    extract_dir_from_file,
    pack_dir_to_file,
    remote_pack_command,
    remote_unpack_command,
    tar_pack_succeeded,
)

from libdsec._config import resolve
from libdsec.aio import AsyncClient, AsyncSandbox
from libdsec.errors import DSecError, NotFound
from libdsec.options import CreateOptions
from libdsec.types import Exited, NetworkPolicy, Output

#: A sandbox no command has touched for this long ends by itself, so one left behind by a
#: Harbor process that died is reclaimed (a trial's own limits are far shorter).
IDLE_TIMEOUT_S = 3600
#: Output kept per stream of a command: dsec's ceiling for a streamed command (its default,
#: 1 MiB, would cut what Harbor's agents read back, e.g. a long listing); beyond it the head
#: and the tail are kept.
EXEC_OUTPUT_BYTES = 64 * 1024 * 1024
#: Where directories are packed in transit, inside the sandbox.
TRANSFER_DIR = "/tmp"
#: Bounds of the commands that pack and unpack a directory.
TAR_TIMEOUT_S = 600
#: The Docker repository a task's Dockerfile is built into before its import.
BUILD_REPOSITORY = "harbor-dsec"


class DSecEnvironment(BaseEnvironment):
    """One Harbor trial's environment: a dsec container sandbox (see the module docstring)."""

    # Harbor's shared options (auto_mounting) and no others: a misspelt --ek is an error.
    options_model = EnvironmentOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._client: AsyncClient | None = None
        self._sandbox: AsyncSandbox | None = None
        self._shell = "/bin/sh"
        self._workdir = "/"
        super().__init__(*args, **kwargs)
        if self._host_mounts:  # Harbor itself refuses auto_mounting without the capability
            raise ValueError(
                "the dsec environment cannot bind host directories into a sandbox (--mounts): "
                "upload what the task needs instead"
            )

    @staticmethod
    def type() -> str:
        return "dsec"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(
            cpu_limit=True, memory_limit=True, fractional_cpus=True
        )

    @classmethod
    def preflight(cls, kwargs: dict[str, Any] | None = None) -> None:
        """Fails the job before any trial when there is no dsec to talk to (no token)."""
        super().preflight(kwargs)
        try:
            resolve()
        except DSecError as exc:
            raise SystemExit(f"dsec environment: {exc}") from None

    def _validate_definition(self) -> None:
        env_dir = self.environment_dir
        if self.task_env_config.docker_image or (env_dir / DOCKERFILE_NAME).exists():
            return
        if (env_dir / COMPOSE_FILE_NAME).exists():
            raise ValueError(
                f"{env_dir / COMPOSE_FILE_NAME}: docker-compose tasks are not supported by the "
                "dsec environment (one sandbox per trial); give the task a docker_image or "
                f"{DOCKERFILE_NAME}"
            )
        raise FileNotFoundError(
            f"task environment {env_dir} has neither [environment] docker_image nor "
            f"{env_dir.name}/{DOCKERFILE_NAME}"
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self, force_build: bool) -> None:
        """Imports the task's image into dsec's layer store (first use only) and creates the
        sandbox."""
        client = self._client = AsyncClient()
        docker_image = self.task_env_config.docker_image
        if docker_image and should_use_prebuilt_docker_image(
            self.environment_dir, docker_image=docker_image, force_build=force_build
        ):
            ref = docker_image
        else:
            ref = await self._build()
        timeout = self.task_env_config.build_timeout_sec
        try:
            env = await client.import_image(f"docker:{ref}", timeout=timeout)
        except DSecError as exc:
            raise SandboxBuildFailedError(
                f"dsec could not import the task's image docker:{ref} into its layer store: {exc}"
            ) from exc
        self.logger.debug(f"dsec environment {env.name} ({len(env.layers)} layers) for {ref}")
        self._sandbox = await client.create(**self._create_options(env.name))
        # Commands start in the task's workdir (made if missing, as Docker's WORKDIR is), else
        # the image's, whichever the user, as under `docker exec`.
        self._workdir = self.task_env_config.workdir or env.config.get("workdir") or "/"
        probe = await self._sandbox.run(
            f"mkdir -p {shlex.quote(self._workdir)} && {{ test -x /bin/bash; echo $?; }}",
            cwd="/",
            timeout_s=30,
        )
        if probe.exit_code != 0:
            raise RuntimeError(
                f"cannot make the workdir {self._workdir} in dsec sandbox {self._sandbox.id}: "
                f"{probe.stderr.decode(errors='replace')}"
            )
        self._shell = "/bin/bash" if probe.stdout.strip() == b"0" else "/bin/sh"
        # Harbor's output directories (/logs/agent, /logs/verifier, ...), as other providers do
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()

    def _create_options(self, image: str) -> CreateOptions:
        options: CreateOptions = {
            "image": image,
            "env": self._startup_env(),
            "network": NetworkPolicy(open=self._network_is_public),
            "idle_timeout_s": IDLE_TIMEOUT_S,
            "labels": {"harbor.task": self.environment_name[:255]},
        }
        if self._effective_cpus:
            options["cpu"] = float(self._effective_cpus)
        if self._effective_memory_mb:
            options["memory_mb"] = self._effective_memory_mb
        if self._effective_storage_mb:
            options["disk_mb"] = self._effective_storage_mb
        return options

    async def _build(self) -> str:
        """``docker build`` of the task's environment directory; returns the image's tag.

        The tag carries the directory's content hash, so each version of a task is an image
        (and a dsec environment) of its own; Docker's build cache makes rebuilding an unchanged
        task cheap."""
        name = re.sub(r"[^a-z0-9_.-]+", "-", self.environment_name.lower()).strip("-.") or "task"
        tag = f"{BUILD_REPOSITORY}/{name}:{self.environment_id[:12]}"
        rc, output = await _docker(
            "build", "-t", tag, str(self.environment_dir),
            timeout_s=self.task_env_config.build_timeout_sec,
        )  # fmt: skip
        if rc != 0:
            raise SandboxBuildFailedError(
                f"docker build of {self.environment_dir} failed (exit {rc}): {output[-2000:]}"
            )
        return tag

    async def stop(self, delete: bool) -> None:
        """Stops the sandbox (dsec keeps nothing of a stopped sandbox, so ``delete=False``
        is the same) and closes the client."""
        try:
            if self._sandbox is not None:
                await self._sandbox.stop(grace_s=1.0)
        except NotFound:
            pass  # already gone (its TTL, an edge lost): nothing left to stop
        finally:
            self._sandbox = None
            if self._client is not None:
                await self._client.close()
                self._client = None

    def _require_sandbox(self) -> AsyncSandbox:
        if self._sandbox is None:
            raise RuntimeError("the dsec environment is not started")
        return self._sandbox

    # ------------------------------------------------------------------ exec

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Runs ``command`` under the image's shell; output goes to Harbor's stream callbacks
        as it comes. On ``timeout_sec`` dsec kills the command and this raises RuntimeError."""
        sandbox = self._require_sandbox()
        user = self._resolve_user(user)
        callback = self._output_callback()
        output = {"stdout": bytearray(), "stderr": bytearray()}
        decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in output}
        exit_code = 0
        async for event in sandbox.stream(
            [self._shell, "-c", command],
            timeout_s=timeout_sec or None,
            cwd=cwd or self._workdir,
            env=self._merge_env(env),
            user="" if user is None else str(user),
            max_output_bytes=EXEC_OUTPUT_BYTES,
        ):
            if isinstance(event, Output):
                output[event.stream] += event.data
                if callback is not None:
                    await callback(decoders[event.stream].decode(event.data), event.stream)
            elif isinstance(event, Exited):
                if event.status.timed_out:
                    raise RuntimeError(
                        f"Command timed out after {timeout_sec} seconds "
                        f"(killed in dsec sandbox {sandbox.id})"
                    )
                exit_code = event.status.exit_code
        return ExecResult(
            stdout=output["stdout"].decode(errors="replace") or None,
            stderr=output["stderr"].decode(errors="replace") or None,
            return_code=exit_code,
        )

    # ------------------------------------------------------------------ files

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """One local file into the sandbox (its permission bits kept, parents made)."""
        mode = stat.S_IMODE(os.stat(source_path).st_mode)
        await self._require_sandbox().files.upload(Path(source_path), target_path, mode=mode)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        await self._require_sandbox().files.download(source_path, target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """A local directory's contents into ``target_dir``, as one archive (Harbor's own
        packing: the contents without the directory itself, whose mode is the target's
        business; extracted as the sandbox's root, not the host's owners)."""
        remote = f"{TRANSFER_DIR}/.hb-dsec-{uuid.uuid4().hex}.tar.gz"
        with tempfile.TemporaryDirectory() as tmp:
            archive = Path(tmp, "dir.tar.gz")
            await asyncio.to_thread(pack_dir_to_file, source_dir, archive, include_root=False)
            await self._require_sandbox().files.upload(archive, remote)
        unpack = remote_unpack_command(remote, target_dir, no_same_owner=True)
        result = await self.exec(
            f"{unpack}; rc=$?; rm -f {shlex.quote(remote)}; exit $rc",
            timeout_sec=TAR_TIMEOUT_S,
            user="root",
        )
        if result.return_code != 0:
            raise RuntimeError(
                f"unpacking {source_dir} into {target_dir} failed with code {result.return_code}: "
                f"{result.stderr or result.stdout or 'no output'}"
            )

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """A sandbox directory's contents into ``target_dir``, as one archive."""
        remote = f"{TRANSFER_DIR}/.hb-dsec-{uuid.uuid4().hex}.tar.gz"
        try:
            result = await self.exec(
                remote_pack_command(source_dir, remote), timeout_sec=TAR_TIMEOUT_S, user="root"
            )
            if not tar_pack_succeeded(result.return_code, stderr=result.stderr, logger=self.logger):
                raise RuntimeError(
                    f"packing {source_dir} failed with code {result.return_code}: "
                    f"{result.stderr or result.stdout or 'no output'}"
                )
            with tempfile.TemporaryDirectory() as tmp:
                archive = Path(tmp, "dir.tar.gz")
                await self._require_sandbox().files.download(remote, archive)
                await asyncio.to_thread(extract_dir_from_file, archive, target_dir)
        finally:
            await self.exec(f"rm -f {shlex.quote(remote)}", timeout_sec=60, user="root")


async def _docker(*args: str, timeout_s: float) -> tuple[int, str]:
    """Runs the docker CLI; (exit code, combined output). A missing CLI or engine is a build
    failure of the task (Harbor's SandboxBuildFailedError), never a hang."""
    try:
        proc = await asyncio.create_subprocess_exec(
            "docker", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
    except FileNotFoundError:
        raise SandboxBuildFailedError(
            "building a task's Dockerfile for dsec needs the docker CLI and the Docker engine "
            "of the dsec node; none on PATH"
        ) from None
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise SandboxBuildFailedError(f"docker {args[0]} timed out after {timeout_s} s") from None
    return proc.returncode or 0, out.decode(errors="replace")
