"""How long a process's event loop was held by something other than waiting (issue 39).

A request that computes or allocates a lot on the event loop holds every connection of its
process: heartbeats go unanswered and a server is declared dead. The probe is a task that
sleeps at most `PERIOD` seconds over and over and records how late each wake-up comes
(``adamps_event_loop_lag_seconds``). On a loaded machine a late wake-up may only mean that the
process waited for a CPU; Linux counts that wait per thread (``/proc/thread-self/schedstat``,
the second field: nanoseconds runnable but not running), so the probe also records the lag
less that wait (``adamps_event_loop_blocked_seconds``): the time the loop itself computed or
waited for IO. The tests' bound ("no request holds the loop for more than 100 ms",
tests/system/test_loop_lag.py) is on the blocked time, which a busy machine does not inflate.

Every role's HTTP app starts one (adamps/wire/web.py). It wakes at most every `PERIOD` seconds,
``$ADAMPS_LOOP_PROBE_PERIOD`` (default 0.25 s): at 10 ms a wake-up's few tens of microseconds came
to 1.3% of a core per process, most of what an idle cluster spent (issue 36: idle costs
nothing). It rides the loop's other timers (adamps/wire/ride.py): it runs with the latest timer
already due within the second half of its period, and wakes the loop itself only when there is
none. A block of B seconds is seen as at least B - PERIOD, so a test that bounds holds at
100 ms (tests/system/test_loop_lag.py) sets 0.01.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import traceback

from prometheus_client import CollectorRegistry, Histogram

from adamps.wire import ride

log = logging.getLogger(__name__)

#: seconds between two wake-ups (a block of B seconds is seen as at least B - PERIOD)
PERIOD = float(os.environ.get("ADAMPS_LOOP_PROBE_PERIOD") or 0.25)
#: the histograms' buckets (seconds)
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: a lag above this is logged (at most once per `WARN_INTERVAL`)
WARN_ABOVE = 1.0
WARN_INTERVAL = 30.0


class _Schedstat:
    """The loop thread's ``/proc/thread-self/schedstat``, opened once and re-read in place
    (``pread``: 3 us a read, against 20 us for an open and a read, twice per probe wake-up: a
    tenth of an idle loop's time, issue 36). Opened by the first read, on the loop's thread:
    ``thread-self`` names the thread that opens it."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._thread = -1

    def seconds(self) -> float | None:
        """Seconds the loop's thread has spent runnable but not running (None where unknown)."""
        try:
            if self._fd is None or self._thread != threading.get_ident():
                self.close()
                self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
                self._thread = threading.get_ident()
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return None

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class LoopLag:
    """The probe of one event loop. `start` and `stop` on that loop."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lag = Histogram(
            "adamps_event_loop_lag_seconds",
            f"how late the event loop's {PERIOD * 1000:g} ms probe timer woke (the loop was "
            "busy, or the process waited for a CPU)",
            buckets=BUCKETS,
            registry=registry,
        )
        self.blocked = Histogram(
            "adamps_event_loop_blocked_seconds",
            "the same lag less the time the loop's thread waited for a CPU (schedstat): how "
            "long one piece of work held the event loop",
            buckets=BUCKETS,
            registry=registry,
        )
        #: the largest blocked time seen (seconds; for tests and /status)
        self.worst = 0.0
        self._task: asyncio.Task | None = None
        self._warned = -1e9
        self._beat = 0.0
        self._sched = _Schedstat()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")
            if os.environ.get("ADAMPS_LOOP_STACKS"):
                self._watch(threading.get_ident(), float(os.environ["ADAMPS_LOOP_STACKS"]))

    def _watch(self, loop_thread: int, after: float) -> None:
        """A debugging aid (``ADAMPS_LOOP_STACKS=<seconds>``): a thread that logs the loop
        thread's stack whenever the probe has not woken for `after` seconds."""
        self._beat = time.monotonic()

        def watch() -> None:
            while self._task is not None:
                time.sleep(after / 4)
                held = time.monotonic() - self._beat  # read once: the loop may beat meanwhile
                if held > after:
                    names = {t.ident: t.name for t in threading.enumerate()}
                    stacks = [
                        f"thread {names.get(tid, tid)}"
                        + (" (the loop)" if tid == loop_thread else "")
                        + ":\n"
                        + "".join(traceback.format_stack(frame)[-5:])
                        for tid, frame in sys._current_frames().items()
                        if tid != threading.get_ident()
                    ]
                    log.warning(
                        "event loop held %.2f s so far (wall clock: a wait for a CPU too); "
                        "the threads were at:\n%s",
                        held,
                        "\n".join(stacks),
                    )
                    self._beat = time.monotonic()

        threading.Thread(target=watch, name="loop-lag-watch", daemon=True).start()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._sched.close()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            w0 = self._sched.seconds()
            due = await ride.sleep(PERIOD)
            self._beat = time.monotonic()
            late = max(0.0, loop.time() - due)
            w1 = self._sched.seconds()
            waited = w1 - w0 if w0 is not None and w1 is not None else 0.0
            self.record(late, max(0.0, late - waited))

    def record(self, late: float, blocked: float) -> None:
        self.lag.observe(late)
        self.blocked.observe(blocked)
        self.worst = max(self.worst, blocked)
        if blocked > WARN_ABOVE:
            now = asyncio.get_running_loop().time()
            if now - self._warned >= WARN_INTERVAL:
                self._warned = now
                log.warning(
                    "the event loop was held for %.2f s by one piece of work (every "
                    "connection of this process waited)",
                    blocked,
                )


def thread_names() -> dict[str, str]:
    """The process's threads, kernel thread id -> Python name: what /proc/PID/task/TID reports
    about each (its CPU and wake-ups) told apart (benchmarks/idle.py --threads). Python 3.11
    leaves every thread's kernel name the process's own."""
    return {str(t.native_id): t.name for t in threading.enumerate() if t.native_id is not None}
