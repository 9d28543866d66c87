"""Compatibility front ends: other sandbox platforms' APIs served on top of dsec.

Each front end lets code written for another platform's SDK run unchanged against a dsec
cluster. Today: ``compat.e2b`` (the E2B control API and the in-sandbox envd API, so the
stock ``e2b`` Python SDK works by setting ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and
``E2B_API_KEY``), ``compat.sandboxfusion`` (SandboxFusion's code-execution API) and, when
``DSEC_COMPAT_SWEREX_LISTEN`` is set, ``compat.swe_rex`` (SWE-ReX's remote-runtime API). The
process is ``python -m compat``; the E2B and SandboxFusion front ends keep no state of their own
(every fact lives in dsec: sandbox labels, exec labels, the API server), so several may run.
The SWE-ReX one remembers each sandbox's session names: a RemoteRuntime's calls must reach the
same instance (a restart forgets the names; the shells stay in the sandbox).
"""
