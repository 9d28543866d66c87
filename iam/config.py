"""IAM configuration (DSEC_IAM_*)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.config import ConfigError, ServiceConfig


@dataclass(frozen=True)
class IamConfig(ServiceConfig):
    listen: str = "127.0.0.1:7101"
    #: "sqlite:<path>" (default; one IAM process) or a PostgreSQL DSN
    #: "postgresql://user@host:port/db" (several IAM processes may share it).
    database: str = "sqlite:/var/lib/dsec/iam/iam.db"
    #: Where the bootstrap admin token is written (0600) on first start; "" = nowhere.
    bootstrap_token_file: Path | None = None
    #: How long API servers may cache an authentication answer.
    auth_cache_ttl_s: int = 30

    def validate(self) -> None:
        super().validate()
        if not self.database.startswith(("sqlite:", "postgresql://", "postgres://")):
            raise ConfigError(
                f"DSEC_IAM_DATABASE={self.database!r}: expected sqlite:<path> or postgresql://..."
            )
        if self.auth_cache_ttl_s < 0:
            raise ConfigError("DSEC_IAM_AUTH_CACHE_TTL_S must be >= 0")
