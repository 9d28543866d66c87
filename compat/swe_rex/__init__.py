"""SWE-ReX's remote-runtime HTTP API on dsec sandboxes (``app``).

A stock ``swerex.runtime.remote.RemoteRuntime`` (what verl's agent stack and SWE-agent's
``remote`` deployment configure with a URL) reaches a dsec sandbox with only the URL and key
changed: ``host=http://<listener>/sandboxes/<sandbox id>``, ``auth_token=<dsec token>``. Each
call runs through ``libdsec.harness.swerex.DsecRuntime``, the same code as the in-process
deployment; no server runs inside the sandbox.
"""
