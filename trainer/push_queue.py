"""The push queue between the replica's main thread (the producer) and its push thread."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from trainer.packing import PushItem


class PushQueue:
    """A FIFO of PushItems and markers (callables run by the push thread in order) that never
    blocks the producer: beyond ``limit`` items a new PushItem is merged into the last one."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._busy = 0  #: items taken by the consumer and not yet done
        self.merged = 0  #: items merged because the queue was full

    def put(self, item: PushItem | Callable[[], None] | None) -> None:
        with self._cond:
            last = self._items[-1] if self._items else None
            if (
                isinstance(item, PushItem)
                and isinstance(last, PushItem)
                and len(self._items) >= self.limit
            ):
                last.merge(item)
                self.merged += 1
            else:
                self._items.append(item)
            self._cond.notify_all()

    def get(self) -> Any:
        with self._cond:
            while not self._items:
                self._cond.wait()
            self._busy += 1
            return self._items.popleft()

    def done(self) -> None:
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def pending(self) -> list[PushItem]:
        """The PushItems not yet taken by the consumer (only the producer may merge into them,
        so the caller, being the producer, can read them without the lock)."""
        with self._cond:
            return [x for x in self._items if isinstance(x, PushItem)]

    def join(self, timeout: float, alive: Callable[[], bool] = lambda: True) -> bool:
        """Waits until everything queued was processed; False on timeout or a dead consumer."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._items or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not alive():
                    return False
                self._cond.wait(min(left, 0.2))
        return True
