"""Why a flush is slow: a stalled disk, or a process starved of CPU (issue 39). Pure: the
caller measures, this decides.

A server stops acknowledging when its loss window passes ``max_unflushed`` (issue 29), and the
controllers then move its buckets away: the right answer to a disk that hangs or fails, the
wrong one to a machine whose CPUs are overloaded. Under CPU starvation every server's flush
is slow at once (the testers saw three servers report "the disk stalls" together, at load 20-47
with 2-3% I/O pressure), so every server would give up its buckets at the same time, for a
cause that moving them cannot cure.

The kernel tells them apart per thread (``/proc/self/task/TID/schedstat``: nanoseconds on a
CPU, nanoseconds runnable but waiting on a run queue). Over the slow interval of the thread
that flushes, its wall time splits into

* ``run``: on a CPU (checksums, copies into LMDB's pages: a big flush is CPU work);
* ``wait``: runnable, waiting for a CPU: starved (an overloaded machine, a cgroup's CPU quota
  throttling the process);
* ``off`` = wall - run - wait: asleep, which inside LMDB's write is the disk (a write or fsync
  that does not return, a frozen file system: the thread sits in uninterruptible sleep).

A thread waiting for the GIL while its holder is starved is woken every switch interval (5 ms)
and then waits for a CPU too, so process-wide starvation shows in the flusher's own ``wait``.

The verdict, over one interval (see `classify`):

* ``stalled`` when the thread was asleep longer than it ran and waited together: the disk holds
  the flush. Only this counts as a disk stall (the server stops acknowledging, its buckets move);
* ``starved`` otherwise when it waited for a CPU at least as long as it ran, and the wait is a
  real part of the interval (``STARVED_SHARE``): more CPU, not another disk, would have finished
  it. The server keeps acknowledging and says so; its buckets stay;
* ``busy`` otherwise: the flush ran on a CPU most of the time, a state too large for the
  interval (flushes do not keep up), counted as before.

Without the kernel's counters (not Linux, no schedstat) nothing is known: ``stalled``, the rule
before this module.

Reference: issue 39, finding 4.
"""

from __future__ import annotations

from dataclasses import dataclass

STALLED, STARVED, BUSY = "stalled", "starved", "busy"
#: the share of the interval a starved flush waited for a CPU at least
STARVED_SHARE = 0.25


@dataclass(frozen=True)
class ThreadTimes:
    """A thread's cumulative CPU time and run-queue wait, in seconds (schedstat's first two)."""

    run: float
    wait: float

    def minus(self, earlier: ThreadTimes) -> ThreadTimes:
        return ThreadTimes(max(0.0, self.run - earlier.run), max(0.0, self.wait - earlier.wait))


@dataclass(frozen=True)
class FlushInterval:
    """A slow interval of the flushing thread: its wall time and what it spent of it."""

    #: seconds the interval lasted (the write in progress, or the last flush)
    wall: float
    #: the thread's CPU and run-queue wait over it (None: not measurable here)
    times: ThreadTimes | None

    @property
    def off(self) -> float:
        """Seconds asleep (neither on a CPU nor waiting for one): the disk, inside a write."""
        if self.times is None:
            return self.wall
        return max(0.0, self.wall - self.times.run - self.times.wait)

    def describe(self) -> str:
        if self.times is None:
            return f"{self.wall:.1f} s (no scheduler statistics here)"
        t = self.times
        return (
            f"{self.wall:.1f} s: {self.off:.1f} s off CPU (the disk), {t.run:.1f} s on a CPU, "
            f"{t.wait:.1f} s waiting for a CPU"
        )


def classify(interval: FlushInterval) -> str:
    """STALLED, STARVED or BUSY for a slow flush interval (see the module's docstring)."""
    t = interval.times
    if t is None:
        return STALLED
    if interval.off > t.run + t.wait:
        return STALLED
    if t.wait >= t.run and t.wait >= STARVED_SHARE * interval.wall:
        return STARVED
    return BUSY


def parse_schedstat(text: str) -> ThreadTimes:
    """``/proc/.../schedstat`` ("run_ns wait_ns timeslices") as seconds."""
    run, wait = text.split()[:2]
    return ThreadTimes(int(run) / 1e9, int(wait) / 1e9)
