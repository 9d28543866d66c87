"""Bounded output capture: the head and the tail of a stream, never more.

An agent that runs `yes` must not grow chronus: at most `cap` bytes are held
per stream (the first half and the last half of everything produced), and the
total is counted so the caller learns how much was dropped.
"""

from __future__ import annotations

from _collections import deque  # not `collections`: see chronus.threads


def truncation_marker(dropped: int) -> bytes:
    return b"\n[... dsec: %d bytes truncated ...]\n" % dropped


class OutputBuffer:
    """Head and tail of one output stream, addressed by stream offsets."""

    __slots__ = ("_tail", "cap", "head", "head_cap", "tail_cap", "tail_len", "total")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self._tail: deque[bytes] = deque()
        self.tail_len = 0
        self.total = 0

    def append(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        if len(data) >= self.tail_cap:
            self._tail.clear()
            self._tail.append(data[len(data) - self.tail_cap :])
            self.tail_len = self.tail_cap
            return
        self._tail.append(data)
        self.tail_len += len(data)
        while self.tail_len > self.tail_cap:
            excess = self.tail_len - self.tail_cap
            first = self._tail[0]
            if len(first) <= excess:
                self._tail.popleft()
                self.tail_len -= len(first)
            else:
                self._tail[0] = first[excess:]
                self.tail_len -= excess

    @property
    def dropped(self) -> int:
        return self.total - len(self.head) - self.tail_len

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def held_from(self, offset: int) -> list[tuple[int, bytes]]:
        """Held pieces at or after `offset`, as (stream offset, data)."""
        pieces: list[tuple[int, bytes]] = []
        if offset < len(self.head):
            pieces.append((offset, bytes(self.head[offset:])))
        pos = self.total - self.tail_len
        for chunk in self._tail:
            end = pos + len(chunk)
            if end > offset:
                skip = max(0, offset - pos)
                pieces.append((pos + skip, chunk[skip:]))
            pos = end
        return pieces

    def result(self) -> bytes:
        """Head, then a marker and the tail when something was dropped."""
        tail = b"".join(self._tail)
        if self.truncated:
            return bytes(self.head) + truncation_marker(self.dropped) + tail
        return bytes(self.head) + tail
