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
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace

from adamps.core import flush_stall
from adamps.core.flush_stall import FlushInterval, ThreadTimes

#: samples kept (one at each pause and cut boundary: minutes of history at a 1 s interval)
SAMPLES = 512


def thread_times(tid: int) -> ThreadTimes | None:
    """Thread `tid`'s CPU time and run-queue wait so far (Linux schedstat), or None where the
    kernel does not count them. A wait in progress is counted too (`_waiting_for`), except
    for the calling thread's own: it runs, so it waits for no CPU (that took three more /proc
    reads at each of the flush thread's phase boundaries, several a second on an idle server;
    issue 36)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            times = flush_stall.parse_schedstat(f.read())
    except (OSError, ValueError):
        return None
    if tid == threading.get_native_id():
        return times
    pending = _waiting_for(tid)
    return times if pending <= 0 else ThreadTimes(times.run, times.wait + pending)


def cgroup_throttled() -> float:
    """Seconds this process's cgroup has been throttled by its CPU quota so far (cgroup v2
    ``cpu.stat`` throttled_usec, v1 throttled_time), 0 where there is no quota or no such file.
    The group is read again each time: a process may be moved into one while it runs."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0.0
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            stat, key, unit = f"/sys/fs/cgroup{path}/cpu.stat", "throttled_usec", 1e6
        elif "cpu" in controllers.split(","):
            base = "/sys/fs/cgroup/" + controllers
            stat, key, unit = f"{base}{path}/cpu.stat", "throttled_time", 1e9
        else:
            continue
        try:
            with open(stat) as f:
                for row in f:
                    name, _, value = row.partition(" ")
                    if name == key:
                        return int(value) / unit
        except (OSError, ValueError):
            continue
    return 0.0


def _exec_start(task: str) -> float | None:
    """When `task` last ran (ms of the scheduler's clock: /proc/.../sched), or None."""
    try:
        with open(f"/proc/{task}/sched") as f:
            for line in f:
                if line.startswith("se.exec_start"):
                    return float(line.split(":")[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _waiting_for(tid: int) -> float:
    """Seconds thread `tid` has been runnable but off every CPU, if it is now: the kernel adds a
    wait to schedstat only when the thread gets a CPU again, so a thread throttled for a whole
    CPU quota period (up to 1 s) shows none of it until then. Measured on the scheduler's
    clock, from when it last ran to now (this thread's last run: it runs now); 0 when it is
    asleep or where /proc/.../sched is missing.

    0 too when the kernel does not say when it last ran: a thread moved to another CPU's run
    queue while it waits (the load balancer, a wake-up placed on another CPU) has its
    ``se.exec_start`` reset to 0 until it runs there. Read as a time, that 0 made a wait "since
    the machine booted" (49,709 s in a CI run), and the next reading, smaller, made the
    flush's real waits vanish into "asleep in the write": a loaded CPU read as a stalled disk.
    The kernel adds that wait to schedstat once the thread runs."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0.0
    if stat[stat.rindex(")") + 2 : stat.rindex(")") + 3] != "R":
        return 0.0
    theirs, now = _exec_start(f"self/task/{tid}"), _exec_start("thread-self")
    if theirs is None or now is None or theirs <= 0.0:
        return 0.0
    return max(0.0, (now - theirs) / 1000.0)


@dataclass(frozen=True)
class _Sample:
    at: float
    times: ThreadTimes
    #: cumulative seconds asleep in pauses, and waiting for the server's threads, up to `at`
    paused: float
    threads: float
    #: cumulative seconds the process's cgroup was throttled by its CPU quota, up to `at`
    throttled: float = 0.0


@dataclass(frozen=True)
class _Phase:
    kind: str
    #: when its account was last taken, and the flush thread's times then
    since: float
    times: ThreadTimes
    #: for kind "lock": the lock waited for, its holder then and the holder's times then
    lock: OwnedLock | None = None
    holder: int | None = None
    theirs: ThreadTimes | None = None


class OwnedLock:
    """A lock that knows which thread holds it (its kernel id), so that a wait for it can be
    charged to what the holder was doing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: the holder's kernel thread id (None: free)
        self.holder: int | None = None

    def acquire(self, timeout: float = -1) -> bool:
        if not self._lock.acquire(timeout=timeout):
            return False
        self.holder = threading.get_native_id()
        return True

    def release(self) -> None:
        self.holder = None
        self._lock.release()

    def __enter__(self) -> OwnedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class FlushTimes:
    """The flush thread's account. Written by that thread (`attach`, `phase`), read by any.

    The flush thread is always in one phase: "write" (asleep there is the disk's), "paused"
    (between flushes), "lock" (waiting for an `OwnedLock`: its holder's time) or, by default,
    "threads" (anything else it sleeps on, a Python lock or the cut, is the server's threads,
    not the disk)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        #: the flush thread's kernel id (None: not started, or no schedstat here)
        self._tid: int | None = None
        self._paused = 0.0
        self._threads = 0.0
        #: the phase in progress, since its account was last taken (None: not attached)
        self._open: _Phase | None = None
        self._samples: deque[_Sample] = deque(maxlen=SAMPLES)

    def attach(self) -> None:
        """Called by the flush thread as it starts: it is the thread accounted."""
        tid = threading.get_native_id()
        times = thread_times(tid)
        if times is not None:
            self._tid = tid
            with self._lock:
                self._open = _Phase("threads", self.clock(), times)
            self._sample()

    @contextmanager
    def phase(self, kind: str, lock: OwnedLock | None = None) -> Iterator[None]:
        """Around a write ("write"), a pause ("paused"), or a wait for `lock` ("lock") of the
        flush thread; the phase it was in resumes after (any other thread: nothing is
        accounted)."""
        tid = self._tid
        if tid is None or threading.get_native_id() != tid:
            yield
            return
        before = self._switch(kind, lock)
        try:
            yield
        finally:
            self._switch(before, None)
            self._sample()

    def _switch(self, kind: str, lock: OwnedLock | None) -> str:
        """Closes the account of the phase in progress and opens `kind`'s; returns the kind
        it left."""
        tid = self._tid
        times = None if tid is None else thread_times(tid)
        with self._lock:
            p = self._open
            if p is None or times is None:
                return "threads"
            now = self.clock()
            self._close(now, times)
            holder = None if lock is None else lock.holder
            theirs = None if holder is None else thread_times(holder)
            self._open = _Phase(kind, now, times, lock, holder, theirs)
            return p.kind

    def on_disk_now(self) -> bool | None:
        """Whether the flush thread is in uninterruptible sleep now (state D: the disk), None
        where that cannot be read."""
        tid = self._tid
        if tid is None:
            return None
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            return None
        return stat[stat.rindex(")") + 2 : stat.rindex(")") + 3] == "D"

    def waiting_for(self, lock: OwnedLock) -> AbstractContextManager[None]:
        """Around the flush thread's wait for `lock`: the time it sleeps there counts as
        waiting for the server's threads for the share of it its holder spends running or
        waiting for a CPU; the rest (the holder asleep: on the disk) is the disk's."""
        return self.phase("lock", lock)

    def _close(self, now: float, times: ThreadTimes) -> None:
        """Adds the open phase's time asleep so far to its kind's total and restarts its
        account at `now` (under the lock)."""
        p = self._open
        if p is None:
            return
        spent = times.minus(p.times)
        asleep = max(0.0, now - p.since - spent.run - spent.wait)
        old = None if p.holder is None else thread_times(p.holder)
        if p.kind == "paused":
            self._paused += asleep
        elif p.kind == "write":
            pass  # the disk's: what `FlushInterval.off` leaves
        elif p.kind == "lock" and old is not None and p.theirs is not None and now > p.since:
            them = old.minus(p.theirs)  # the holder's time is the wait's
            self._threads += asleep * min(1.0, (them.run + them.wait) / (now - p.since))
        else:
            # the server's threads; or a lock taken but not yet marked: a thread on its way in
            # (waiting for the GIL or a CPU), not on the disk
            self._threads += asleep
        holder = None if p.lock is None else p.lock.holder
        theirs = None if holder is None else thread_times(holder)
        self._open = _Phase(p.kind, now, times, p.lock, holder, theirs)

    def _now(self) -> _Sample | None:
        tid = self._tid
        times = None if tid is None else thread_times(tid)
        if times is None:
            return None
        with self._lock:
            now = self.clock()
            self._close(now, times)
            sample = _Sample(now, times, self._paused, self._threads)
        return replace(sample, throttled=cgroup_throttled())

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
            throttled=max(0.0, end.throttled - first.throttled),
        )
