"""Which images a stream carries, in which order: pure functions of (dataset size, ids, epoch, seed).

Two levels of splitting:

* slices: several data servers can split a dataset between them. Server slice k of K holds the
  training (and held-out) images whose index i has i % K == k; servers of the same slice are
  interchangeable copies (the failover group).
* partitions: within a slice, epoch e's stream for replica r of R is
  ``members[permutation(seed, e)][r::R]``. Partitions are disjoint and together cover the slice
  each epoch; membership and order change every epoch (the permutation covers the whole slice).

Everything is deterministic, so a failover server recomputes the same stream and resumes it at a
position (the number of images the client already has).
"""

from __future__ import annotations

import numpy as np

MAX_REPLICAS = 1 << 16
MAX_EPOCH = (1 << 31) - 1


def slice_members(n: int, slice_index: int, n_slices: int) -> np.ndarray:
    """Global indices of slice `slice_index` of `n_slices` of a dataset of `n` images."""
    if n_slices < 1 or not 0 <= slice_index < n_slices:
        raise ValueError(f"slice {slice_index}/{n_slices}: need 0 <= index < count")
    return np.arange(slice_index, n, n_slices, dtype=np.int64)


def stream_positions(
    n_members: int, replica: int, n_replicas: int, epoch: int, seed: int, *, shuffle: bool = True
) -> np.ndarray:
    """Positions (0..n_members-1 within the slice) that replica `replica`'s stream carries, in order.

    The held-out split is served with shuffle=False: fixed order, same partitioning.
    """
    if n_replicas < 1 or not 0 <= replica < n_replicas:
        raise ValueError(f"replica {replica} of {n_replicas}: need 0 <= replica < n_replicas")
    if epoch < 0:
        raise ValueError(f"epoch {epoch} must be >= 0")
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(n_members)
    else:
        order = np.arange(n_members, dtype=np.int64)
    return order[replica::n_replicas]
