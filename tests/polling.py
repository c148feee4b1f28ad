"""Polling for the system tests: wait until a condition on real processes holds, or fail saying
what was awaited and what was seen last."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    """`pred()`'s first truthy value within `timeout` seconds; an OSError (a process not
    answering yet) counts as not yet."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")
