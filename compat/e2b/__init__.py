"""The E2B-compatible API (control API + envd) on top of libdsec; see ``compat.e2b.app``."""
