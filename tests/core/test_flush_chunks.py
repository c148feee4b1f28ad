"""A flush in chunks of whole buckets (issue 30): it holds one chunk's copy, not the model's, and
LMDB's file stays near the state however often the whole state is rewritten."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import lmdb
import numpy as np

from adamps.layout import TensorSpec
from adamps.server.storage.flusher import Flusher
from adamps.server.storage.persist import Persister, Position, _unpack
from adamps.server.store.checksum import unseal
from adamps.server.store.initial import normalize_init
from adamps.server.store.store import Store
from adamps.server.updates import kernels
from adamps.server.updates.optim import Dense, Optimizer

MiB = 1 << 20
ELEMS = 4 * MiB  # 16 MiB of values, 32 MiB of state with Adagrad
CHUNK = 4 * MiB


def make_store() -> tuple[Store, list]:
    # Creating an Adagrad shard starts loading the numba kernels on a background thread
    # (kernels.warm): load them first, or tracemalloc counts that import's allocations (5-6 MiB)
    # as the flush's. A process that ran no Adagrad test before (this file alone, or a
    # pytest-xdist worker) failed here.
    kernels.load()
    store = Store(n_buckets=64, owner_threads=2, max_shard_elems=1 << 17)  # 512 KiB shards
    spec = TensorSpec("w", (ELEMS,))
    t = store.define(
        spec, Optimizer("adagrad", 0.1), normalize_init({"kind": "zeros"}, (ELEMS,)), None
    )
    return store, list(t.shards.values())


def push_all(store: Store, states: list, x: float) -> None:
    from concurrent.futures import Future

    fut: Future = Future()
    parts = [(st, Dense(np.full(st.value.size, x, np.float32))) for st in states]
    store.push(parts, lambda r, e: fut.set_exception(e) if e else fut.set_result(r))
    fut.result(30)


def test_a_whole_model_flush_holds_one_chunk_and_the_file_stays_near_the_state(
    tmp_path: Path,
) -> None:
    store, states = make_store()
    state_bytes = 2 * 4 * ELEMS
    p = Persister(tmp_path / "db", map_size=1 << 30)
    try:
        flusher = Flusher(store, p, interval=3600, chunk_bytes=CHUNK)
        peaks = []
        for i in range(6):  # every flush rewrites the whole state
            push_all(store, states, 1e-3 * (i + 1))
            gc.collect()
            tracemalloc.start()
            stats = flusher.flush()
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
            assert stats["chunks"] >= state_bytes // CHUNK
            assert stats["bytes"] >= state_bytes and flusher.loss_window() == 0.0
        # What the flush allocates in Python: one chunk's records (and a shard of slack), not
        # the state (a single cut of everything held the whole state, packed twice).
        assert max(peaks) < 2 * CHUNK, [x / MiB for x in peaks]
        size = (tmp_path / "db" / "data.mdb").stat().st_blocks * 512
        # Copy-on-write needs free pages for the chunks in flight, not for a second state.
        assert size <= state_bytes + 4 * CHUNK, size / state_bytes
        want = {st.id: (st.value.copy(), st.accum.copy()) for st in states}
    finally:
        p.close()
        store.close()
    # What the chunks wrote is the state at the last flush, every shard of it.
    with lmdb.open(str(tmp_path / "db"), max_dbs=6, lock=False, readonly=True) as env:
        with env.begin() as txn:
            got = {
                bytes(k).decode(): _unpack(unseal(v))
                for k, v in txn.cursor(env.open_db(b"shards", txn=txn))
            }
    assert set(got) == set(want)
    for sid, (value, accum) in want.items():
        assert got[sid][0] == 6 and np.array_equal(got[sid][1], value)
        assert np.array_equal(got[sid][2], accum)


def test_each_chunk_writes_its_buckets_positions_and_the_held_set_drops_the_others(
    tmp_path: Path,
) -> None:
    store, states = make_store()
    p = Persister(tmp_path / "db", map_size=1 << 30)
    seq = {"n": 0}
    held = set(range(64))
    cuts = []

    def cut(buckets):  # a replicated server's cut: the buckets' shards and positions at once
        snaps = store.begin_snapshot(buckets)(60.0)
        seq["n"] += 1
        pos = {b: Position(1, seq["n"], []) for b in held if buckets is None or b in buckets}
        cuts.append(sorted(pos))
        return snaps, pos, set(held)

    try:
        flusher = Flusher(store, p, interval=3600, chunk_bytes=CHUNK)
        flusher.cut = cut
        push_all(store, states, 1.0)
        flusher.flush()
        assert len(cuts) > 1
        # every bucket is in exactly one chunk, its shards and its position in one transaction
        assert sorted(b for c in cuts for b in c) == list(range(64))
        on_disk = p.load_positions()
        assert set(on_disk) == set(range(64))
        for i, c in enumerate(cuts):
            assert {on_disk[b].seq for b in c} <= {i + 1}
        held.discard(5)
        cuts.clear()
        push_all(store, states, 1.0)
        flusher.flush()
        assert set(p.load_positions()) == set(range(64)) - {5}
    finally:
        p.close()
        store.close()


def test_flush_buckets_writes_those_buckets_now_and_refuses_while_a_flush_holds_the_disk(
    tmp_path: Path,
) -> None:
    """Issue 29: a state transfer persists its installed copy with `flush_buckets` before it
    may count as a member. It writes the named buckets' dirty shards (only those), and when a
    flush holds the disk past its timeout (a stalled disk) it raises: the copy does not join."""
    store = Store(n_buckets=8, owner_threads=2, max_shard_elems=1 << 10)
    t = store.define(
        TensorSpec("w", (1 << 14,)), Optimizer("sgd", 1.0), normalize_init({"kind": "zeros"}, (1 << 14,)), None
    )  # fmt: skip
    states = list(t.shards.values())
    p = Persister(tmp_path / "db", map_size=1 << 28)
    try:
        flusher = Flusher(store, p, interval=3600, max_unflushed=0.2)
        push_all(store, states, 1.0)
        b = store.layout.bucket_of[states[0].id]
        mine = {st.id for st in states if store.layout.bucket_of[st.id] == b}
        assert flusher.flush_buckets({b}) > 0
        dirty = {s.shard_id for s in store.begin_snapshot()(30)}
        assert dirty == {st.id for st in states} - mine, "only bucket b's shards were written"
        with flusher._flush_lock:  # a flush that does not finish: the disk stalls
            try:
                flusher.flush_buckets({b})
                raise AssertionError("flush_buckets returned while a flush held the disk")
            except TimeoutError as exc:
                assert "the disk stalls" in str(exc)
    finally:
        p.close()
        store.close()


def test_the_file_pages_a_read_touched_leave_the_rss_and_read_back_the_same(
    tmp_path: Path,
) -> None:
    """Issue 38: LMDB's read-only map counted in RSS every file page a start's load or a
    flush's B-tree walk read (a reloaded table's RSS was half page cache). `drop_file_view`
    unmaps them (they stay in the kernel's cache); the next read maps them again."""

    def rss_file() -> int:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("RssFile")) * 1024

    p = Persister(tmp_path / "db", map_size=1 << 27)
    try:
        p._write(lambda txn: [txn.put(b"%08d" % i, bytes([i % 251]) * 2000, db=p._shards)
                              for i in range(16_000)])  # fmt: skip

        def read() -> int:
            with p.env.begin() as txn:
                return sum(v[0] for _, v in txn.cursor(db=p._shards))

        want = read()
        before = rss_file()
        assert p.drop_file_view()
        assert rss_file() < before - 24_000_000  # ~32 MB of records read
        assert read() == want
    finally:
        p.close()


def test_an_idle_flush_writes_nothing_and_opens_no_transaction(tmp_path: Path) -> None:
    """A replicated server flushes every second; idle, its cut holds no dirty shard and every
    copy's position as last written. That flush opens no LMDB transaction and accounts no
    write (issue 36: idle costs nothing); a changed position, new exactly-once pairs, a dirty
    shard or a copy no longer held are written as before."""
    store = Store(n_buckets=4, owner_threads=1, max_shard_elems=1 << 10)
    spec = TensorSpec("w", (4096,))
    t = store.define(spec, Optimizer("sgd", 0.1), normalize_init({"kind": "zeros"}, (4096,)), None)
    states = list(t.shards.values())
    p = Persister(tmp_path / "db", map_size=1 << 26)
    writes: list[int] = []
    real_write = p._write
    p._write = lambda fn: (writes.append(1), real_write(fn))[1]  # type: ignore[method-assign]
    cut: dict = {"positions": {0: Position(1, 5, []), 1: Position(1, 3, [])}, "held": {0, 1}}
    try:
        flusher = Flusher(store, p, interval=3600)
        flusher.cut = lambda buckets: (
            store.begin_snapshot(buckets)(60.0),
            {b: Position(q.epoch, q.seq, list(q.dedup)) for b, q in cut["positions"].items()},
            set(cut["held"]),
        )

        def flush() -> int:
            before = len(writes)
            flusher.flush()
            return len(writes) - before

        push_all(store, states, 1.0)
        assert flush() == 1  # shards and positions
        assert flush() == 0 and flush() == 0  # idle: nothing new
        cut["positions"][1] = Position(1, 4, [])
        assert flush() == 1
        assert flush() == 0
        cut["positions"][0] = Position(1, 5, [["c", 1, 5]])  # new exactly-once pairs
        assert flush() == 1
        cut["positions"][0] = Position(1, 5, [])
        assert flush() == 0
        push_all(store, states, 2.0)
        assert flush() == 1
        cut["positions"].pop(1)  # copy 1 is no longer held: its position is deleted
        cut["held"] = {0}
        assert flush() == 1
        assert flush() == 0
        on_disk = p.load_positions()
        assert {b: (q.epoch, q.seq) for b, q in on_disk.items()} == {0: (1, 5)}
    finally:
        p.close()
        store.close()
