"""A bulk load's costs on every copy (issue 38, docs/benchmarks-history.md): the initial draw of
new rows in cache-sized chunks (bit-identical to the whole-array formula), put_rows creating
rows from their values without drawing initial ones, and duplicate ids summed with one sort."""

from __future__ import annotations

import hashlib
import tracemalloc

import numpy as np
import pytest

from adamps.server.store.tables import rowblock
from adamps.server.store.tables.rowblock import ApplyStats, RowBlock, RowPush, sum_duplicates
from adamps.server.updates.optim import Optimizer
from adamps.tables import Admission, initial_rows, normalize_row_init

#: sha256 prefixes of initial_rows before it was chunked (main at 5a01817): a change of any bit
#: of any row would change every table's rows not created yet
PINNED = [
    ({"kind": "normal", "mean": 0.5, "std": 0.02, "seed": 3}, 16, "b1410d4055665c14"),
    ({"kind": "uniform", "low": -0.1, "high": 0.2, "seed": 9}, 5, "4ed3e5090e45be9b"),
    ({"kind": "normal", "mean": 0.0, "std": 1.0, "seed": 2**62 + 5}, 300, "5b8bccfdb1fb1a45"),
]


@pytest.mark.parametrize(("init", "dim", "digest"), PINNED)
def test_initial_rows_keep_their_bits(init: dict, dim: int, digest: str) -> None:
    ids = np.random.default_rng(7).integers(-(2**62), 2**62, 20_000)
    rows = initial_rows(normalize_row_init(init), ids, dim)
    assert hashlib.sha256(rows.tobytes()).hexdigest()[:16] == digest
    # the same rows whichever chunk a row falls in
    assert np.array_equal(
        initial_rows(normalize_row_init(init), ids[4095:4099], dim), rows[4095:4099]
    )


def test_initial_rows_draw_in_chunks_not_whole_array_temporaries() -> None:
    ids = np.arange(100_000, dtype=np.int64)
    out_bytes = len(ids) * 16 * 4
    tracemalloc.start()
    try:
        initial_rows(normalize_row_init({"kind": "normal", "std": 0.01, "seed": 1}), ids, 16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # whole-array float64 temporaries peaked at ~10x the float32 output
    assert peak < 2 * out_bytes, f"peak {peak} bytes for {out_bytes} bytes of rows"


def block(opt: dict, expire: float | None = None) -> RowBlock:
    o = Optimizer.from_dict(opt)
    a = Admission(expire_after=expire)
    init = normalize_row_init({"kind": "normal", "std": 0.1, "seed": 7})
    return RowBlock(4, init, o, a, a.bucket_limit(1))


def test_put_rows_create_rows_from_their_values_without_an_initial_draw(monkeypatch) -> None:
    b = block({"kind": "adagrad", "lr": 0.1}, expire=1000.0)
    st = ApplyStats()
    g = np.full((3, 4), 0.5, np.float32)
    b.apply(RowPush(np.array([1, 2, 3]), g, 10.0), st)  # rows 1-3 exist (drawn, stepped)

    def no_draw(*_a: object) -> np.ndarray:
        raise AssertionError("put_rows drew initial values that its values overwrite")

    monkeypatch.setattr(rowblock, "initial_rows", no_draw)
    ids = np.array([9, 2, 7, 1], np.int64)  # 9 and 7 new, 2 and 1 held
    vals = np.arange(16, dtype=np.float32).reshape(4, 4)
    b.apply(RowPush(ids, vals, 20.0, assign=True), st)
    assert st.created == 5 and b.n == 5
    got = np.empty((4, 4), np.float32)
    b.gather(ids, got)
    assert np.array_equal(got, vals)
    s = b.slots(ids)
    assert (b.accum[s] == b.optimizer.initial_state).all()
    assert (b.seen[s] == 20.0).all() and b.seen[b.slots(np.array([3]))][0] == 10.0
    assert b.dirty[s // b.page_rows].all()


def test_duplicates_are_summed_as_before_with_one_sort() -> None:
    rng = np.random.default_rng(3)
    for n, hi in ((1000, 10**9), (1000, 50), (1, 5)):
        ids = rng.integers(-hi, hi, n)
        grads = rng.standard_normal((n, 8)).astype(np.float32)
        uniq, inv = np.unique(ids, return_inverse=True)  # the former algorithm, bit for bit
        want = np.zeros((len(uniq), 8), np.float32)
        np.add.at(want, inv, grads)
        got_ids, got = sum_duplicates(ids, grads)
        assert np.array_equal(got_ids, uniq) and np.array_equal(got, want)


@pytest.mark.parametrize(("m", "k"), [(10_000, 100), (1000, 1000), (0, 5), (5, 0)])
def test_index_runs_merge_into_one_sorted_run(m: int, k: int) -> None:
    from adamps.server.store.tables.rowindex import _merged

    rng = np.random.default_rng(m + k)
    ids = rng.choice(2**40, m + k, replace=False).astype(np.int64)
    a, b = np.sort(ids[:m]), np.sort(ids[m:])
    slots = {int(i): s for s, i in enumerate(ids.tolist())}

    def run(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return x, np.array([slots[int(i)] for i in x], np.int32).reshape(-1)

    keys, got = _merged(run(a), run(b))
    assert np.array_equal(keys, np.sort(ids))
    assert got.dtype == np.int32 and [slots[int(i)] for i in keys] == got.tolist()
