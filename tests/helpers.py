"""Small helpers shared by tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout_s: float = 15.0, interval_s: float = 0.1) -> Any:
    """Polls until ``predicate()`` is truthy and returns that value (not a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)
