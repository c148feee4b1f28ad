"""Completion of work queued to the owner threads: a ``Ticket`` counts the parts of one request
split over several threads, and ``owner_future`` turns its completion into an asyncio future (the
one bridge from owner threads back to the event loop)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


class Ticket:
    """Completion of a request split over several owner threads; `on_done` runs on the last one.

    ``on_done(result, exc)`` is called exactly once, from an owner thread.
    """

    __slots__ = ("_lock", "_remaining", "result", "error", "_on_done")

    def __init__(self, parts: int, on_done: Callable[[Any, BaseException | None], None]) -> None:
        self._lock = threading.Lock()
        self._remaining = parts
        #: shard id -> version (pushes, pulls) or other per-part results
        self.result: dict[str, Any] = {}
        self.error: BaseException | None = None
        self._on_done = on_done
        if parts == 0:
            on_done(self.result, None)

    def part_done(self, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._on_done(self.result, self.error)


def owner_future(submit: Callable[[Callable[[Any, BaseException | None], None]], Any]) -> Any:
    """Calls ``submit(on_done)`` now (a Store method taking a completion callback) and returns an
    asyncio future of its result: the owner thread that completes the work resolves it through
    ``call_soon_threadsafe``. The one bridge from owner threads to the event loop."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def resolve(result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    submit(lambda result, error: loop.call_soon_threadsafe(resolve, result, error))
    return fut
