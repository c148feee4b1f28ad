"""How the background flush thread spends its time, for telling a stalled disk from a starved
process (issue 39; the rule is adamps/core/flush_stall.py).

The flush thread records, as it goes, when it pauses between flushes, when it waits for the
server's threads to cut the dirty shards, and when it waits for the store's lock (`OwnedLock`:
that wait is the holder's time, running or waiting for a CPU, or asleep: then the disk's), and
samples its kernel counters (CPU time, run-queue wait) at each of those boundaries. `over(start, now)` then
gives any thread the flush thread's account of the interval since `start` (the loss window):
what it did not spend running, waiting for a CPU, pausing or waiting for the cut was spent
asleep in the write, on the disk.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from adamps.core import flush_stall
from adamps.core.flush_stall import FlushInterval, ThreadTimes

#: samples kept (one at each pause and cut boundary: minutes of history at a 1 s interval)
SAMPLES = 512


def thread_times(tid: int) -> ThreadTimes | None:
    """Thread `tid`'s CPU time and run-queue wait so far (Linux schedstat), or None where the
    kernel does not count them."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return flush_stall.parse_schedstat(f.read())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class _Sample:
    at: float
    times: ThreadTimes
    #: cumulative seconds asleep in pauses, and waiting for the server's threads, up to `at`
    paused: float
    threads: float


class OwnedLock:
    """A lock that knows which thread holds it (its kernel id), so that a wait for it can be
    charged to what the holder was doing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: the holder's kernel thread id (None: free)
        self.holder: int | None = None

    def acquire(self) -> None:
        self._lock.acquire()
        self.holder = threading.get_native_id()

    def release(self) -> None:
        self.holder = None
        self._lock.release()

    def __enter__(self) -> OwnedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class FlushTimes:
    """The flush thread's account. Written by that thread (`attach`, `phase`), read by any."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        #: the flush thread's kernel id (None: not started, or no schedstat here)
        self._tid: int | None = None
        self._paused = 0.0
        self._threads = 0.0
        #: the phase in progress: (kind, when it began, the thread's times then)
        self._open: tuple[str, float, ThreadTimes] | None = None
        self._samples: deque[_Sample] = deque(maxlen=SAMPLES)

    def attach(self) -> None:
        """Called by the flush thread as it starts: it is the thread accounted."""
        tid = threading.get_native_id()
        if thread_times(tid) is not None:
            self._tid = tid
            self._sample()

    @contextmanager
    def phase(self, kind: str) -> Iterator[None]:
        """Around a pause ("paused") or a wait for the server's threads ("threads") of the
        flush thread (any other thread: nothing is accounted)."""
        tid = self._tid
        if tid is None or threading.get_native_id() != tid:
            yield
            return
        t0, times0 = self.clock(), thread_times(tid)
        if times0 is None:
            yield
            return
        with self._lock:
            self._open = (kind, t0, times0)
        try:
            yield
        finally:
            with self._lock:
                self._close(self.clock(), thread_times(tid))
                self._open = None
            self._sample()

    @contextmanager
    def waiting_for(self, lock: OwnedLock) -> Iterator[None]:
        """Around the flush thread's wait for `lock`: the time it slept there counts as
        waiting for the server's threads for the share of it its holder spent running or
        waiting for a CPU; the rest (the holder asleep: on the disk) stays the disk's."""
        tid, holder = self._tid, lock.holder
        if tid is None or holder is None or threading.get_native_id() != tid:
            yield
            return
        t0, mine0, theirs0 = self.clock(), thread_times(tid), thread_times(holder)
        try:
            yield
        finally:
            mine1, theirs1 = thread_times(tid), thread_times(holder)
            spent = self.clock() - t0
            if None not in (mine0, mine1, theirs0, theirs1) and spent > 0:
                me = mine1.minus(mine0)  # type: ignore[union-attr]
                them = theirs1.minus(theirs0)  # type: ignore[union-attr]
                busy = min(1.0, (them.run + them.wait) / spent)
                with self._lock:
                    self._threads += max(0.0, spent - me.run - me.wait) * busy

    def _close(self, now: float, times: ThreadTimes | None) -> None:
        """Adds the open phase's time asleep to its kind's total (under the lock)."""
        if self._open is None or times is None:
            return
        kind, t0, times0 = self._open
        spent = times.minus(times0)
        asleep = max(0.0, now - t0 - spent.run - spent.wait)
        if kind == "paused":
            self._paused += asleep
        else:
            self._threads += asleep
        self._open = (kind, now, times)

    def _now(self) -> _Sample | None:
        tid = self._tid
        times = None if tid is None else thread_times(tid)
        if times is None:
            return None
        with self._lock:
            now = self.clock()
            self._close(now, times)
            return _Sample(now, times, self._paused, self._threads)

    def _sample(self) -> None:
        s = self._now()
        if s is not None:
            with self._lock:
                self._samples.append(s)

    def over(self, start: float) -> FlushInterval | None:
        """The flush thread's account from `start` (or its oldest sample after it) until now;
        None where nothing is measured."""
        end = self._now()
        with self._lock:
            samples = list(self._samples)
        if end is None or not samples:
            return None
        first = samples[0]
        for s in samples:
            if s.at > start:
                break
            first = s
        return FlushInterval(
            end.at - first.at,
            end.times.minus(first.times),
            paused=end.paused - first.paused,
            threads=end.threads - first.threads,
        )
