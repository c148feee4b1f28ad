"""The background scrub (issue 29): verifies every LMDB record against its checksum at a bounded
rate, so that a bit flipped on disk is found while the copy in memory (the replicated one) can
still rewrite it, not at the next restart.

One daemon thread; each step verifies about ``rate * step`` bytes (at most ``MAX_STEP``, so a
flush never waits long for the environment's lock) in one short read transaction
(``Persister.scan``) and then sleeps so that the bytes read per second stay at most ``rate`` (a
record larger than a step's budget is read whole, and the sleep grows to match); a finished pass
waits at least one step before the next, so a small environment is not re-read in a spin. What to do
with a damaged record is the caller's (``on_failure``): the server marks the shard dirty, or
the copy's position fresh, so the next flush rewrites it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from adamps.server.persist import Persister

log = logging.getLogger(__name__)

#: most bytes one step reads while holding the environment's lock
MAX_STEP = 4 << 20


class Scrubber:
    """Owned by the parameter server; the thread is the only caller of ``step``."""

    def __init__(
        self,
        persister: Persister,
        rate: int,
        on_failure: Callable[[str, bytes, Exception], None],
        on_bytes: Callable[[int], None] = lambda n: None,
        step: float = 0.25,
    ) -> None:
        self.persister = persister
        #: bytes per second at most
        self.rate = rate
        self.step_seconds = step
        self.on_failure = on_failure
        self.on_bytes = on_bytes
        #: the last (db, key) verified in the current pass (None: a pass starts)
        self.after: tuple[str, bytes] | None = None
        #: whole passes over the environment completed
        self.passes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.rate <= 0:
            return
        self._thread = threading.Thread(target=self._run, name="adamps-scrub", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def step(self) -> int:
        """Verifies the next records (about one step's budget); returns the bytes read."""
        budget = min(MAX_STEP, max(4096, int(self.rate * self.step_seconds)))
        failures, self.after, nbytes = self.persister.scan(self.after, budget)
        if self.after is None:
            self.passes += 1
        self.on_bytes(nbytes)
        for db, key, exc in failures:
            self.on_failure(db, key, exc)
        return nbytes

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                nbytes = self.step()
            except Exception:  # an environment closing under us, or a read error: logged
                log.exception("scrub step failed")
                nbytes = 0
            # The rate bound: each step waits as long as its bytes take at `rate`.
            wait = nbytes / self.rate
            if self.after is None:
                wait = max(wait, self.step_seconds)
            if self._stop.wait(wait):
                return
