"""The replica's background threads (push, fetch, board): daemons whose failure the main thread
raises at its next check, so that a dead thread stops the training instead of stalling it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Loop(threading.Thread):
    """A daemon thread whose exception is kept for the main thread to raise."""

    def __init__(self, name: str, target: Callable[[], None]) -> None:
        super().__init__(name=name, daemon=True)
        self._target_fn = target
        self.error: BaseException | None = None
        self.cpu_seconds = 0.0

    def run(self) -> None:
        try:
            self._target_fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            log.exception("%s thread failed", self.name)
            self.error = exc
        finally:
            self.cpu_seconds = time.thread_time()  #: CPU this thread used (where time goes)

    def check(self) -> None:
        """Raises in the calling (main) thread if this thread failed or stopped."""
        if self.error is not None:
            raise RuntimeError(f"the {self.name} thread failed: {self.error!r}") from self.error
        if not self.is_alive():
            raise RuntimeError(f"the {self.name} thread stopped")
