"""The edge's connection to libvirtd, and libvirt's domain events brought onto the event loop.

libvirt-python is blocking: every call runs in a worker thread (`call`). Its events need an
event loop of libvirt's own: `virEventRegisterDefaultImpl` once per process and a daemon thread
running `virEventRunDefaultImpl`. Lifecycle events (a domain stopped, crashed, was saved) are
handed to the asyncio loop with `call_soon_threadsafe`.

libvirtd may restart (its supervisor brings it back) or be unreachable: a call then raises
Unavailable (reason LIBVIRT_UNREACHABLE) after one reconnect attempt; any other refusal of
libvirt's is FAILED_PRECONDITION (reason LIBVIRT_ERROR) with libvirt's message; domains keep running
meanwhile (QEMU does not depend on libvirtd), so a sandbox is not ended for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import libvirt

from libdsec.errors import FailedPrecondition, Unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")
#: (domain name, event, detail) on the edge's loop.
EventCallback = Callable[[str, int, int], None]

_event_impl_lock = threading.Lock()
_event_impl_started = False


def _start_event_impl() -> None:
    global _event_impl_started
    with _event_impl_lock:
        if _event_impl_started:
            return
        libvirt.virEventRegisterDefaultImpl()

        def run() -> None:
            while True:
                try:
                    libvirt.virEventRunDefaultImpl()
                except libvirt.libvirtError as exc:  # keep serving events
                    log.warning("libvirt event loop: %s", exc)

        threading.Thread(target=run, name="libvirt-events", daemon=True).start()
        _event_impl_started = True


# libvirt logs every error it raises to stderr unless a handler takes them: the edge reports
# them itself, where they matter.
libvirt.registerErrorHandler(lambda _ctx, _err: None, None)


class Libvirt:
    def __init__(self, uri: str) -> None:
        self.uri = uri
        self._conn: libvirt.virConnect | None = None
        self._lock = threading.Lock()
        self._on_event: EventCallback | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._callback_id: int | None = None

    def open(self) -> libvirt.virConnect:
        """The connection (opened, or opened again after libvirtd went). Blocking."""
        with self._lock:
            conn = self._conn
            if conn is not None:
                try:
                    if conn.isAlive():
                        return conn
                except libvirt.libvirtError:
                    pass
                with contextlib.suppress(libvirt.libvirtError):
                    conn.close()
                self._conn = None
            try:
                conn = libvirt.open(self.uri)
            except libvirt.libvirtError as exc:
                raise Unavailable(
                    f"libvirtd is unreachable at {self.uri}: {exc.get_error_message()}",
                    reason="LIBVIRT_UNREACHABLE",
                ) from exc
            self._conn = conn
            if self._on_event is not None:
                self._register(conn)
            return conn

    async def call(self, fn: Callable[[libvirt.virConnect], T]) -> T:
        """`fn(connection)` in a worker thread; a lost connection is reopened once."""

        def run() -> T:
            conn = self.open()
            try:
                return fn(conn)
            except libvirt.libvirtError as exc:
                if exc.get_error_code() not in (
                    libvirt.VIR_ERR_SYSTEM_ERROR,
                    libvirt.VIR_ERR_RPC,
                    libvirt.VIR_ERR_NO_CONNECT,
                    libvirt.VIR_ERR_INVALID_CONN,
                ):
                    raise
                with self._lock:
                    self._conn = None
                return fn(self.open())

        try:
            return await asyncio.to_thread(run)
        except libvirt.libvirtError as exc:
            raise FailedPrecondition(
                f"libvirt: {exc.get_error_message()}", reason="LIBVIRT_ERROR"
            ) from exc
        except SystemError as exc:
            # libvirt-python cannot decode an error message that is not UTF-8 (QEMU's words
            # about a corrupt saved state, say): still libvirt's refusal.
            cause = exc.__cause__ or exc.__context__ or exc
            raise FailedPrecondition(
                f"libvirt failed with a message that is not UTF-8 ({cause})",
                reason="LIBVIRT_ERROR",
            ) from exc

    def watch(self, on_event: EventCallback) -> None:
        """Domain lifecycle events from now on, delivered on the running loop."""
        _start_event_impl()
        self._loop = asyncio.get_running_loop()
        self._on_event = on_event
        with contextlib.suppress(Unavailable):
            conn = self.open()
            with self._lock:
                self._register(conn)

    def _register(self, conn: libvirt.virConnect) -> None:
        loop = self._loop
        on_event = self._on_event
        if loop is None or on_event is None:
            return

        def lifecycle(_conn: Any, dom: Any, event: int, detail: int, _opaque: Any) -> None:
            name = dom.name()
            with contextlib.suppress(RuntimeError):  # the loop closed (edge stopping)
                loop.call_soon_threadsafe(on_event, name, event, detail)

        self._callback_id = conn.domainEventRegisterAny(
            None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, lifecycle, None
        )

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(libvirt.libvirtError):
                if self._callback_id is not None:
                    conn.domainEventDeregisterAny(self._callback_id)
                conn.close()


def lookup(conn: libvirt.virConnect, name: str) -> libvirt.virDomain | None:
    """The domain `name`, or None if libvirt has none of that name."""
    try:
        return conn.lookupByName(name)
    except libvirt.libvirtError as exc:
        if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
            return None
        raise


STOPPED_DETAIL = {
    libvirt.VIR_DOMAIN_EVENT_STOPPED_SHUTDOWN: "shut down",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_DESTROYED: "destroyed",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_CRASHED: "crashed",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_MIGRATED: "migrated",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_SAVED: "saved",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_FAILED: "failed (QEMU exited)",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_FROM_SNAPSHOT: "reverted to a snapshot",
}
