"""Adapters that put the agent harnesses RL teams already run on dsec sandboxes.

Each module is an optional extra: it imports its harness package (pinned in the ``swerex``
extra of pyproject.toml) and nothing of dsec's servers, so ``import libdsec`` never needs them.

- :mod:`libdsec.harness.swerex`: a SWE-ReX deployment and runtime (SWE-agent, mini-swe-agent).
- :mod:`libdsec.harness.mini_swe_agent`: a mini-swe-agent environment on top of it.
"""
