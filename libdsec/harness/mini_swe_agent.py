"""mini-swe-agent on dsec: an environment class (``mini-swe-agent`` pinned 2.4.6).

mini-swe-agent takes its environment by import path; this one runs every action in a dsec
sandbox through :class:`~libdsec.harness.swerex.DsecDeployment` (the same code as SWE-ReX on
dsec), so the only change to a run is the environment class::

    mini --environment-class libdsec.harness.mini_swe_agent.DsecEnvironment \\
        -c mini.yaml -c environment.image=bookworm -c environment.cwd=/work

or from Python::

    from minisweagent.agents.default import DefaultAgent
    from libdsec.harness.mini_swe_agent import DsecEnvironment

    env = DsecEnvironment(image="bookworm", cwd="/work", timeout=60)
    try:
        result = DefaultAgent(model, env, **agent_config).run("fix the failing test")
    finally:
        env.cleanup()

Each action is a fresh ``bash -lc`` in the sandbox (as mini-swe-agent's docker environment
runs it), stdout and stderr merged; at ``timeout`` dsec kills it and the observation carries
the timeout. ``env`` becomes the sandbox's environment (every command gets it). The
configuration keys are :class:`DsecEnvironmentConfig`'s: those of
:class:`~libdsec.harness.swerex.DsecDeploymentConfig` plus ``cwd``, ``env``, ``timeout`` and
``interpreter``.
"""

from __future__ import annotations

import asyncio
import shlex
from typing import Any

from minisweagent.environments.extra.swerex_docker import SwerexDockerEnvironment
from minisweagent.utils.serialize import recursive_merge
from swerex.runtime.abstract import Command, CommandResponse

from libdsec.harness.swerex import DsecDeployment, DsecDeploymentConfig

__all__ = ["DsecEnvironment", "DsecEnvironmentConfig"]

#: The fields of DsecEnvironmentConfig that are the environment's, not the deployment's.
_ENV_FIELDS = frozenset({"cwd", "env", "timeout", "interpreter"})


class DsecEnvironmentConfig(DsecDeploymentConfig):
    cwd: str = "/"
    """Working directory of every action."""
    env: dict[str, str] = {}
    """Environment variables of every action (the sandbox's environment)."""
    timeout: int = 30
    """Seconds an action may run; dsec kills it then."""
    interpreter: list[str] = ["bash", "-lc"]
    """The action runs as ``[*interpreter, command]``."""


class DsecEnvironment(SwerexDockerEnvironment):
    """mini-swe-agent's environment protocol on one dsec sandbox.

    Shares SWE-ReX's docker environment's observation shape, submission check
    (``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``) and serialization; the deployment is dsec's and
    every call runs on one event loop of the environment's own (the gRPC channel is bound to it).
    """

    def __init__(self, **kwargs: Any) -> None:
        self.config = DsecEnvironmentConfig(**kwargs)  # type: ignore[assignment]
        cfg = self.config
        deployment = cfg.model_dump(exclude=_ENV_FIELDS | {"type"})
        if cfg.env:
            options = deployment["sandbox_options"]
            options["env"] = {**options.get("env", {}), **cfg.env}
        self._loop: asyncio.Runner | None = asyncio.Runner()
        self.deployment = DsecDeployment(**deployment)  # type: ignore[assignment]
        try:
            self._loop.run(self.deployment.start())
            # the working directory exists from the start (as docker's `-w` makes it)
            uname = self._run(
                f"mkdir -p {shlex.quote(cfg.cwd)} && uname -s && uname -r && uname -v && uname -m",
                cwd="/",
                timeout=30,
                check=True,
            )
        except BaseException:
            self.cleanup()
            raise
        # mini-swe-agent's prompts name the system the commands run on (platform.uname()).
        names = ("system", "release", "version", "machine")
        self._uname = dict(zip(names, uname.stdout.splitlines(), strict=False))

    def _run(
        self, command: str, *, cwd: str = "", timeout: int | None = None, check: bool = False
    ) -> CommandResponse:
        cfg = self.config
        assert isinstance(cfg, DsecEnvironmentConfig)
        if self._loop is None:
            raise RuntimeError("the environment was cleaned up: its sandbox is stopped")
        return self._loop.run(
            self.deployment.runtime.execute(
                Command(
                    command=[*cfg.interpreter, command],
                    cwd=cwd or cfg.cwd,
                    timeout=timeout or cfg.timeout,
                    merge_output_streams=True,
                    check=check,
                )
            )
        )

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Runs ``action["command"]``: ``{"output", "returncode", "exception_info"}``."""
        output: dict[str, Any]
        try:
            result = self._run(action.get("command", ""), cwd=cwd, timeout=timeout)
            output = {"output": result.stdout, "returncode": result.exit_code, "exception_info": ""}
        except Exception as e:  # a timeout or a dsec error is an observation for the agent
            output = {
                "output": str(e),
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        self._check_finished(output)
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return recursive_merge(self.config.model_dump(), self._uname, kwargs)

    def cleanup(self) -> None:
        """Stops the sandbox and closes the loop; idempotent."""
        loop, self._loop = getattr(self, "_loop", None), None
        if loop is None:
            return
        try:
            loop.run(self.deployment.stop())
        finally:
            loop.close()

    def __del__(self) -> None:
        self.cleanup()
