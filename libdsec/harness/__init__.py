"""Adapters that let agent harnesses run their sandboxes on dsec unchanged.

Each module implements one harness's own backend interface on top of :mod:`libdsec` and
imports that harness, so it is imported only where the harness is installed:

- :mod:`libdsec.harness.harbor`: a Harbor environment (``harbor run --env
  libdsec.harness.harbor:DSecEnvironment``).
"""
