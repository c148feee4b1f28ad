"""The frequency filter's bounded counts (adamps/server/store/tables/freqsketch.py, issue 23): memory fixed by
the width whatever the ids, counts never below the truth, over-counts within the documented
bound, and a row block's filter state bounded with a million distinct ids."""

from __future__ import annotations

import numpy as np

from adamps.server.store.tables.freqsketch import DEPTH, FrequencySketch
from adamps.server.store.tables.rowblock import ApplyStats, RowBlock, RowPush
from adamps.server.updates.optim import Optimizer
from adamps.tables import Admission


def test_counts_never_under_and_rarely_over_the_truth() -> None:
    """Sightings of 600 ids (Zipf counts) into a sketch of width 4096, below the halving bound
    (2,048 per row): every count >= the truth; over by >= 1 for at most 1/16 of the ids, by >= 2
    for at most 1e-3 (the docstring's bounds)."""
    rng = np.random.default_rng(0)
    sk = FrequencySketch(4096)
    ids = rng.integers(-(1 << 62), 1 << 62, 600)
    truth = np.zeros(600, int)
    for _ in range(3):
        order = rng.permutation(600)
        for chunk in np.array_split(order, 6):
            sk.see(ids[chunk])
            truth[chunk] += 1
    assert sk.halvings == 0
    est = sk.estimate(ids).astype(int)
    assert (est >= truth).all()
    assert np.mean(est > truth) <= 1 / 16
    assert np.mean(est >= truth + 2) <= 1e-3


def test_memory_is_fixed_by_the_width_and_counts_age() -> None:
    sk = FrequencySketch(1024)
    assert sk.nbytes == DEPTH * 1024 * 4
    rng = np.random.default_rng(1)
    for _ in range(200):  # 200,000 distinct ids: the mass is halved, the memory does not grow
        sk.see(rng.integers(0, 1 << 62, 1000))
    assert sk.nbytes == DEPTH * 1024 * 4
    assert sk.halvings > 100
    assert int(sk.counts.sum(axis=1).max()) <= 1024 // 2
    hot = np.array([7], np.int64)
    counts = [int(sk.see(hot)[0]) for _ in range(5)]
    assert counts[-1] >= 5  # seen 5 times in a row: counted 5 times (maybe one more)


def test_copies_agree_bit_for_bit_and_round_trip() -> None:
    a, b = FrequencySketch(256), FrequencySketch(256)
    rng = np.random.default_rng(2)
    for _ in range(50):
        ids = np.unique(rng.integers(0, 10_000, 100))
        assert np.array_equal(a.see(ids), b.see(ids))
    assert np.array_equal(a.counts, b.counts)
    c = FrequencySketch.from_bytes(256, a.tobytes())
    assert np.array_equal(c.counts, a.counts)


def test_a_row_block_filter_stays_bounded_under_a_million_distinct_ids() -> None:
    adm = Admission(admit_after=3, filter_width=2048)
    blk = RowBlock(4, {"kind": "zeros"}, Optimizer.from_dict({"kind": "sgd", "lr": 0.1}), adm, None)
    st = ApplyStats()
    g = np.ones((4096, 4), np.float32)
    for k in range(250):  # 1,024,000 distinct ids, each seen once: none admitted
        blk.apply(RowPush(np.arange(k * 4096, (k + 1) * 4096), g, float(k)), st)
    assert blk.n == 0 and st.filtered == 250 * 4096
    assert len(blk.tobytes()) <= 64 + DEPTH * 2048 * 4  # the filter's state: 32 KB, not 16 MB
    hot = np.array([5, 6], np.int64)
    for k in range(3):
        blk.apply(RowPush(hot, np.ones((2, 4), np.float32), 300.0 + k), st)
    assert blk.n == 2  # seen 3 times in a row: admitted (at the 3rd sighting, or one early)
