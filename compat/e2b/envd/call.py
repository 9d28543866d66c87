"""What an envd request is about: whose client, which sandbox, which user.

The router (``compat.e2b.app``) authenticates the request, leases the caller's client and
sets :data:`CALL` before handing the request to a Connect service or a REST handler, so the
service methods (which connectrpc calls with the message and headers only) know the rest.
"""

from __future__ import annotations

import posixpath
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from compat.config import CompatConfig
from compat.e2b import dsec
from compat.e2b.errors import connect_error, sandbox_gone
from compat.e2b.mapping import LABEL_USER, LABEL_WORKDIR
from libdsec import AsyncClient, AsyncSandbox
from libdsec.errors import DSecError, Unavailable

T = TypeVar("T")

#: envd's default keepalive interval when the SDK sends no Keepalive-Ping-Interval.
DEFAULT_KEEPALIVE_S = 90.0


@dataclass(frozen=True)
class EnvdCall:
    client: AsyncClient
    sandbox_id: str
    #: the user the SDK named (Authorization: Basic), "" = the default user
    user: str
    config: CompatConfig
    #: seconds between keepalive events on an idle stream (Keepalive-Ping-Interval)
    keepalive_s: float = DEFAULT_KEEPALIVE_S
    #: the sandbox's default user (its template's, :class:`DefaultUsers`)
    default_user: str = "root"
    #: the working directory of its commands when the SDK names none: its template's
    #: (``e2b.workdir``), else "" (the user's home)
    default_workdir: str = ""
    #: set when the sandbox ended under a stream that was under way: the router then drops
    #: the connection instead of sending the stream's end (:class:`ConnectionDropped`)
    dropped: list[str] = field(default_factory=list)

    @property
    def sandbox(self) -> AsyncSandbox:
        return dsec.sandbox(self.client, self.sandbox_id)

    @property
    def effective_user(self) -> str:
        return self.user or self.default_user

    @property
    def run_as(self) -> str:
        """The user to pass to dsec: "" for root (chronus's own: no switch)."""
        return "" if self.effective_user == "root" else self.effective_user

    @property
    def home(self) -> str:
        user = self.effective_user
        return "/root" if user == "root" else f"/home/{user}"

    def resolve(self, path: str) -> str:
        """envd's rule: a relative path (or ``~``) is relative to the user's home."""
        if path.startswith("~"):
            path = self.home + path[1:]
        if not path.startswith("/"):
            path = posixpath.join(self.home, path)
        return posixpath.normpath(path)

    def error(self, exc: DSecError) -> ConnectError:
        return connect_error(exc, self.sandbox_id)


class DefaultUsers:
    """Each sandbox's default user and working directory, from the labels its create through
    this front end set (``e2b.user``: its template's user; ``e2b.workdir``: a built template's
    workdir); kept per sandbox id, which is never reused. A sandbox made otherwise has none:
    the configured default user, the user's home."""

    #: Sandboxes remembered (the oldest are forgotten first).
    MAX = 10_000

    def __init__(self, config: CompatConfig) -> None:
        self.config = config
        self._known: dict[str, tuple[str, str]] = {}

    async def of(self, client: AsyncClient, sandbox_id: str) -> tuple[str, str]:
        """(user, workdir) of ``sandbox_id``."""
        known = self._known.get(sandbox_id)
        if known is not None:
            return known
        try:
            info = await client.get(sandbox_id)
        except DSecError:
            # Not this caller's sandbox, or gone: the call itself fails with the reason.
            return self.config.default_user, ""
        labels = info.info.labels
        known = (labels.get(LABEL_USER) or self.config.default_user, labels.get(LABEL_WORKDIR, ""))
        if len(self._known) >= self.MAX:
            del self._known[next(iter(self._known))]
        self._known[sandbox_id] = known
        return known


CALL: ContextVar[EnvdCall] = ContextVar("compat_e2b_envd_call")


def current() -> EnvdCall:
    return CALL.get()


def invalid(message: str) -> ConnectError:
    return ConnectError(Code.INVALID_ARGUMENT, message)


class ConnectionDropped(Exception):
    """Raised out of the ASGI app, in place of a stream's last bytes, so that the HTTP
    server closes the connection mid-response: what a client of E2B sees when the sandbox
    under its stream is killed (the connection to the sandbox drops). Every SDK version
    reads a connection dropped mid-request as a transport failure, probes ``/health``
    and, the sandbox being gone, says it "was killed or reached its end of life while the
    request was in flight"; an ``unavailable`` end message is read so only by SDKs from
    2.5x on (older ones call it a timeout)."""

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox {sandbox_id} ended under a stream: connection dropped")
        self.sandbox_id = sandbox_id


def ended_midstream(sandbox_id: str) -> ConnectError:
    """What a stream that was under way ends with when its sandbox ends (killed, or its
    TTL), for whoever still reads the end: the router drops the connection first
    (:class:`ConnectionDropped`), as E2B's does. An UNAVAILABLE whose message names neither
    of the proxy's answers ("was not found", "port is not open"), which the SDK (2.5x and
    later) treats as a dropped connection: it probes ``/health`` and, the sandbox being
    gone, raises ``SandboxNotRunningException``. A "was not found" here would skip the
    probe and blame the sandbox's TTL."""
    return ConnectError(
        Code.UNAVAILABLE,
        f"the connection to sandbox {sandbox_id} ended before the stream completed"
        " (the sandbox was killed or ended)",
    )


async def mapped(fn: Callable[[], AsyncIterator[T]]) -> AsyncIterator[T]:
    """A server stream whose dsec errors leave as Connect errors; once a message has been
    sent, a sandbox that ends (or its channel closing) is :func:`ended_midstream`."""
    call = current()
    started = False
    try:
        async for item in fn():
            started = True
            yield item
    except DSecError as exc:
        if started and (sandbox_gone(exc) or isinstance(exc, Unavailable)):
            # the channel to the sandbox closed under the stream (a kill closes it before
            # the sandbox is reported gone): as on E2B, the connection drops, and the SDK's
            # probe tells which it was
            call.dropped.append(call.sandbox_id)
            raise ended_midstream(call.sandbox_id) from None
        raise call.error(exc) from None
