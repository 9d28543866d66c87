"""SWE-ReX on dsec: a deployment and a runtime for the ``swe-rex`` package (pinned 1.4.0).

SWE-ReX is the runtime layer of SWE-agent and mini-swe-agent: an agent talks to an
``AbstractRuntime`` (shell sessions, one-off commands, files) that an ``AbstractDeployment``
starts. Its own deployments (docker, modal, fargate, daytona) start a ``swerex-server`` inside
the container and reach it over HTTP; this one needs no server in the sandbox: every call goes
straight to dsec's API (chronus, dsec's in-sandbox agent, runs the commands and shells)::

    from libdsec.harness.swerex import DsecDeployment
    from swerex.runtime.abstract import BashAction, CreateBashSessionRequest

    deployment = DsecDeployment(image="bookworm", cpu=1, memory_mb=1024)  # DSEC_TARGET/TOKEN
    await deployment.start()
    await deployment.runtime.create_session(CreateBashSessionRequest())
    obs = await deployment.runtime.run_in_session(BashAction(command="cd /tmp && pwd"))
    await deployment.stop()

What maps to what:

- the deployment is one dsec sandbox (``start`` creates it, ``stop`` stops it);
- a named bash session is a chronus shell session (``sandbox.session()``): cwd, exported
  variables and background processes persist between calls;
- ``BashAction.timeout``: chronus kills the command's process groups and interrupts the shell
  (which stays usable), then :class:`~swerex.exceptions.CommandTimeoutError` is raised;
  ``BashInterruptAction`` sends SIGINT to the session's running command (SIGKILL if it
  outlives the retries);
- ``execute`` is a one-off command (``sandbox.run``), ``read_file`` / ``write_file`` /
  ``upload`` are dsec's file calls (binary-safe, streamed).

What dsec cannot do raises ``NotImplementedError`` saying so: interactive programs
(``is_interactive_command`` / ``is_interactive_quit``) and ``expect`` strings (a session call
returns when the command ends, never on a pattern in its output). dsec's errors become
SWE-ReX's own exception types with dsec's reason in the message (:func:`swerex_errors`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (
    CommandTimeoutError,
    DeploymentNotStartedError,
    DeploymentStartupError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SwerexException,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    Action,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionResponse,
    CloseResponse,
    CloseSessionRequest,
    CloseSessionResponse,
    Command,
    CommandResponse,
    CreateBashSessionResponse,
    CreateSessionRequest,
    CreateSessionResponse,
    IsAliveResponse,
    Observation,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)

# SWE-ReX's own pre-flight syntax check (``bash -n`` on the caller's machine, which needs
# bash, the way its server checks every session command): a syntax error is BashIncorrectSyntaxError before
# anything runs. Private in swe-rex, hence pinned (1.4.0).
from swerex.runtime.local import _check_bash_command
from swerex.utils.log import get_logger

from libdsec.aio import AsyncClient, AsyncSandbox, AsyncSession
from libdsec.errors import DeadlineExceeded, DSecError, PathNotFound

__all__ = ["DsecDeployment", "DsecDeploymentConfig", "DsecRuntime", "swerex_errors"]

#: Sandbox states in which calls succeed (a paused sandbox resumes on the first call).
_ALIVE_STATES = frozenset({"RUNNING", "PAUSED"})


class DsecDeploymentConfig(BaseModel):
    """The deployment's settings, as swe-rex's other ``*DeploymentConfig`` classes take theirs.

    ``target`` / ``token`` default to ``DSEC_TARGET`` / ``DSEC_TOKEN`` (or the local cluster of
    ``dsec up``). The sandbox options are libdsec's (:class:`libdsec.options.CreateOptions`);
    ``sandbox_options`` passes any other of them (``network``, ``task_id``, ``env``, ...).
    """

    target: str | None = None
    token: str | None = None
    image: str = "bookworm"
    backend: Literal["container", "microvm", "vm"] = "container"
    cpu: float | None = None
    memory_mb: int | None = None
    disk_mb: int | None = None
    #: the sandbox ends this long after creation (dsec's default: 3600)
    ttl_s: int | None = None
    labels: dict[str, str] = {}
    sandbox_options: dict[str, Any] = {}
    #: how long the sandbox may take to accept commands
    startup_timeout: float = 180.0
    #: deadline of dsec's calls other than commands (files, sessions, state)
    runtime_timeout: float = 60.0

    type: Literal["dsec"] = "dsec"
    """Discriminator, as in swe-rex's deployment configs."""

    def get_deployment(self) -> DsecDeployment:
        return DsecDeployment.from_config(self)


@contextmanager
def swerex_errors(what: str) -> Iterator[None]:
    """dsec's typed errors as SWE-ReX's, with dsec's reason (``REASON: message``) kept."""
    try:
        yield
    except DSecError as exc:
        msg = f"{what}: {exc}"
        if exc.reason == "SESSION_NOT_FOUND":
            raise SessionDoesNotExistError(msg) from exc
        if isinstance(exc, PathNotFound):
            raise FileNotFoundError(msg) from exc
        if isinstance(exc, DeadlineExceeded):
            raise CommandTimeoutError(msg) from exc
        raise SwerexException(msg) from exc


def _text(data: bytes) -> str:
    # swe-rex decodes command output the same way (its pexpect shell, its subprocess.run)
    return data.decode(errors="backslashreplace")


def _is_empty(command: str) -> bool:
    """Blank or comments only (bash has nothing to run; swe-rex answers with no output)."""
    return all(not line.strip() or line.strip().startswith("#") for line in command.splitlines())


def _argv(command: Command) -> list[str]:
    """The argv of ``command``, as ``subprocess.run`` would run it (POSIX rules)."""
    args = [command.command] if isinstance(command.command, str) else list(command.command)
    if command.shell:
        args = ["/bin/sh", "-c", *args]
    if command.env is not None:  # subprocess's env= replaces the environment
        args = ["env", "-i", *(f"{k}={v}" for k, v in command.env.items()), *args]
    if command.merge_output_streams:
        args = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *args]
    return args


def _local_tree(source: Path) -> tuple[list[str], list[tuple[Path, str]]]:
    """What an upload of ``source`` copies: its directories and its files (local path,
    path relative to the target; ``""`` for a single file)."""
    if source.is_file():
        return [], [(source, "")]
    if not source.is_dir():
        raise FileNotFoundError(f"upload: no local file or directory {source}")
    dirs: list[str] = []
    files: list[tuple[Path, str]] = []
    for root, _subdirs, names in os.walk(source):
        rel = os.path.relpath(root, source)
        dirs.append("" if rel == "." else rel)
        files += [(Path(root, n), os.path.normpath(os.path.join(rel, n))) for n in names]
    return dirs, files


class DsecRuntime(AbstractRuntime):
    """SWE-ReX's runtime interface on one dsec sandbox (see the module docstring)."""

    def __init__(
        self,
        sandbox: AsyncSandbox,
        *,
        sessions: dict[str, str] | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        """``sessions``: SWE-ReX session name -> dsec session id, kept in (and changed through)
        the dict given, for a caller that makes a runtime per request over the same sandbox
        (the compat front end's SWE-ReX API)."""
        self.sandbox = sandbox
        self.logger = logger or get_logger("rex-dsec")
        self._sessions: dict[str, str] = {} if sessions is None else sessions

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        try:
            info = await asyncio.wait_for(self.sandbox.refresh(), timeout)
        except DSecError as exc:
            return IsAliveResponse(is_alive=False, message=f"dsec: {exc}")
        except TimeoutError:
            return IsAliveResponse(is_alive=False, message=f"no answer from dsec in {timeout} s")
        if info.state in _ALIVE_STATES:
            return IsAliveResponse(is_alive=True)
        return IsAliveResponse(is_alive=False, message=f"sandbox {self.sandbox.id} is {info.state}")

    async def create_session(self, request: CreateSessionRequest) -> CreateSessionResponse:
        """Opens a chronus shell session named ``request.session`` and sources its startup
        files (within ``startup_timeout``)."""
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session!r} already exists")
        with swerex_errors(f"creating session {request.session!r}"):
            session = await self.sandbox.session()
        self._sessions[request.session] = session.session_id
        if not request.startup_source:
            return CreateBashSessionResponse()
        sources = " && ".join(f"source {path}" for path in request.startup_source)
        obs = await self._run(session, sources, request.startup_timeout)
        if obs.exit_code != 0:
            raise NonZeroExitCodeError(
                f"session {request.session!r}: {sources!r} failed with exit code"
                f" {obs.exit_code}:\n{obs.output}"
            )
        return CreateBashSessionResponse(output=obs.output)

    def session(self, name: str) -> AsyncSession:
        """The dsec shell session behind the SWE-ReX session ``name``."""
        try:
            return AsyncSession(self.sandbox, self._sessions[name])
        except KeyError:
            raise SessionDoesNotExistError(f"session {name!r} does not exist") from None

    async def run_in_session(self, action: Action) -> Observation:
        """Runs ``action`` in its session: stdout and stderr in one stream, as on a terminal."""
        session = self.session(action.session)
        if isinstance(action, BashInterruptAction):
            return await self._interrupt(session, action)
        if action.is_interactive_command or action.is_interactive_quit:
            raise NotImplementedError(
                "dsec runs each session command to its end: interactive programs"
                " (is_interactive_command / is_interactive_quit) are not supported"
            )
        if action.expect:
            raise NotImplementedError(
                "dsec returns a session command when it ends, not on an expected output:"
                f" expect={action.expect!r} is not supported"
            )
        await asyncio.to_thread(_check_bash_command, action.command)  # runs a local `bash -n`
        obs = await self._run(session, action.command, action.timeout)
        if action.check == "ignore":
            obs.exit_code = None
        elif action.check == "raise" and obs.exit_code != 0:
            msg = (
                f"Command {action.command!r} failed with exit code {obs.exit_code}."
                f" Here is the output:\n{obs.output!r}"
            )
            raise NonZeroExitCodeError(f"{action.error_msg}: {msg}" if action.error_msg else msg)
        return obs

    async def _run(
        self, session: AsyncSession, command: str, timeout: float | None
    ) -> BashObservation:
        if _is_empty(command):
            return BashObservation(output="", exit_code=0)
        # A group in the shell itself (cd, export, `server &` persist); its stderr joins stdout
        # in order, as on swe-rex's terminal. The newline ends a trailing comment or heredoc.
        with swerex_errors(f"running {command!r} in session {session.session_id}"):
            r = await session.run(f"{{\n{command}\n}} 2>&1", timeout_s=timeout)
        if r.timed_out:
            raise CommandTimeoutError(
                f"timeout after {timeout} seconds while running command {command!r}"
                " (dsec killed it; the session stays usable)"
            )
        return BashObservation(output=_text(r.stdout), exit_code=r.exit_code)

    async def _interrupt(
        self, session: AsyncSession, action: BashInterruptAction
    ) -> BashObservation:
        """SIGINT to the session's running command, ``n_retry`` times ``timeout`` apart, then
        SIGKILL (as swe-rex's Ctrl-C, Ctrl-Z and ``kill -9``). Nothing running: nothing to do."""
        with swerex_errors(f"interrupting session {session.session_id}"):
            for attempt in range(action.n_retry + 1):
                running = [
                    p
                    for p in await self.sandbox.processes()
                    if p.session_id == session.session_id and p.running
                ]
                if not running:
                    return BashObservation(output="", exit_code=0)
                sig = signal.SIGINT if attempt < action.n_retry else signal.SIGKILL
                for p in running:
                    await (await self.sandbox.process(p.exec_id)).kill(sig)
                signalled = {p.exec_id for p in running}
                deadline = time.monotonic() + action.timeout
                while time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    procs = await self.sandbox.processes()
                    if not any(p.running for p in procs if p.exec_id in signalled):
                        return BashObservation(output="", exit_code=0)
        raise CommandTimeoutError(f"session {session.session_id}: the command outlived SIGKILL")

    async def close_session(self, request: CloseSessionRequest) -> CloseSessionResponse:
        session = self.session(request.session)
        del self._sessions[request.session]
        with swerex_errors(f"closing session {request.session!r}"):
            await session.close()
        return CloseBashSessionResponse()

    async def execute(self, command: Command) -> CommandResponse:
        """A one-off command (``subprocess.run`` semantics); killed in the sandbox at its
        timeout (then CommandTimeoutError)."""
        with swerex_errors(f"executing {command.command!r}"):
            r = await self.sandbox.run(_argv(command), timeout_s=command.timeout, cwd=command.cwd)
        if r.timed_out:
            raise CommandTimeoutError(
                f"Timeout ({command.timeout}s) exceeded while running command"
                f" {command.command!r} (dsec killed it)"
            )
        response = CommandResponse(
            stdout=_text(r.stdout), stderr=_text(r.stderr), exit_code=r.exit_code
        )
        if command.check and r.exit_code != 0:
            msg = (
                f"Command {command.command!r} failed with exit code {r.exit_code}."
                f" Stdout:\n{response.stdout!r}\nStderr:\n{response.stderr!r}"
            )
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return response

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        with swerex_errors(f"reading {request.path}"):
            data = await self.sandbox.files.read(request.path)
        content = data.decode(request.encoding or "utf-8", request.errors or "strict")
        return ReadFileResponse(content=content)

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        """Writes the text (UTF-8), creating missing parent directories."""
        with swerex_errors(f"writing {request.path}"):
            await self.sandbox.files.write(request.path, request.content)
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """Copies a local file or directory tree into the sandbox (streamed, binary-safe)."""
        dirs, files = await asyncio.to_thread(_local_tree, Path(request.source_path))
        target = request.target_path
        with swerex_errors(f"uploading {request.source_path} to {target}"):
            for rel in dirs:
                await self.sandbox.files.mkdir(os.path.join(target, rel))
            for local, rel in files:
                await self.sandbox.files.upload(local, os.path.join(target, rel) if rel else target)
        return UploadResponse()

    async def close(self) -> CloseResponse:
        """Closes every session (the sandbox itself belongs to the deployment)."""
        names = list(self._sessions)
        for name in names:
            session = self.session(name)
            del self._sessions[name]
            try:
                await session.close()
            except DSecError as exc:  # ended with the sandbox already: nothing left to close
                self.logger.debug("closing session %s: %s", session.session_id, exc)
        return CloseResponse()


class DsecDeployment(AbstractDeployment):
    """A SWE-ReX deployment on one dsec sandbox: ``start`` creates it, ``stop`` stops it.

    Takes the fields of :class:`DsecDeploymentConfig` as keywords."""

    def __init__(self, *, logger: logging.Logger | None = None, **kwargs: Any) -> None:
        self._config = DsecDeploymentConfig(**kwargs)
        self.logger = logger or get_logger("rex-deploy")
        self._hooks = CombinedDeploymentHook()
        self._client: AsyncClient | None = None
        self._runtime: DsecRuntime | None = None

    @classmethod
    def from_config(cls, config: DsecDeploymentConfig) -> DsecDeployment:
        return cls(**config.model_dump(exclude={"type"}))

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    async def start(self) -> None:
        """Creates the sandbox and waits until it accepts commands."""
        if self._runtime is not None:
            self.logger.warning("Deployment is already started. Ignoring duplicate start() call.")
            return
        cfg = self._config
        self._hooks.on_custom_step("Starting dsec sandbox")
        client = AsyncClient(cfg.target, token=cfg.token, timeout=cfg.runtime_timeout)
        options: dict[str, Any] = {
            "image": cfg.image,
            "backend": cfg.backend,
            "cpu": cfg.cpu,
            "memory_mb": cfg.memory_mb,
            "disk_mb": cfg.disk_mb,
            "ttl_s": cfg.ttl_s,
            "labels": {"harness": "swe-rex", **cfg.labels},
            **cfg.sandbox_options,
        }
        t0 = time.monotonic()
        try:
            sandbox = await client.create(timeout=cfg.startup_timeout, **options)
        except (DSecError, TypeError) as exc:  # TypeError: a misspelt sandbox option
            await client.close()
            raise DeploymentStartupError(
                f"dsec could not start a {cfg.image!r} sandbox: {exc}"
            ) from exc
        self._client = client
        self._runtime = DsecRuntime(sandbox, logger=self.logger)
        self.logger.info("dsec sandbox %s started in %.2fs", sandbox.id, time.monotonic() - t0)

    async def stop(self) -> None:
        """Closes the sessions and stops the sandbox; idempotent."""
        runtime, client = self._runtime, self._client
        self._runtime = self._client = None
        if runtime is not None:
            await runtime.close()
            try:
                await runtime.sandbox.stop()
            except DSecError as exc:  # ended already (TTL, a failure): nothing to stop
                self.logger.debug("stopping sandbox %s: %s", runtime.sandbox.id, exc)
        if client is not None:
            await client.close()

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        return await self.runtime.is_alive(timeout=timeout)

    @property
    def runtime(self) -> DsecRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    @property
    def sandbox(self) -> AsyncSandbox:
        """The dsec sandbox (libdsec's handle), for what SWE-ReX has no call for."""
        return self.runtime.sandbox
