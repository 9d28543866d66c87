"""Adapters that put the agent harnesses RL teams already run on dsec sandboxes, unchanged.

Each module implements one harness's own backend interface on top of :mod:`libdsec` and
imports that harness (and nothing of dsec's servers), so ``import libdsec`` never needs them;
a module is imported only where its harness is installed:

- :mod:`libdsec.harness.swerex`: a SWE-ReX deployment and runtime (SWE-agent, mini-swe-agent;
  the ``swerex`` extra of pyproject.toml);
- :mod:`libdsec.harness.mini_swe_agent`: a mini-swe-agent environment on top of it;
- :mod:`libdsec.harness.harbor`: a Harbor environment (``harbor run --env
  libdsec.harness.harbor:DSecEnvironment``; Harbor's own venv, ``.venv-harbor``).
"""
