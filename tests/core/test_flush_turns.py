"""Issue 36 (idle costs nothing): a replicated server's flush is decided on its event loop's turn
(``Flusher.offer``, adamps/server/api/app.py's ``_flush_turns``). A turn that finds nothing to
write (no update queued since the last flush's cut, nothing pending, every position as on disk)
wakes neither the flush thread nor the owner threads; anything else wakes the flush thread,
which flushes as before. A real Store, Persister and Flusher; the positions a replicated
server's core would give are a dict here."""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from adamps.layout import TensorSpec
from adamps.server.storage.flusher import Flusher
from adamps.server.storage.persist import Persister, Position
from adamps.server.store.initial import normalize_init
from adamps.server.store.store import Store
from adamps.server.updates.optim import Dense, Optimizer

N = 1 << 12


def wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


class Rig:
    """A gated flusher over a real store, counting its flushes and the owner threads' cuts."""

    def __init__(self, tmp_path: Path) -> None:
        self.store = Store(n_buckets=4, owner_threads=2, max_shard_elems=1 << 10)
        spec = TensorSpec("w", (N,))
        t = self.store.define(
            spec, Optimizer("sgd", 0.1), normalize_init({"kind": "zeros"}, (N,)), None
        )
        self.states = list(t.shards.values())
        self.p = Persister(tmp_path / "db", map_size=1 << 26)
        self.flusher = Flusher(self.store, self.p, interval=0.02)
        #: bucket -> (epoch, seq): what the replication core would report
        self.pos = {b: (1, 0) for b in range(4)}
        self.cuts = 0
        self.flushes = 0
        self.flusher.cut = self.cut
        flush = self.flusher.flush

        def counted() -> dict[str, Any]:
            try:
                return flush()
            finally:
                self.flushes += 1  # done (or failed): counted once it is over

        self.flusher.flush = counted  # the flush thread's call
        self.flusher.start(gated=True)

    def positions(self) -> dict[int, Position]:
        return {b: Position(e, s, []) for b, (e, s) in self.pos.items()}

    def cut(self, buckets: Any) -> tuple[list, dict[int, Position], set[int]]:
        self.cuts += 1
        snaps = self.store.begin_snapshot(buckets)(30.0)
        return snaps, self.positions(), set(self.pos)

    def look(self, on_disk: Any) -> bool:
        """The loop's look (Replicator's core in a server): its positions are those on disk."""
        return dict(on_disk) == self.pos

    def turn(self) -> None:
        """One turn of the loop, then until the flush it may have woken is done."""
        before, idle = self.flushes, self.flusher.idle_turns
        self.flusher.offer(self.look)
        if self.flusher.idle_turns == idle:  # woken: it flushes (`interval` after the last)
            wait_for(lambda: self.flushes > before)

    def push(self, x: float) -> None:
        fut: Future = Future()
        parts = [(st, Dense(np.full(st.value.size, x, np.float32))) for st in self.states]
        self.store.push(parts, lambda r, e: fut.set_exception(e) if e else fut.set_result(r))
        fut.result(30)

    def close(self) -> None:
        self.flusher.stop(final_flush=False)
        self.store.close()
        self.p.close()


def test_an_idle_turn_wakes_no_thread_and_a_change_is_flushed(tmp_path: Path) -> None:
    r = Rig(tmp_path)
    try:
        r.turn()  # the first turn flushes: nothing is known to be on disk yet
        assert r.flushes == 1 and r.cuts == 1
        assert {b: (p.epoch, p.seq) for b, p in r.p.load_positions().items()} == r.pos
        puts = r.store.puts
        for _ in range(5):  # idle: each turn is the flush, with nothing to write
            r.turn()
            time.sleep(0.03)
        assert (r.flushes, r.cuts, r.flusher.idle_turns) == (1, 1, 5)
        assert r.store.puts == puts  # no item was queued to an owner thread
        assert r.flusher.last_flush["chunks"] == 0 and r.flusher.last_flush_age() < 0.1

        r.push(0.5)  # an update: the next turn flushes it
        assert r.flusher.loss_window() > 0
        r.turn()
        assert r.flushes == 2 and r.flusher.loss_window() == 0.0
        assert r.flusher.last_flush["shards"] == len(r.states) > 0
        assert r.flusher.last_flush["bytes"] >= 4 * N

        r.pos[2] = (1, 7)  # a position moved (a batch committed, an epoch changed): flushed
        r.turn()
        assert r.flushes == 3
        assert r.p.load_positions()[2].seq == 7
        r.turn()  # and idle again
        assert r.flushes == 3 and r.flusher.idle_turns == 6
    finally:
        r.close()


def test_a_turn_during_a_flush_leaves_the_decision_to_the_flush_thread(tmp_path: Path) -> None:
    r = Rig(tmp_path)
    try:
        r.turn()
        assert r.flusher._flush_lock.acquire(timeout=1)  # as a forced flush in progress holds it
        try:
            r.flusher.offer(r.look)  # never waits for the lock: it wakes the flush thread
            assert r.flusher._kick.is_set() and r.flusher.idle_turns == 0
        finally:
            r.flusher._flush_lock.release()
        wait_for(lambda: r.flushes == 2)
        assert r.flusher.idle_turns == 0
    finally:
        r.close()


def test_a_failed_write_is_retried_at_the_next_turn(tmp_path: Path) -> None:
    r = Rig(tmp_path)
    try:
        r.turn()
        r.push(0.5)
        write = r.p.write_snapshots
        failures = [1]

        def failing(*a: Any, **k: Any) -> int:
            if failures:
                failures.pop()
                raise OSError(28, "No space left on device")
            return write(*a, **k)

        r.p.write_snapshots = failing  # type: ignore[method-assign]
        r.turn()  # fails: the shards stay pending
        assert r.flusher.last_error is not None and r.flusher.loss_window() > 0
        r.turn()  # pending: not idle, flushed again
        assert r.flusher.last_error is None and r.flusher.loss_window() == 0.0
        assert r.flushes == 3
    finally:
        r.close()
