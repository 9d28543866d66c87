"""epoll, shaped like the subset of `selectors` that aether and chronus's reactor use.

`selectors` imports `collections` (namedtuple) and `collections.abc`: ~2 ms of CPU per sandbox
start here, before aether can answer its Hello. `select.epoll` is a C module.
"""

from __future__ import annotations

import select

EVENT_READ = 1
EVENT_WRITE = 2

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class Key:
    __slots__ = ("data", "events", "fd", "fileobj")

    def __init__(self, fileobj: Any, fd: int, events: int, data: Any) -> None:
        self.fileobj, self.fd, self.events, self.data = fileobj, fd, events, data


def _fd(fileobj: Any) -> int:
    return fileobj if isinstance(fileobj, int) else int(fileobj.fileno())


def _mask(events: int) -> int:
    return (select.EPOLLIN if events & EVENT_READ else 0) | (
        select.EPOLLOUT if events & EVENT_WRITE else 0
    )


class Poller:
    def __init__(self) -> None:
        self._ep = select.epoll()
        self._keys: dict[int, Key] = {}

    def get_map(self) -> dict[int, Key]:
        return self._keys

    def register(self, fileobj: Any, events: int, data: Any = None) -> Key:
        fd = _fd(fileobj)
        if fd in self._keys:
            raise KeyError(f"fd {fd} is already registered")
        self._ep.register(fd, _mask(events))
        key = self._keys[fd] = Key(fileobj, fd, events, data)
        return key

    def modify(self, fileobj: Any, events: int, data: Any = None) -> Key:
        key = self._keys[_fd(fileobj)]
        if events != key.events:
            try:
                self._ep.modify(key.fd, _mask(events))
            except OSError:
                # as selectors does: a failed modify (say the fd was closed and its number
                # reused) drops the key, so that a later register starts afresh
                del self._keys[key.fd]
                raise
            key.events = events
        key.data = data if data is not None else key.data
        return key

    def unregister(self, fileobj: Any) -> Key:
        key = self._keys.pop(_fd(fileobj))
        try:
            self._ep.unregister(key.fd)
        except OSError:
            pass  # already closed: the kernel dropped it
        return key

    def select(self, timeout: float | None = None) -> list[tuple[Key, int]]:
        if timeout is not None:
            timeout = max(timeout, 0.0)
        ready = []
        for fd, mask in self._ep.poll(-1 if timeout is None else timeout, max(len(self._keys), 1)):
            key = self._keys.get(fd)
            if key is None:
                continue
            events = 0
            if mask & ~select.EPOLLOUT:  # IN, HUP, ERR: readable (a read tells which)
                events |= EVENT_READ
            if mask & ~select.EPOLLIN:  # OUT, HUP, ERR
                events |= EVENT_WRITE
            if events & key.events:
                ready.append((key, events & key.events))
        return ready

    def close(self) -> None:
        self._ep.close()
        self._keys.clear()
