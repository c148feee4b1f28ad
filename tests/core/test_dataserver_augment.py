"""Augmentation (Project Adam 3.1): a different variant of each image every epoch; labels and
shapes kept; computed in a worker process; deterministic so a failover server agrees."""

import asyncio

import numpy as np
import pytest

from dataserver.augment import Augmenter, AugmentParams, augment_images, epoch_transforms
from dataserver.cache import CacheTooSmall, EpochCache
from dataserver.sources import builtin_mnist


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    return builtin_mnist()[0][:200]


def test_augmentation_changes_pixels_but_keeps_shape_and_ink(digits) -> None:
    t = epoch_transforms(len(digits), epoch=0, seed=1, params=AugmentParams())
    out = augment_images(digits, t)
    assert out.shape == digits.shape and out.dtype == np.uint8
    changed = np.mean([not np.array_equal(a, b) for a, b in zip(out, digits, strict=True)])
    assert changed > 0.95
    # a small shift/rotation moves the digit, it does not erase it
    ink_ratio = out.reshape(200, -1).sum(1) / digits.reshape(200, -1).sum(1)
    assert np.all(ink_ratio > 0.6) and np.all(ink_ratio < 1.2)


def test_zero_transform_is_identity_and_reflection_flips(digits) -> None:
    none = AugmentParams(max_shift=0, max_rotation=0, reflect=False)
    t = epoch_transforms(len(digits), 0, 1, none)
    assert np.array_equal(augment_images(digits, t), digits)
    flip = AugmentParams(max_shift=0, max_rotation=0, reflect=True)
    t = epoch_transforms(len(digits), 0, 1, flip)
    out = augment_images(digits, t)
    flipped = t[:, 3] == 1
    assert 50 < flipped.sum() < 150
    assert np.array_equal(out[flipped], digits[flipped][:, :, ::-1])
    assert np.array_equal(out[~flipped], digits[~flipped])


def test_variants_differ_between_epochs_and_repeat_for_the_same_epoch(digits) -> None:
    p = AugmentParams()
    e0 = augment_images(digits, epoch_transforms(len(digits), 0, 7, p))
    e1 = augment_images(digits, epoch_transforms(len(digits), 1, 7, p))
    again = augment_images(digits, epoch_transforms(len(digits), 0, 7, p))
    assert np.array_equal(e0, again)
    assert np.mean([not np.array_equal(a, b) for a, b in zip(e0, e1, strict=True)]) > 0.95


def test_colour_images_keep_their_channels() -> None:
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (4, 10, 12, 3), dtype=np.uint8)
    out = augment_images(imgs, epoch_transforms(4, 0, 1, AugmentParams()))
    assert out.shape == imgs.shape and not np.array_equal(out, imgs)


def test_worker_process_pool_matches_in_process_result(digits) -> None:
    """The real worker processes compute the same pixels as the in-process function."""
    p = AugmentParams()
    index = np.arange(len(digits))
    aug = Augmenter(digits, index, len(digits), seed=3, params=p, workers=1, chunk=64)
    aug.start()
    try:
        got = asyncio.run(aug.epoch(2))
    finally:
        aug.close()
    assert np.array_equal(got, augment_images(digits, epoch_transforms(len(digits), 2, 3, p)))
    assert aug.backlog == 0 and aug.done == len(digits)


def test_cache_is_bounded_and_evicts_least_recently_used() -> None:
    epoch = np.zeros(100, np.uint8)
    cache = EpochCache(bound=350, base_bytes=50, epoch_bytes=100)
    assert cache.capacity_epochs == 3
    for e in range(3):
        cache.put(e, epoch.copy())
    assert cache.nbytes == 350
    cache.get(0)  # 0 is now the most recently used
    assert cache.put(3, epoch.copy()) == [1]
    assert cache.epochs() == [0, 2, 3] and cache.nbytes <= 350
    with pytest.raises(CacheTooSmall, match="cache_bytes"):
        EpochCache(bound=120, base_bytes=50, epoch_bytes=100)


def test_server_computes_ahead_only_what_the_cache_bound_holds() -> None:
    from dataserver.config import DataServerConfig
    from dataserver.service import DataServer
    from dataserver.sources import Dataset

    x = np.random.default_rng(0).integers(0, 256, (100, 8, 8), dtype=np.uint8)
    y = np.arange(100, dtype=np.int64) % 10
    ds = Dataset(x, y, x[:10], y[:10])
    base = x.nbytes + y.nbytes + 10 * 64 + 10 * 8
    cfg = DataServerConfig(token="t", workers=0, ahead=5, cache_bytes=base + 2 * x.nbytes)

    async def scenario() -> tuple[list[int], list[int], int]:
        server = DataServer(cfg, ds)
        await server.start()
        try:
            first = server.status()["epochs_in_flight"]  # the epochs scheduled at start
            for e in range(4):
                await server.epoch_images("train", e)
            while server.status()["epochs_in_flight"]:
                await asyncio.sleep(0.01)
            st = server.status()
            return first, st["epochs_cached"], st["cache_bytes"]
        finally:
            await server.close()

    first, cached, nbytes = asyncio.run(scenario())
    assert first == [0, 1]  # ahead=5 asked for, 2 epochs fit
    assert cached == [3, 4] and nbytes <= cfg.cache_bytes
    with pytest.raises(CacheTooSmall):
        DataServer(DataServerConfig(token="t", cache_bytes=base + 10), ds)
