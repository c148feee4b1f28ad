"""The background scrub (issue 29): verifies every LMDB record against its checksum at a bounded
rate, so that a bit flipped on disk is found while the copy in memory (the replicated one) can
still rewrite it, not at the next restart.

One daemon thread, bounded twice (issue 36: idle costs nothing). Each step verifies about
``rate * step`` bytes (at most ``MAX_STEP``, so a flush never waits long for the environment's
lock) in one short read transaction (``Persister.scan``), then sleeps as long as the longer of two
bounds requires: the bytes read per second stay at most ``rate`` (the disk's share), and the
thread's own CPU time (``time.thread_time``) stays at most ``cpu`` of one core (``budget_wait``:
many small records, such as an embedding table's rows, cost more CPU per byte than shards). A
record larger than a step's budget is read whole, and the sleep grows to match. A finished pass
waits until ``MIN_PASS`` seconds after it began, so a small environment is not re-read in a spin.
What to do with a damaged record is the caller's (``on_failure``): the server marks the shard
dirty, or the copy's position fresh, so the next flush rewrites it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from adamps.server.storage.persist import Persister

log = logging.getLogger(__name__)

#: most bytes one step reads while holding the environment's lock
MAX_STEP = 4 << 20
#: seconds a whole pass lasts at least (a small environment is verified every 10 s at most)
MIN_PASS = 10.0


def budget_wait(cpu: float, elapsed: float, budget: float) -> float:
    """Seconds to sleep after a step that used `cpu` seconds of its thread's CPU time in
    `elapsed` seconds of wall time, so that the thread uses at most `budget` (a fraction of one
    core) over the step and its sleep: together they last ``cpu / budget``."""
    if not 0 < budget <= 1:
        raise ValueError(f"a CPU budget is a fraction of one core in (0, 1], not {budget}")
    return max(0.0, cpu / budget - elapsed)


class Scrubber:
    """Owned by the parameter server; the thread is the only caller of ``step``."""

    def __init__(
        self,
        persister: Persister,
        rate: int,
        on_failure: Callable[[str, bytes, Exception], None],
        on_bytes: Callable[[int], None] = lambda n: None,
        step: float = 0.25,
        cpu: float = 0.005,
        min_pass: float = MIN_PASS,
    ) -> None:
        self.persister = persister
        #: bytes per second at most
        self.rate = rate
        #: fraction of one core the thread uses at most (its own CPU time)
        self.cpu = cpu
        budget_wait(0.0, 0.0, cpu)  # a bad budget is refused here, not in the thread
        self.min_pass = min_pass
        #: seconds of CPU time the thread's steps used
        self.cpu_used = 0.0
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
        began = time.monotonic()
        while not self._stop.is_set():
            t0, c0 = time.monotonic(), time.thread_time()
            try:
                nbytes = self.step()
            except Exception:  # an environment closing under us, or a read error: logged
                log.exception("scrub step failed")
                nbytes = 0
            now, cpu = time.monotonic(), time.thread_time() - c0
            self.cpu_used += cpu
            # The rate bound (the step's bytes at `rate`) and the CPU bound, whichever is longer.
            wait = max(nbytes / self.rate, budget_wait(cpu, now - t0, self.cpu))
            if self.after is None:  # a pass ended: the next begins min_pass after this one did
                wait = max(wait, self.step_seconds, began + self.min_pass - now)
                began = now + wait
            if self._stop.wait(wait):
                return
