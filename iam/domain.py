"""IAM rules: who a token is, what it may touch, how much it may use.

Projects are paths (``root/team-a/run-7``). A principal acts on its own
project and its descendants, never on an ancestor or sibling. Management
(subprojects, quotas, tokens) needs the ADMIN role; a quota can only be set on
a strict descendant (nobody raises their own limit), and never above the
nearest limit held by an ancestor (you cannot grant more than you hold).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from iam.store import (
    QUEUE_RETENTION_S,
    IamStore,
    ProjectRecord,
    QueueChange,
    QueueRow,
    Quota,
    Reservation,
    ReserveOutcome,
    TokenRecord,
    ancestors,
)
from libdsec.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)

log = logging.getLogger(__name__)

ROOT = "root"
SEGMENT = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")

# Role and kind values mirror dsec.iam.v1 enums (the domain does not import generated code).
ROLE_ADMIN = 1
ROLE_MEMBER = 2
KIND_HUMAN = 1
KIND_AGENT = 2
KIND_SERVICE = 3

ACTION_USE_SANDBOXES = 1
ACTION_MANAGE_PROJECTS = 2
ACTION_MANAGE_TOKENS = 3


@dataclass(frozen=True)
class Principal:
    principal_id: str
    name: str
    kind: int
    role: int
    project_id: str
    expires_at: float | None


def hash_secret(secret: str) -> str:
    # Tokens carry 256 bits of randomness, so a fast hash is enough: the
    # point is that a leaked database does not leak usable tokens.
    return hashlib.sha256(secret.encode()).hexdigest()


def within(project_id: str, scope: str) -> bool:
    """True when ``project_id`` is ``scope`` or one of its descendants."""
    return project_id == scope or project_id.startswith(scope + "/")


#: A token in E2B's key shape (``CreateTokenRequest.e2b_format``): "e2b_", then the 16 hex
#: digits of its id and the 64 of its secret (E2B's SDKs accept ``e2b_[0-9a-f]+``).
_E2B_TOKEN = re.compile(r"\Ae2b_([0-9a-f]{16})([0-9a-f]{64})\Z")


def parse_token(token: str) -> tuple[str, str]:
    """``dsec_<id>_<secret>`` or ``e2b_<id><secret>`` -> (id, secret)."""
    if token.startswith("e2b_"):
        m = _E2B_TOKEN.match(token)
        if m is None:
            raise Unauthenticated("malformed token", reason="BAD_TOKEN")
        return m.group(1), m.group(2)
    parts = token.split("_")
    if len(parts) != 3 or parts[0] != "dsec" or not parts[1] or not parts[2]:
        raise Unauthenticated("malformed token", reason="BAD_TOKEN")
    return parts[1], parts[2]


class Iam:
    """The IAM service's domain; every method is safe to call concurrently."""

    def __init__(self, store: IamStore) -> None:
        self.store = store

    async def _run(self, fn, *args):  # type: ignore[no-untyped-def]
        return await asyncio.to_thread(fn, *args)

    # ------------------------------------------------------------ bootstrap

    async def bootstrap(self, token_file: Path | None) -> str | None:
        """On an empty store: creates the root project and an admin token.

        The token is written to ``token_file`` with mode 0600 (where the SDK
        looks by default). Returns the token, or None when already set up.
        """
        if not await self._run(self.store.is_empty):
            return None
        try:
            await self._run(self.store.create_project, ROOT, "", Quota())
        except AlreadyExists:  # another IAM process on the same database got there first
            return None
        token, _ = await self._new_token(ROOT, "bootstrap-admin", KIND_HUMAN, ROLE_ADMIN, 0)
        if token_file is not None:
            token_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(token + "\n")
            os.chmod(token_file, 0o600)
            log.info("bootstrap admin token written to %s", token_file)
        return token

    # ------------------------------------------------------ authentication

    async def authenticate(self, token: str) -> Principal:
        if not token:
            raise Unauthenticated("no token", reason="NO_TOKEN")
        token_id, secret = parse_token(token)
        rec = await self._run(self.store.get_token, token_id)
        if rec is None or not hmac.compare_digest(rec.secret_hash, hash_secret(secret)):
            raise Unauthenticated("unknown token", reason="BAD_TOKEN")
        if rec.revoked:
            raise Unauthenticated("token revoked", reason="TOKEN_REVOKED")
        if rec.expires_at is not None and rec.expires_at <= time.time():
            raise Unauthenticated("token expired", reason="TOKEN_EXPIRED")
        return Principal(rec.token_id, rec.name, rec.kind, rec.role, rec.project_id, rec.expires_at)

    def authorize(self, who: Principal, action: int, project_id: str) -> tuple[bool, str]:
        if not within(project_id, who.project_id):
            return False, f"project {project_id} is outside {who.project_id}"
        if action in (ACTION_MANAGE_PROJECTS, ACTION_MANAGE_TOKENS) and who.role != ROLE_ADMIN:
            return False, "needs the ADMIN role"
        return True, ""

    def require(self, who: Principal, action: int, project_id: str) -> None:
        ok, why = self.authorize(who, action, project_id)
        if not ok:
            # A project outside the caller's subtree is reported as absent: no existence leak.
            if not within(project_id, who.project_id):
                raise NotFound(f"project {project_id} not found", reason="PROJECT_NOT_FOUND")
            raise PermissionDenied(why)

    # ------------------------------------------------------------ projects

    async def create_project(
        self, who: Principal, parent_id: str, name: str, quota: Quota, *, exist_ok: bool = False
    ) -> ProjectRecord:
        """A new subproject; with `exist_ok` an existing one of that name is returned as it
        is (its quota unchanged), also when a concurrent create won."""
        parent_id = parent_id or who.project_id
        if not SEGMENT.match(name):
            raise InvalidArgument(f"project name {name!r} must match [a-z0-9][a-z0-9-]{{0,39}}")
        self.require(who, ACTION_MANAGE_PROJECTS, parent_id)
        project_id = f"{parent_id}/{name}"
        if exist_ok and (rec := await self._run(self.store.get_project, project_id)) is not None:
            return rec
        await self._check_grant(parent_id, quota)
        try:
            return await self._run(self.store.create_project, project_id, parent_id, quota)
        except AlreadyExists:
            if exist_ok and (rec := await self._run(self.store.get_project, project_id)):
                return rec
            raise

    async def _check_grant(self, parent_id: str, quota: Quota) -> None:
        """A child's limits may not exceed the nearest limit held above it."""
        limits = {"cpu_millis": 0, "memory_mb": 0, "sandboxes": 0}
        backend_limits: dict[str, int] = {}
        for pid in ancestors(parent_id):
            rec = await self._run(self.store.get_project, pid)
            if rec is None:
                raise NotFound(f"project {pid} not found", reason="PROJECT_NOT_FOUND")
            for dim in limits:
                own = getattr(rec.quota, dim)
                if own and (not limits[dim] or own < limits[dim]):
                    limits[dim] = own
            for b, v in rec.quota.sandboxes_by_backend.items():
                if v and (b not in backend_limits or v < backend_limits[b]):
                    backend_limits[b] = v
        for dim, held in limits.items():
            want = getattr(quota, dim)
            if held and want > held:
                raise PermissionDenied(
                    f"cannot grant {dim}={want}: {parent_id} holds only {held}",
                    reason="QUOTA_GRANT_EXCEEDS_HELD",
                )
        for b, want in quota.sandboxes_by_backend.items():
            held = backend_limits.get(b, 0)
            if held and want > held:
                raise PermissionDenied(
                    f"cannot grant sandboxes[{b}]={want}: {parent_id} holds only {held}",
                    reason="QUOTA_GRANT_EXCEEDS_HELD",
                )

    async def get_project(self, who: Principal, project_id: str) -> ProjectRecord:
        project_id = project_id or who.project_id
        self.require(who, ACTION_USE_SANDBOXES, project_id)
        rec = await self._run(self.store.get_project, project_id)
        if rec is None:
            raise NotFound(f"project {project_id} not found", reason="PROJECT_NOT_FOUND")
        return rec

    async def list_projects(
        self, who: Principal, parent_id: str, recursive: bool
    ) -> list[ProjectRecord]:
        parent_id = parent_id or who.project_id
        self.require(who, ACTION_USE_SANDBOXES, parent_id)
        return await self._run(self.store.list_projects, parent_id, recursive)  # type: ignore[no-any-return]

    async def set_quota(self, who: Principal, project_id: str, quota: Quota) -> ProjectRecord:
        self.require(who, ACTION_MANAGE_PROJECTS, project_id)
        if project_id == who.project_id:
            raise PermissionDenied(
                "a principal cannot change its own project's quota", reason="OWN_QUOTA"
            )
        parent = project_id.rsplit("/", 1)[0]
        await self._check_grant(parent, quota)
        return await self._run(self.store.set_quota, project_id, quota)  # type: ignore[no-any-return]

    async def delete_project(self, who: Principal, project_id: str) -> None:
        self.require(who, ACTION_MANAGE_PROJECTS, project_id)
        if project_id == who.project_id:
            raise PermissionDenied(
                "a principal cannot delete its own project", reason="OWN_PROJECT"
            )
        await self._run(self.store.delete_project, project_id)

    # -------------------------------------------------------------- tokens

    async def _new_token(
        self, project_id: str, name: str, kind: int, role: int, ttl_s: int, e2b: bool = False
    ) -> tuple[str, TokenRecord]:
        token_id = secrets.token_hex(8)
        if e2b:
            secret = secrets.token_hex(32)
        else:
            secret = secrets.token_urlsafe(32).replace("_", "A").replace("-", "B")
        now = time.time()
        rec = TokenRecord(
            token_id,
            name,
            project_id,
            kind,
            role,
            hash_secret(secret),
            now,
            now + ttl_s if ttl_s else None,
            False,
        )
        await self._run(self.store.add_token, rec)
        return (f"e2b_{token_id}{secret}" if e2b else f"dsec_{token_id}_{secret}"), rec

    async def create_token(
        self,
        who: Principal,
        project_id: str,
        name: str,
        kind: int,
        role: int,
        ttl_s: int,
        e2b: bool = False,
    ) -> tuple[str, TokenRecord]:
        project_id = project_id or who.project_id
        self.require(who, ACTION_MANAGE_TOKENS, project_id)
        role = role or ROLE_MEMBER
        if role not in (ROLE_ADMIN, ROLE_MEMBER):
            raise InvalidArgument(f"unknown role {role}")
        if role == ROLE_ADMIN and who.role != ROLE_ADMIN:
            raise PermissionDenied("cannot create a token with a higher role than your own")
        if not name or len(name) > 100:
            raise InvalidArgument("token name must be 1..100 characters")
        if await self._run(self.store.get_project, project_id) is None:
            raise NotFound(f"project {project_id} not found", reason="PROJECT_NOT_FOUND")
        return await self._new_token(project_id, name, kind or KIND_HUMAN, role, ttl_s, e2b)

    async def list_tokens(
        self, who: Principal, project_id: str, include_revoked: bool
    ) -> list[TokenRecord]:
        project_id = project_id or who.project_id
        self.require(who, ACTION_MANAGE_TOKENS, project_id)
        return await self._run(self.store.list_tokens, project_id, include_revoked)  # type: ignore[no-any-return]

    async def revoke_token(self, who: Principal, token_id: str) -> None:
        rec = await self._run(self.store.get_token, token_id)
        if rec is None or not within(rec.project_id, who.project_id):
            raise NotFound(f"token {token_id} not found", reason="TOKEN_NOT_FOUND")
        self.require(who, ACTION_MANAGE_TOKENS, rec.project_id)
        await self._run(self.store.revoke_token, token_id)

    # --------------------------------------------------------------- quota

    async def reserve(self, res: Reservation) -> ReserveOutcome:
        return (await self.reserve_many([res]))[0]

    async def reserve_many(self, items: list[Reservation]) -> list[ReserveOutcome]:
        """Reserves in one transaction, in order; an item that does not fit gets its error."""
        return await self._run(self.store.reserve_many, items)  # type: ignore[no-any-return]

    async def release(self, sandbox_ids: list[str], not_created: bool = False) -> int:
        return await self._run(self.store.release, sandbox_ids, not_created)  # type: ignore[no-any-return]

    async def reconcile(self, edge_id: str, live: set[str], as_of: float) -> int:
        """Releases reservations on ``edge_id`` made before ``as_of`` that it no longer reports."""
        held = await self._run(self.store.reservations_of_edge, edge_id, as_of)
        stale = [sid for sid in held if sid not in live]
        if stale:
            log.info(
                "releasing %d reservations edge %s no longer reports",
                len(stale),
                edge_id,
                extra={"edge_id": edge_id, "released": len(stale)},
            )
        return await self.release(stale) if stale else 0

    async def reserved_edges(self) -> dict[str, int]:
        return await self._run(self.store.reserved_edges)  # type: ignore[no-any-return]

    # --------------------------------------------------------------- queue
    # The store keeps each entry serialized (``QueueRow.body``); the servicer encodes and
    # decodes them (dsec.iam.v1.QueueEntry), so this module stays free of generated code.

    async def queue_add(self, rows: list[QueueRow]) -> list[QueueRow]:
        return await self._run(self.store.queue_add, rows)  # type: ignore[no-any-return]

    async def queue_get(self, queue_ids: list[str]) -> list[QueueRow]:
        return await self._run(self.store.queue_get, queue_ids)  # type: ignore[no-any-return]

    async def queue_list(self, project_prefix: str, waiting_only: bool) -> list[QueueRow]:
        return await self._run(self.store.queue_list, project_prefix, waiting_only)  # type: ignore[no-any-return]

    async def queue_update(self, queue_ids: list[str], change: QueueChange) -> list[QueueRow]:
        """``change`` runs on each row inside the store's transaction (see IamStore)."""
        return await self._run(self.store.queue_update, queue_ids, change)  # type: ignore[no-any-return]

    async def queue_shares(self, project_ids: set[str]) -> tuple[dict[str, int], dict[str, float]]:
        """What each project's subtree holds now (its usage) and its weight (its quota's)."""

        def read() -> tuple[dict[str, int], dict[str, float]]:
            in_use, weights = {}, {}
            for pid in project_ids:
                rec = self.store.get_project(pid)
                in_use[pid] = rec.usage.sandboxes if rec is not None else 0
                weights[pid] = rec.quota.share_weight if rec is not None else 0.0
            return in_use, weights

        return await self._run(read)  # type: ignore[no-any-return]

    async def lease(self, name: str, holder: str, ttl_s: float) -> tuple[bool, str]:
        return await self._run(self.store.lease, name, holder, ttl_s, time.time())  # type: ignore[no-any-return]

    async def purge_loop(self, interval_s: float = 600.0) -> None:
        """Forgets idempotency keys older than their 24 h lifetime, and queue entries that
        ended more than an hour ago, now and then."""
        while True:
            n = await self._run(self.store.purge_expired_keys)
            if n:
                log.info("purged %d expired idempotency keys", n)
            n = await self._run(self.store.queue_purge, time.time() - QUEUE_RETENTION_S)
            if n:
                log.info("purged %d ended queue entries", n)
            await asyncio.sleep(interval_s)
