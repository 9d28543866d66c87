"""SandboxFusion's code-execution API on dsec's FnCall pools.

RL frameworks compute code rewards by posting to a SandboxFusion server (verl's
``sandbox_fusion_url``: ``POST /run_code`` with code, language, stdin, timeouts, memory,
files). Pointing that URL at dsec's listener (``python -m compat``, default
``127.0.0.1:7131``) runs the same requests on the warm pools with no change to the caller:
``models`` validates the bodies as the reference does, ``mapping`` answers dsec's verdicts in
the reference's vocabulary, ``app`` routes, authenticates and calls FnCall.
"""
