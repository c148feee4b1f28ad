"""Embedding tables' pure parts: id -> bucket, deterministic row init, and one bucket's rows
with the per-row optimizers, admission and expiry, against a plain numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from adamps.server.store.tables.rowblock import ApplyStats, RowBlock, RowPush
from adamps.server.updates.optim import Optimizer
from adamps.tables import (
    Admission,
    TableError,
    TableSpec,
    buckets_of,
    initial_rows,
    normalize_row_init,
    split_by_bucket,
)

NORMAL = normalize_row_init({"kind": "normal", "std": 0.1, "seed": 7})


def block(opt: dict | None = None, **adm) -> RowBlock:
    o = Optimizer.from_dict(opt or {"kind": "sgd", "lr": 0.5})
    a = Admission(**adm)
    return RowBlock(4, NORMAL, o, a, a.bucket_limit(1))


def test_buckets_are_stable_and_spread() -> None:
    ids = np.array([0, 1, 2, -1, 2**62, 123456789], np.int64)
    # Pinned: the same in every process and on every machine (a change moves every row).
    assert buckets_of(ids, 64).tolist() == buckets_of(ids.copy(), 64).tolist()
    assert buckets_of(ids, 64).tolist() == [int(x) for x in PINNED_BUCKETS]
    counts = np.bincount(buckets_of(np.arange(64_000), 64), minlength=64)
    assert counts.min() > 800 and counts.max() < 1200
    parts = split_by_bucket(np.arange(1000), 8)
    assert sorted(np.concatenate(list(parts.values())).tolist()) == list(range(1000))
    for b, pos in parts.items():
        assert (buckets_of(np.arange(1000)[pos], 8) == b).all()


#: SplitMix64 buckets of those ids, computed once and written down
PINNED_BUCKETS = [3, 52, 23, 1, 31, 56]


def test_initial_rows_depend_on_seed_and_id_only() -> None:
    a = initial_rows(NORMAL, np.array([5, 9, 5]), 8)
    b = initial_rows(NORMAL, np.array([9]), 8)
    assert np.array_equal(a[0], a[2]) and np.array_equal(a[1], b[0])
    other = initial_rows({**NORMAL, "seed": 8}, np.array([5]), 8)
    assert not np.array_equal(a[0], other[0])
    big = initial_rows(NORMAL, np.arange(20_000), 16)
    assert abs(big.mean()) < 0.002 and abs(big.std() - 0.1) < 0.002
    u = initial_rows(
        normalize_row_init({"kind": "uniform", "low": -1, "high": 2}), np.arange(5000), 4
    )
    assert u.min() >= -1 and u.max() < 2 and abs(u.mean() - 0.5) < 0.03


def reference(opt: Optimizer, pushes: list[tuple[np.ndarray, np.ndarray]], dim: int):
    """Plain numpy: a dict of rows, one optimizer step per push on the summed duplicates."""
    w: dict[int, np.ndarray] = {}
    acc: dict[int, np.ndarray] = {}
    for ids, grads in pushes:
        summed: dict[int, np.ndarray] = {}
        for i, g in zip(ids.tolist(), grads, strict=True):
            summed[i] = summed.get(i, np.zeros(dim, np.float32)) + g
        for i, g in summed.items():
            if i not in w:
                w[i] = initial_rows(NORMAL, np.array([i]), dim)[0]
                acc[i] = np.full(dim, opt.initial_state, np.float32)
            if opt.kind == "sgd":
                w[i] = w[i] - np.float32(opt.lr) * g
            else:
                acc[i] = acc[i] + g * g
                w[i] = w[i] - np.float32(opt.lr) * g / np.sqrt(acc[i] + np.float32(opt.eps))
    return w, acc


@pytest.mark.parametrize(
    "opt", [{"kind": "sgd", "lr": 0.5}, {"kind": "adagrad", "lr": 0.1, "initial_accumulator": 0.1}]
)
def test_rows_lazy_init_and_optimizers_match_numpy(opt: dict) -> None:
    rng = np.random.default_rng(1)
    blk = block(opt)
    pushes = []
    for t in range(30):
        ids = rng.zipf(1.3, 200).astype(np.int64) % 500  # many duplicates within a push
        grads = rng.normal(size=(200, 4)).astype(np.float32)
        pushes.append((ids, grads))
        blk.apply(RowPush(ids, grads, float(t)), ApplyStats())
    w, acc = reference(blk.optimizer, pushes, 4)
    assert blk.n == len(w)
    ids = np.array(sorted(w), np.int64)
    out = np.empty((len(ids), 4), np.float32)
    blk.gather(ids, out)
    np.testing.assert_allclose(out, np.stack([w[i] for i in ids.tolist()]), rtol=2e-5, atol=1e-6)
    if blk.accum is not None:
        got = blk.accum[blk.slots(ids)]
        np.testing.assert_allclose(got, np.stack([acc[i] for i in ids.tolist()]), rtol=2e-5)
    # A row never pushed reads as its init and is not created by the read.
    fresh = np.array([10**12], np.int64)
    blk.gather(fresh, out[:1])
    assert np.array_equal(out[0], initial_rows(NORMAL, fresh, 4)[0]) and blk.n == len(w)


def test_duplicate_ids_are_summed() -> None:
    a, b = block(), block()
    g = np.ones((3, 4), np.float32)
    a.apply(RowPush(np.array([7, 7, 7]), g, 0.0), ApplyStats())
    b.apply(RowPush(np.array([7]), 3 * g[:1], 0.0), ApplyStats())
    assert a.n == 1 and np.array_equal(a.values[:1], b.values[:1])


def test_row_limit_drops_new_ids_in_id_order() -> None:
    blk = block(max_rows=3, on_full="drop")
    st = ApplyStats()
    blk.apply(RowPush(np.array([9, 1, 5, 3]), np.ones((4, 4), np.float32), 0.0), st)
    assert sorted(blk.index) == [1, 3, 5] and st.dropped_full == 1 and st.created == 3
    blk.apply(RowPush(np.array([1, 2]), np.ones((2, 4), np.float32), 0.0), st)
    assert sorted(blk.index) == [1, 3, 5] and st.dropped_full == 2


def test_frequency_filter_admits_at_the_nth_push() -> None:
    blk = block(admit_after=3)
    st = ApplyStats()
    before = initial_rows(NORMAL, np.array([4]), 4)[0]
    for k in range(3):
        blk.apply(RowPush(np.array([4, 4]), np.ones((2, 4), np.float32), float(k)), st)
        assert (4 in blk.index) == (k == 2)
    assert st.filtered == 2
    # Only the admitting push's gradient (2 ones summed, lr 0.5) is applied.
    np.testing.assert_allclose(blk.values[0], before - 1.0)


def test_expiry_removes_rows_unseen_for_the_lifetime() -> None:
    blk = block(expire_after=10.0)
    st = ApplyStats()
    g = np.ones((1, 4), np.float32)
    for i in range(5):
        blk.apply(RowPush(np.array([i]), g, float(i)), st)
    blk.apply(RowPush(np.array([4]), g, 13.0), st)  # rows 0..2 last pushed > 10 s before 13
    assert sorted(blk.index) == [3, 4] and st.expired == 3
    # The survivors kept their own rows across the compaction.
    assert blk.ids[blk.index[3]] == 3 and np.allclose(
        blk.values[blk.index[3]], initial_rows(NORMAL, np.array([3]), 4)[0] - 0.5
    )
    blk.apply(RowPush(np.array([0]), g, 30.0), st)  # an expired id comes back fresh
    np.testing.assert_allclose(
        blk.values[blk.index[0]], initial_rows(NORMAL, np.array([0]), 4)[0] - 0.5
    )


def test_expired_rows_give_their_memory_back() -> None:
    """100,000 rows of dim 16 with Adagrad (14 MB of arrays) all but 10 expire: the block's
    arrays shrink and the process's traced memory (numpy's arrays) drops by about that much;
    the survivors keep their rows, and the block grows again after."""
    import tracemalloc

    tracemalloc.start()
    try:
        blk = RowBlock(16, NORMAL, Optimizer.from_dict({"kind": "adagrad", "lr": 0.1}),
                       Admission(expire_after=10.0), None)  # fmt: skip
        ids = np.arange(100_000, dtype=np.int64)
        blk.apply(RowPush(ids, np.ones((100_000, 16), np.float32), 0.0), ApplyStats())
        keep = ids[:10]
        blk.apply(RowPush(keep, np.ones((10, 16), np.float32), 5.0), ApplyStats())
        before = tracemalloc.get_traced_memory()[0]
        want = blk.values[blk.slots(keep)].copy()
        st = ApplyStats()
        blk.apply(RowPush(keep[:1], np.zeros((1, 16), np.float32), 12.0), st)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert st.expired == 100_000 - 10 and blk.n == 10
    assert len(blk.values) == 64 and len(blk.accum) == 64 and len(blk.ids) == 64
    assert before - after > 12_000_000, (before, after)
    assert np.array_equal(blk.values[blk.slots(keep)], want)
    more = np.arange(200, 300, dtype=np.int64)
    blk.apply(RowPush(more, np.ones((100, 16), np.float32), 13.0), ApplyStats())
    assert blk.n == 110 and (blk.slots(more) >= 0).all()


def test_state_round_trips_through_bytes_and_digest_agrees() -> None:
    blk = block({"kind": "adagrad", "lr": 0.1}, admit_after=2, expire_after=100.0)
    rng = np.random.default_rng(3)
    for t in range(10):
        ids = rng.integers(0, 50, 40)
        blk.apply(RowPush(ids, rng.normal(size=(40, 4)).astype(np.float32), float(t)), ApplyStats())
    data = blk.tobytes()
    assert len(data) % 4 == 0
    copy = block({"kind": "adagrad", "lr": 0.1}, admit_after=2, expire_after=100.0)
    copy.load_bytes(data)
    assert copy.digest() == blk.digest()
    assert np.array_equal(copy.sketch.counts, blk.sketch.counts)
    push = RowPush(np.arange(60), np.ones((60, 4), np.float32), 11.0)
    blk.apply(push, ApplyStats())
    copy.apply(push, ApplyStats())
    assert copy.tobytes() == blk.tobytes()
    with pytest.raises(ValueError):
        copy.load_bytes(data[:-4])


def test_bad_definitions_name_the_field() -> None:
    with pytest.raises(TableError, match="dim"):
        TableSpec("t", 0)
    with pytest.raises(TableError, match="on_full"):
        Admission(on_full="maybe")
    with pytest.raises(TableError, match="init kind"):
        normalize_row_init({"kind": "xavier"})
    spec = TableSpec("t", 8, NORMAL, admission=Admission(max_rows=100))
    assert TableSpec.from_dict(spec.to_dict()) == spec


def _splitmix(x: int) -> int:
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_bucket_and_init_follow_the_documented_algorithm() -> None:
    """docs/protocol-ps.md, "Embedding tables", in plain Python integers."""
    import math

    m = (1 << 64) - 1
    for i in (0, 5, -3, 2**40 + 7):
        u = i & m
        assert buckets_of(np.array([i]), 64)[0] == _splitmix(u ^ 0x5BD1E9955BD1E995) % 64
        key = _splitmix(_splitmix(u) ^ 7)

        def unif(c: int, key: int = key) -> float:
            return (_splitmix((key + c * 0x9E3779B97F4A7C15) & m) >> 11) * 2.0**-53

        dim = 3
        want = [
            np.float32(
                0.0
                + 0.1
                * math.sqrt(-2 * math.log(1 - unif(j + 1)))
                * math.cos(2 * math.pi * unif(dim + j + 1))
            )
            for j in range(dim)
        ]
        got = initial_rows(NORMAL, np.array([i]), dim)[0]
        np.testing.assert_allclose(got, want, rtol=1e-6)
        uni = normalize_row_init({"kind": "uniform", "low": -1, "high": 1, "seed": 7})
        got_u = initial_rows(uni, np.array([i]), dim)[0]
        np.testing.assert_allclose(
            got_u, [np.float32(-1 + 2 * unif(j + 1)) for j in range(dim)], rtol=1e-6
        )


def test_row_index_agrees_with_a_dict_across_merges() -> None:
    from adamps.server.store.tables.rowindex import RowIndex

    rng = np.random.default_rng(5)
    idx, ref = RowIndex(), {}
    n = 0
    for _ in range(30):  # ~30k ids: several merges of the recent dict into the sorted array
        new = np.setdiff1d(rng.integers(-(2**40), 2**40, 1000), np.fromiter(ref, np.int64))
        slots = np.arange(n, n + len(new))
        idx.add(new, slots)
        ref.update(zip(new.tolist(), slots.tolist(), strict=True))
        n += len(new)
        probe = np.concatenate(
            [rng.choice(np.fromiter(ref, np.int64), 500), rng.integers(0, 9, 50)]
        )
        assert idx.lookup(probe).tolist() == [ref.get(i, -1) for i in probe.tolist()]
    assert (
        len(idx.recent[0]) < len(idx.keys) and len(idx) == len(ref) and sorted(idx) == sorted(ref)
    )


def test_rows_checker_counts_a_push_in_a_loss_window_from_its_first_send() -> None:
    """A two-bucket push sent before a crash and acknowledged after it may miss the part that was
    acknowledged (and lost) before the crash; a push wholly outside the window may not."""
    from types import SimpleNamespace

    from adamps.testing.rows_exactness import RowsExactnessLoad

    load = RowsExactnessLoad(SimpleNamespace(), threads=0, max_pushes=4)
    load.out.acked += [0, 1, 2, 3]
    load.out.ack_times += [(15.0, 0), (15.0, 1), (15.0, 2), (15.0, 3)]
    load.sent_at.update({0: 9.0, 1: 9.0, 2: 12.0, 3: 12.0})
    values = np.array([0.0, 1.0, 1.0, 0.0, 0.0])
    window = [(8.0, 10.0)]
    problems = load.problems(values, window)
    assert len(problems) == 1 and "1 of 2 acknowledged" in problems[0], problems
    assert load.problems(np.array([0.0, 1.0, 1.0, 1.0, 0.0]), window) == []
    assert load.problems(np.array([0.0, 1.0, 1.0, 1.0, 0.0])) != []  # no window: strict


def _pages_of(deltas: list) -> dict[int, bytes]:
    """What LMDB would hold after writing `deltas` in order: page number -> its payload."""
    from adamps.server.store.checksum import unseal

    disk: dict[int, bytes] = {}
    for d in deltas:
        if d.full:
            disk.clear()
        disk = {p: v for p, v in disk.items() if p < d.n_pages}
        for key, rec in d.records("t#rows/0"):
            disk[int.from_bytes(key[-4:], "big")] = bytes(unseal(rec))
    return disk


def test_pages_written_and_merged_hold_the_block_and_reload_intact() -> None:
    """Issue 38: a flush writes the pages with a touched row; pages written one flush after
    another (or merged, when a flush failed: `after`) hold exactly the block, expiry included,
    and a start reads them back as the same rows in the same slots (intact: no full rewrite)."""
    from adamps.server.store.tables.rowpages import SavedRows

    blk = block({"kind": "adagrad", "lr": 0.1}, expire_after=10.0)
    per = blk.page_rows
    deltas = []
    blk.apply(RowPush(np.arange(3 * per + 5), np.ones((3 * per + 5, 4), "f4"), 1.0), ApplyStats())
    deltas.append(blk.take_delta())
    assert deltas[0].full and len(deltas[0].pages) == 4
    blk.apply(RowPush(np.array([per + 1]), np.ones((1, 4), "f4"), 2.0), ApplyStats())
    deltas.append(blk.take_delta())
    assert deltas[1].pages.tolist() == [1]
    # expiry at 11.5: every row but the one pushed at 2.0 goes, and 2 rows are created again;
    # the rows kept move down, so every page from the first removed row on is rewritten
    blk.apply(RowPush(np.array([7, 3 * per + 9]), np.ones((2, 4), "f4"), 11.5), ApplyStats())
    deltas.append(blk.take_delta())
    assert blk.n == 3 and deltas[2].n_pages == 1
    merged = deltas[2].after(deltas[1])  # the second flush failed: written with the third
    for disk in (_pages_of(deltas), _pages_of([deltas[0], merged])):
        saved = SavedRows(pages=sorted(disk.items()))
        ids, seen, values, accum, intact = saved.parse(4, 4, per)
        assert intact
        assert ids.tolist() == blk.ids[: blk.n].tolist()
        assert np.array_equal(seen, blk.seen[: blk.n])
        assert np.array_equal(values, blk.values[: blk.n])
        assert np.array_equal(accum, blk.accum[: blk.n])
