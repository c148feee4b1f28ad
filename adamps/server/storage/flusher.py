"""The background flush (Adam 3.3.2) and how far durability is behind: the loss window, and
whether this server may still acknowledge (issue 29).

A flush that fails keeps its snapshots pending (retried with the next round), and one that stalls
keeps them in flight: either way the loss window (the age of the oldest update not committed to
LMDB) grows. Once it exceeds ``max_unflushed`` the server must stop acknowledging pushes
(``not_durable``): what a crash of every copy could lose is then bounded by what was
acknowledged before, not by how long the disk stays broken. It acknowledges again by itself as
soon as a flush commits. A failure is named for an operator: a full disk (ENOSPC, or less free
space than the flush needs: LMDB reports a full tmpfs as EIO) with its path and free space.

A flush is written in chunks (issue 30): groups of whole buckets of at most ``chunk_bytes`` of
dirty records each (a bigger bucket alone), each chunk cut (its shards copied, with its buckets'
positions) just before its own LMDB transaction. A flush then holds one chunk's copy, not the
model's, and LMDB's copy-on-write needs free pages for one chunk, not for the whole state, so
memory and the file stay within the state + O(chunk). Each bucket's cut stays consistent (its
shards and position in one transaction); different buckets are cut at different instants, which
nothing needs: buckets are independent. A chunk's shards are durable when its transaction
commits; until then they count in the loss window (pending), and the buckets not yet cut are
still dirty in the store, so the window is exact throughout.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import math
import shutil
import threading
import time
from collections.abc import Callable, Container, Mapping
from typing import Any

from adamps.core import flush_stall
from adamps.server.storage import memtrim
from adamps.server.storage.flush_times import FlushTimes, OwnedLock
from adamps.server.storage.persist import Persister, Position
from adamps.server.store.shards import Snapshot
from adamps.server.store.store import Store

log = logging.getLogger("adamps.server.storage.persist")

#: how long a durability verdict is reused (it scans the dirty shards; pushes ask often)
VERDICT_TTL = 0.05
#: a state transfer's persist waits for a slow flush (this server durable) up to this many
#: times max_unflushed (`flush_buckets`)
SLOW_FLUSH_WAITS = 12


def describe_failure(exc: BaseException, path: str, needed: int) -> str:
    """A flush failure as an operator needs it: a full disk by name, with the free space."""
    try:
        free: int | None = shutil.disk_usage(path).free
    except OSError:
        free = None
    text = f"{type(exc).__name__}: {exc}"
    full = (
        getattr(exc, "errno", None) == errno.ENOSPC
        or "No space left" in text
        or (free is not None and free < needed + (1 << 20))
    )
    if full:
        return (
            f"disk full: {path} has {free} bytes free, the flush needs about {needed} "
            f"(LMDB said {text})"
        )
    return text


class Flusher:
    """The background flush thread, the forced flush, and the loss-window bookkeeping."""

    def __init__(
        self,
        store: Store,
        persister: Persister,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
        on_flush: Callable[[int, int, float], None] | None = None,
        max_unflushed: float = math.inf,
        chunk_bytes: int = 16 << 20,
    ) -> None:
        #: takes a chunk's cut: (dirty shards of the buckets given (None: of all), positions of
        #: the same instant of those buckets or None, every bucket held then or None). Default:
        #: the dirty shards alone; a replicated server sets one that reads its positions too.
        self.cut: Callable[
            [Container[int] | None],
            tuple[list[Snapshot], dict[int, Position] | None, set[int] | None],
        ] = lambda buckets: (self.store.begin_snapshot(buckets)(60.0), None, None)
        #: dirty record bytes per transaction at most (whole buckets)
        self.chunk_bytes = chunk_bytes
        #: positions taken but not yet committed (a failed write retries them with the shards)
        self._pending_positions: dict[int, Position] = {}
        self.store = store
        self.persister = persister
        self.interval = interval
        self.clock = clock
        self._on_flush = on_flush
        #: held by the flush in progress (its holder known: a forced flush stuck on the disk
        #: is the disk's time for the background flush that waits for it)
        self._flush_lock = OwnedLock()
        #: snapshots taken but not yet committed (a failed write keeps them for the next round)
        self._pending: dict[str, Snapshot] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: wall-clock time and stats of the last successful flush
        self.last_flush: dict[str, Any] = {"time": None, "shards": 0, "bytes": 0, "seconds": 0.0}
        self.failures = 0
        #: seconds an update may stay unflushed before this server stops acknowledging
        self.max_unflushed = max_unflushed
        #: why the last flush failed, for an operator (None: it succeeded, or none ran yet)
        self.last_error: str | None = None
        #: monotonic time the running flush's write began (None: no write in progress)
        self.writing_since: float | None = None
        #: (monotonic time, verdict) of the last `not_durable` answer
        self._verdict: tuple[float, str | None] = (-math.inf, None)
        #: how the flush thread spends its time (issue 39: a slow flush is told a stalled
        #: disk or a starved process by it)
        self.times = FlushTimes(clock)
        persister.waiting_for = self.times.waiting_for
        #: why the loss window is past max_unflushed without this server being not durable
        #: (the flush is starved of CPU, not stalled on the disk: issue 39), or None
        self.starved: str | None = None
        #: slow intervals classified starved (each verdict that kept this server durable)
        self.starved_verdicts = 0
        #: the last verdict found the disk stalled
        self._stalled = False
        #: set by the event loop's turn (`offer`) when a flush has something to write; None:
        #: the flush thread times its flushes itself (a server without replication, the tests)
        self._kick: threading.Event | None = None
        #: `Store.puts` read before the last flush that left nothing pending (None: none yet)
        self._clean_at: int | None = None
        #: flushes the loop's turn found with nothing to write (`offer`; for tests and /status)
        self.idle_turns = 0

    def start(self, gated: bool = False) -> None:
        """Starts the flush thread. `gated`: it flushes when the event loop's turn (`offer`,
        every `interval`) finds something to write, not on a timer of its own."""
        if gated:
            self._kick = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adamps-flusher", daemon=True)
        self._thread.start()

    def stop(self, final_flush: bool = True) -> None:
        self._stop.set()
        if self._kick is not None:
            self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if final_flush:
            self.flush()

    def _run(self) -> None:
        self.times.attach()
        kick = self._kick
        while True:
            with self.times.phase("paused"):
                # `interval` after the last flush at least (as without the loop's turns); then,
                # gated, until a turn finds something to write
                if self._stop.wait(self.interval):
                    return
                if kick is not None:
                    kick.wait()
                    kick.clear()
                    if self._stop.is_set():
                        return
            try:
                self.flush()
            except Exception:  # logged; the snapshots stay pending and are retried next round
                log.error("background flush failed: %s", self.last_error)

    def offer(self, unchanged: Callable[[Mapping[int, tuple[int, int]]], bool]) -> None:
        """The event loop's turn, every `interval` (a gated flush thread, issue 36: idle costs
        nothing). An idle server's flush woke the flush thread, then the loop for the cut, then
        every owner thread for its copies, and wrote nothing: about six wake-ups a second on
        each server. Here, on the loop, with no flush in progress: when no update was queued
        since the last flush took its cut (`Store.puts`), nothing is pending, and
        `unchanged(positions on disk)` says the cut's positions would be those (the loop owns
        them), the flush is done, as an empty one is; otherwise the flush thread is woken to
        flush as before."""
        kick = self._kick
        if kick is None or kick.is_set():
            return
        if self._flush_lock.acquire(timeout=0):  # never waits: a flush in progress decides
            try:
                if self._idle(unchanged):
                    self.idle_turns += 1
                    self._done(0, 0, 0.0, 0)
                    return
            finally:
                self._flush_lock.release()
        kick.set()

    def _idle(self, unchanged: Callable[[Mapping[int, tuple[int, int]]], bool]) -> bool:
        """Whether a flush now would write nothing (the flush lock held)."""
        if self._clean_at is None or getattr(self.store, "puts", None) != self._clean_at:
            return False
        if self._pending or self._pending_positions:
            return False
        on_disk = self.persister.positions_on_disk()
        return on_disk is not None and unchanged(on_disk)

    def _done(self, shards: int, nbytes: int, seconds: float, chunks: int) -> None:
        self.last_flush = {
            "time": time.time(),
            "monotonic": self.clock(),
            "shards": shards,
            "bytes": nbytes,
            "seconds": seconds,
            "chunks": chunks,
        }
        if self._on_flush is not None:
            self._on_flush(shards, nbytes, seconds)

    def plan(self) -> list[Container[int] | None]:
        """The flush's chunks: groups of whole buckets of at most chunk_bytes of dirty records
        (a racy read of the dirty set: only the plan, not the cuts). The last chunk is every
        bucket not in an earlier one (what became dirty meanwhile included); a flush of one
        chunk is one cut of everything, as before chunking."""
        sizes = self.store.dirty_bytes()
        for s in self._pending.values():
            sizes[s.bucket] = sizes.get(s.bucket, 0) + len(s.record)
        chunks: list[set[int]] = []
        size = 0
        for b in sorted(sizes):
            if not chunks or size + sizes[b] > self.chunk_bytes and size > 0:
                chunks.append(set())
                size = 0
            chunks[-1].add(b)
            size += sizes[b]
        if len(chunks) <= 1:
            return [None]
        covered = set().union(*chunks[:-1])
        return [*chunks[:-1], _Rest(covered)]

    def flush(self) -> dict[str, Any]:
        """Writes every dirty shard now (blocking), chunk by chunk. Returns {shards, bytes,
        seconds, chunks}."""
        with self.times.waiting_for(self._flush_lock):
            self._flush_lock.acquire()
        try:
            t0 = self.clock()
            # read before the first cut: every update counted here is in this flush's cuts
            puts = getattr(self.store, "puts", None)  # (a stand-in store has none: never idle)
            shards = nbytes = 0
            chunks = self.plan()
            for buckets in chunks:
                n, written = self._flush_chunk(buckets)
                shards += n
                nbytes += written
            self.last_error = None
            if nbytes:
                memtrim.trim()  # the chunks' records and LMDB's dirty pages are free now
                self.persister.drop_file_view()  # and the file pages its B-tree walk read
            self._clean_at = None if self._pending or self._pending_positions else puts
            self._done(shards, nbytes, self.clock() - t0, len(chunks))
            return dict(self.last_flush)
        finally:
            self._flush_lock.release()

    def flush_buckets(self, buckets: set[int], timeout: float | None = None) -> int:
        """Writes the dirty shards and positions of `buckets` now, in one transaction (blocking;
        a state transfer's installed copy before it may count as a member). Raises if the
        write fails, or if a flush holds the disk longer than `timeout` (default max_unflushed)
        on a stalled or failing disk, or longer than SLOW_FLUSH_WAITS x `timeout` in all: the
        copy is then not durable here. A flush that is merely slow (a large one on a CPU, or
        one starved of CPU) is waited for: giving up made the primary send the whole bucket
        again, and a server slow to flush re-copied buckets in a loop (issue 38). Returns the
        bytes written."""
        if timeout is None:
            timeout = self.max_unflushed if math.isfinite(self.max_unflushed) else 60.0
        start = self.clock()
        while not self._flush_lock.acquire(timeout=min(0.5, timeout)):
            waited = self.clock() - start
            if waited < timeout:
                continue
            why = self.not_durable()  # classifies the flush in progress (self._stalled)
            if self.last_error is not None or self._stalled or waited >= SLOW_FLUSH_WAITS * timeout:
                raise TimeoutError(
                    f"a flush has been writing for more than {waited:.1f} s (the disk stalls"
                    f"{': ' + why if why else ''})"
                )
        try:
            return self._flush_chunk(buckets)[1]
        except Exception:
            for b in buckets:  # a copy that is not held: its cut is not written later
                self._pending_positions.pop(b, None)
            raise
        finally:
            self._flush_lock.release()

    def can_persist(self) -> str | None:
        """Why a write now would not reach the disk (the last flush failed, or one is stalled),
        or None: checked before a state transfer is asked for."""
        if self.last_error is not None:
            return f"flushes fail: {self.last_error}"
        return self.not_durable()

    def _flush_chunk(self, buckets: Container[int] | None) -> tuple[int, int]:
        """Cuts and writes one chunk (its buckets' shards and positions, one transaction), with
        what a failed write of the same buckets left pending. Returns (shards, bytes)."""
        dirty, positions, held = self.cut(buckets)
        mine = (lambda b: True) if buckets is None else buckets.__contains__
        if positions is not None:
            for b, p in positions.items():
                old = self._pending_positions.get(b)
                if old is not None and not p.fresh:
                    # a failed write's pairs are still unwritten: keep them, in order
                    p.dedup[:0] = old.dedup
                    p.fresh = old.fresh
            for b in [b for b in self._pending_positions if mine(b)]:
                del self._pending_positions[b]
            self._pending_positions.update(positions)
        for s in dirty:
            old = self._pending.get(s.shard_id)
            # Keep the oldest dirty time: those updates are still not on disk.
            if old is not None and old.dirty_since < s.dirty_since:
                s = dataclasses.replace(s, dirty_since=old.dirty_since)
            if old is not None and s.rows is not None and old.rows is not None:
                # a row shard's cut holds only the rows touched since the previous cut: the
                # unwritten older one's rows are still to be written, under the newer
                s = dataclasses.replace(s, rows=s.rows.after(old.rows))
            self._pending[s.shard_id] = s
        snaps = [s for s in self._pending.values() if mine(s.bucket)]
        chunk_positions = (
            None
            if positions is None
            else {b: p for b, p in self._pending_positions.items() if mine(b)}
        )
        if self.persister.writes_nothing(snaps, chunk_positions, held):
            nbytes = 0  # an idle server's cut: what is on disk already (no transaction)
        else:
            nbytes = self._write(snaps, chunk_positions, held)
        for s in snaps:
            if self._pending.get(s.shard_id) is s:
                del self._pending[s.shard_id]
        for b in list(chunk_positions or ()):
            self._pending_positions.pop(b, None)
        return len(snaps), nbytes

    def _write(
        self,
        snaps: list[Snapshot],
        positions: dict[int, Position] | None,
        held: set[int] | None,
    ) -> int:
        self.writing_since = self.clock()
        try:
            with self.times.phase("write"):
                return self.persister.write_snapshots(snaps, positions, held)
        except Exception as exc:
            self.failures += 1
            needed = sum(len(s.record) for s in self._pending.values())
            self.last_error = describe_failure(exc, self.persister.path, needed)
            raise
        finally:
            self.writing_since = None

    def loss_window(self) -> float:
        """Seconds since the oldest update that is not yet committed to LMDB (0 when clean)."""
        oldest = self.store.oldest_dirty()
        for s in list(self._pending.values()):
            if oldest is None or s.dirty_since < oldest:
                oldest = s.dirty_since
        return 0.0 if oldest is None else max(0.0, self.clock() - oldest)

    def not_durable(self) -> str | None:
        """Why this server must not acknowledge a push now, or None: the oldest update not yet
        committed to LMDB is older than max_unflushed (flushes failing or stalled). A window
        that is past it because the flush is starved of CPU, not stalled on the disk, keeps
        the server durable (`starved` says why; issue 39). Reused for VERDICT_TTL seconds (it
        scans the dirty shards)."""
        now = self.clock()
        at, verdict = self._verdict
        if now - at < VERDICT_TTL:
            return verdict
        window = self.loss_window()
        verdict = starved = None
        if window <= self.max_unflushed:
            self._stalled = False
        else:
            since = self.writing_since
            slow = self.times.over(now - window)
            # once stalled, stalled while the account says so: a disk that answers now and
            # then does not make the verdict flap (each change is an entry of the controllers)
            on_disk = None if self._stalled else self.times.on_disk_now()
            kind = flush_stall.STALLED if slow is None else flush_stall.classify(slow, on_disk)
            self._stalled = kind == flush_stall.STALLED
            detail = "" if slow is None else f"; the flush thread's last {slow.describe()}"
            if self.last_error is not None:
                why = f"flushes fail: {self.last_error}"
            elif kind == flush_stall.STARVED:
                starved = (
                    f"updates unflushed for {window:.1f} s, beyond max_unflushed "
                    f"{self.max_unflushed:g} s, because the flush is starved of CPU, not "
                    f"stalled on the disk{detail}"
                )
            elif since is not None and kind == flush_stall.STALLED:
                why = f"a flush has been writing for {now - since:.1f} s (the disk stalls{detail})"
            else:
                why = f"flushes do not keep up{detail}"
            if starved is None:
                verdict = (
                    f"updates unflushed for {window:.1f} s, beyond max_unflushed "
                    f"{self.max_unflushed:g} s: {why}"
                )
        if starved is not None and self.starved is None:
            log.warning("%s: this server stays durable, its buckets stay", starved)
            self.starved_verdicts += 1
        self.starved = starved
        self._verdict = (now, verdict)
        return verdict

    def starved_now(self) -> str | None:
        """Why the loss window is past max_unflushed with this server durable (its flush is
        starved of CPU), or None."""
        self.not_durable()
        return self.starved

    def last_flush_age(self) -> float | None:
        """Seconds since the last successful flush ended (None: none yet in this process)."""
        t = self.last_flush.get("monotonic")
        return None if t is None else max(0.0, self.clock() - t)


class _Rest:
    """Every bucket but those of the flush's earlier chunks (the last chunk of a plan)."""

    def __init__(self, covered: set[int]) -> None:
        self.covered = covered

    def __contains__(self, b: object) -> bool:
        return b not in self.covered
