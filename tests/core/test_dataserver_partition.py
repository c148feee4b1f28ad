"""Partitions of the training set (Project Adam 3.1): disjoint across replicas, covering each epoch."""

import numpy as np
import pytest

from dataserver.partition import slice_members, stream_positions


@pytest.mark.parametrize("n_replicas", [1, 2, 3, 7])
@pytest.mark.parametrize("n_slices", [1, 2, 3])
def test_partitions_are_disjoint_and_cover_the_training_set_each_epoch(
    n_replicas, n_slices
) -> None:
    n = 1000
    for epoch in range(3):
        seen = []
        for k in range(n_slices):
            members = slice_members(n, k, n_slices)
            for r in range(n_replicas):
                seen.append(members[stream_positions(len(members), r, n_replicas, epoch, seed=5)])
        every = np.concatenate(seen)
        assert len(every) == n  # nothing twice ...
        assert np.array_equal(np.sort(every), np.arange(n))  # ... nothing missing


def test_order_is_shuffled_per_epoch_and_deterministic() -> None:
    a0 = stream_positions(500, 1, 2, epoch=0, seed=9)
    a1 = stream_positions(500, 1, 2, epoch=1, seed=9)
    assert not np.array_equal(a0, a1)
    assert np.array_equal(
        a0, stream_positions(500, 1, 2, epoch=0, seed=9)
    )  # a failover server agrees
    assert not np.array_equal(a0, stream_positions(500, 1, 2, epoch=0, seed=10))
    # the held-out split keeps a fixed order
    assert stream_positions(10, 1, 3, epoch=4, seed=9, shuffle=False).tolist() == [1, 4, 7]


def test_bad_ids_are_rejected() -> None:
    with pytest.raises(ValueError):
        stream_positions(10, 2, 2, 0, 1)
    with pytest.raises(ValueError):
        stream_positions(10, 0, 0, 0, 1)
    with pytest.raises(ValueError):
        stream_positions(10, 0, 1, -1, 1)
    with pytest.raises(ValueError):
        slice_members(10, 3, 3)
