"""envd, E2B's in-sandbox agent API: the Connect services (process, filesystem) and the
REST endpoints (files, health), each mapped onto libdsec calls into the sandbox."""
