"""Why a flush is slow: a stalled disk, or a process starved of CPU (issue 39). Pure: the
caller measures, this decides.

A server stops acknowledging when its loss window passes ``max_unflushed`` (issue 29), and the
controllers then move its buckets away: the right answer to a disk that hangs or fails, the
wrong one to a machine whose CPUs are overloaded. Under CPU starvation every server's flush
is slow at once (the testers saw three servers report "the disk stalls" together, at load 20-47
with 2-3% I/O pressure), so every server would give up its buckets at the same time, for a
cause that moving them cannot cure.

The kernel tells them apart per thread (``/proc/self/task/TID/schedstat``: nanoseconds on a
CPU, nanoseconds runnable but waiting on a run queue). Over the loss window, the wall time of
the thread that flushes splits into

* ``run``: on a CPU (checksums, copies into LMDB's pages: a big flush is CPU work);
* ``wait``: runnable, waiting for a CPU: starved (an overloaded machine, a cgroup's CPU quota
  throttling the process; a wake-up from its pause between flushes delayed counts here too);
* ``paused``: asleep by its own choice, between flushes (``flush_interval``);
* ``threads``: asleep outside the write: waiting for the server's own threads (the cut of the
  dirty shards on the event loop and owner threads, a Python lock, the GIL), or for the
  store's lock for as long as its holder (the scrub, a reader, a forced flush) was running or
  waiting for a CPU: when they are starved, so is the flush;
* ``off``, the rest: asleep in the write (or waiting for a lock whose holder was asleep), which
  is the disk (a write or fsync that does not return, a frozen file system: the thread sits in
  uninterruptible sleep).

A thread waiting for the GIL while its holder is starved is woken every switch interval (5 ms)
and then waits for a CPU too, so process-wide starvation shows in the flusher's own ``wait``.

The verdict, over one interval (see `classify`):

* ``stalled`` when the thread was asleep on the disk longer than it ran, waited for a CPU and
  for the server's threads together, and sleeps on the disk now (uninterruptible sleep, state
  D; a sleep in the write on the GIL or a lock whose holder is starved is interruptible): the
  disk holds the flush. Only this counts as a disk
  stall (the server stops acknowledging, its buckets move);
* ``starved`` when the process's CPU quota (its cgroup's ``cpu.max``) held it off the CPUs for a
  real part of the interval (``STARVED_SHARE``) and the thread itself waited for a CPU (or the
  server's threads) as long, however long it slept in the write: a task
  throttled inside the kernel keeps what it holds (a journal handle, a page lock, the inode's
  lock), and every other writer of that file system then sleeps in the write behind it, in
  state D, as on a disk that does not answer (CFS bandwidth control's priority inversion; a CI
  run saw a starved flush spend 0.8 s asleep in the write and 0.7 s waiting for a CPU);
* ``starved`` otherwise when it waited (for a CPU, or for the server's threads) at least as long
  as it ran, and the waits are a real part of its active time (``STARVED_SHARE``): more CPU,
  not another disk, would have finished it. The server keeps acknowledging and says so; its
  buckets stay;
* ``busy`` otherwise: the flush ran on a CPU most of the time, a state too large for the
  window (flushes do not keep up), counted as before.

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
    """The flushing thread over a slow interval (the loss window): its wall time and how it
    spent it."""

    #: seconds the interval lasted
    wall: float
    #: the thread's CPU time and run-queue wait over it (None: not measurable here)
    times: ThreadTimes | None
    #: seconds asleep in its pauses between flushes
    paused: float = 0.0
    #: seconds asleep waiting for the server's threads (the cut; the lock, while its holder ran
    #: or waited for a CPU)
    threads: float = 0.0
    #: seconds the process's cgroup was throttled by its CPU quota over the interval
    throttled: float = 0.0

    @property
    def off(self) -> float:
        """Seconds asleep otherwise: in the write, on the disk."""
        if self.times is None:
            return max(0.0, self.wall - self.paused - self.threads)
        return max(0.0, self.wall - self.times.run - self.times.wait - self.paused - self.threads)

    def describe(self) -> str:
        if self.times is None:
            return f"{self.wall:.1f} s (no scheduler statistics here)"
        t = self.times
        return (
            f"{self.wall:.1f} s: {self.off:.1f} s asleep in the write (the disk), {t.run:.1f} s "
            f"on a CPU, {t.wait:.1f} s waiting for a CPU, {self.threads:.1f} s waiting for the "
            f"server's threads, {self.paused:.1f} s paused between flushes"
            + (
                f", the process throttled by its CPU quota {self.throttled:.1f} s"
                if self.throttled
                else ""
            )
        )


def classify(interval: FlushInterval, on_disk: bool | None = None) -> str:
    """STALLED, STARVED or BUSY for a slow interval (see the module's docstring). `on_disk`:
    whether the flush thread sleeps in the kernel's uninterruptible sleep now (state D: a
    write, an fsync, a frozen file system), None if unknown. A thread asleep otherwise now (on
    the GIL or a lock whose holder is starved: its sleep is not the disk's) is not stalled."""
    t = interval.times
    if t is None:
        return STALLED
    waited = t.wait + interval.threads
    active = interval.wall - interval.paused
    if interval.throttled >= STARVED_SHARE * active > 0 and waited >= STARVED_SHARE * active:
        return STARVED  # a frozen disk under a busy quota: the thread sleeps, it does not wait
    if interval.off > t.run + waited:
        return STARVED if on_disk is False else STALLED
    if waited >= t.run and waited >= STARVED_SHARE * active:
        return STARVED
    return BUSY


def parse_schedstat(text: str) -> ThreadTimes:
    """``/proc/.../schedstat`` ("run_ns wait_ns timeslices") as seconds."""
    run, wait = text.split()[:2]
    return ThreadTimes(int(run) / 1e9, int(wait) / 1e9)
