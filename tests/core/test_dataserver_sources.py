import numpy as np

from dataserver.sources import builtin_mnist


def test_builtin_mnist_split_is_stratified_and_deterministic():
    train_x, train_y, test_x, test_y = builtin_mnist()
    assert train_x.shape == (4000, 28, 28) and train_x.dtype == np.uint8
    assert train_y.shape == (4000,) and train_y.dtype == np.int64
    assert test_x.shape == (1000, 28, 28) and test_x.dtype == np.uint8
    assert test_y.shape == (1000,) and test_y.dtype == np.int64
    assert np.bincount(train_y).tolist() == [400] * 10
    assert np.bincount(test_y).tolist() == [100] * 10
    assert train_x.max() == 255 and train_x.mean() > 10  # real digits, not blanks
    again = builtin_mnist()
    assert np.array_equal(again[0], train_x) and np.array_equal(again[3], test_y)
    # No held-out image is also a training image.
    train_rows = {row.tobytes() for row in train_x.reshape(4000, -1)}
    assert not any(row.tobytes() in train_rows for row in test_x.reshape(1000, -1))
