"""Compatibility front ends: other sandbox platforms' APIs served on top of dsec.

Each front end lets code written for another platform's SDK run unchanged against a dsec
cluster. Today: ``compat.e2b`` (the E2B control API and the in-sandbox envd API, so the
stock ``e2b`` Python SDK works by setting ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and
``E2B_API_KEY``). The process is ``python -m compat``; it keeps no state of its own (every
fact lives in dsec: sandbox labels, exec labels, the API server), so several may run.
"""
