"""Augmentation (Project Adam 3.1): a new random translation / rotation / reflection of each image
every epoch, computed ahead of time in worker processes so that serving never waits on it.

The transforms of an epoch are drawn from ``default_rng([seed, epoch])`` for every image of the
whole dataset at once, so a variant depends only on (seed, epoch, image index): any data server
(a failover copy, or this one after evicting the epoch from its cache) recomputes the same pixels.
The interpolation is scipy.ndimage.affine_transform (bilinear, zero fill), not hand-written.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AugmentParams:
    max_shift: float = 2.0  #: pixels, uniform in [-max_shift, max_shift] on each axis
    max_rotation: float = 15.0  #: degrees, uniform in [-max_rotation, max_rotation]
    reflect: bool = False  #: horizontal reflection with probability 1/2 (off for digits)


def epoch_transforms(n_total: int, epoch: int, seed: int, params: AugmentParams) -> np.ndarray:
    """[n_total, 4] float64: (angle radians, shift y, shift x, flip 0/1) for every image of an epoch."""
    rng = np.random.default_rng([seed, epoch, 0xA06])
    t = np.empty((n_total, 4))
    t[:, 0] = np.deg2rad(rng.uniform(-params.max_rotation, params.max_rotation, n_total))
    t[:, 1:3] = rng.uniform(-params.max_shift, params.max_shift, (n_total, 2))
    flips = rng.random(n_total) < 0.5
    t[:, 3] = flips if params.reflect else 0.0
    return t


def augment_images(images: np.ndarray, transforms: np.ndarray) -> np.ndarray:
    """Applies one (rotation about the centre, translation, optional flip) per image.

    images: uint8 [n, H, W] or [n, H, W, C]; transforms: [n, 4] from epoch_transforms.
    """
    from adamps.extras import require

    # imported here: worker processes are the only hot users
    ndimage = require("scipy.ndimage", "augmenting images (--augment)")

    out = np.empty_like(images)
    h, w = images.shape[1:3]
    centre = np.array([(h - 1) / 2.0, (w - 1) / 2.0])
    for i in range(len(images)):
        angle, dy, dx, flip = transforms[i]
        c, s = np.cos(angle), np.sin(angle)
        # affine_transform maps output coordinates o to input coordinates m @ o + offset.
        m = np.array([[c, -s], [s, c]])
        if flip:
            m = m @ np.array([[1.0, 0.0], [0.0, -1.0]])
        offset = centre - m @ centre - np.array([dy, dx])
        if images.ndim == 3:
            ndimage.affine_transform(
                images[i], m, offset=offset, output=out[i], order=1, mode="constant"
            )
        else:
            for ch in range(images.shape[3]):
                ndimage.affine_transform(
                    images[i, :, :, ch],
                    m,
                    offset=offset,
                    output=out[i, :, :, ch],
                    order=1,
                    mode="constant",
                )
    return out


# ------------------------------------------------------------------ worker processes

_worker_images: np.ndarray | None = None


def _init_worker(path: str) -> None:
    global _worker_images
    # Memory-mapped read-only: the page cache holds one copy shared by every worker.
    _worker_images = np.load(path, mmap_mode="r")


def _augment_chunk(lo: int, hi: int, transforms: np.ndarray) -> np.ndarray:
    assert _worker_images is not None
    return augment_images(np.asarray(_worker_images[lo:hi]), transforms)


class Augmenter:
    """Computes augmented epochs of a fixed image array in a pool of worker processes.

    `workers` = 0 runs the transforms in one thread of this process instead (tests, tiny setups).
    Methods are called from the event loop thread only.
    """

    def __init__(
        self,
        images: np.ndarray,
        global_index: np.ndarray,
        n_total: int,
        *,
        seed: int,
        params: AugmentParams,
        workers: int = 1,
        chunk: int = 1024,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        self.images = images
        self.global_index = (
            global_index  #: global dataset index of each row (transforms are per global index)
        )
        self.n_total = n_total
        self.seed = seed
        self.params = params
        self.workers = workers
        self.chunk = max(1, chunk)
        self.backlog = 0  #: images scheduled for augmentation and not yet done
        self.done = 0  #: images augmented since start
        self._on_progress = on_progress
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self._pool: Executor | None = None

    def start(self) -> None:
        if self.workers > 0:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="adamps-dataserver-")
            path = os.path.join(self._tmpdir.name, "images.npy")
            np.save(path, self.images)
            self._path = path
        self._pool = self._new_pool()

    def _new_pool(self) -> Executor:
        if self.workers == 0:
            return ThreadPoolExecutor(max_workers=1, thread_name_prefix="augment")
        # spawn: a fresh interpreter, no forked copy of the event loop's threads.
        return ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(self._path,),
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    async def epoch(self, epoch: int) -> np.ndarray:
        """All images augmented for `epoch`, in row order (chunks run in parallel in the pool)."""
        assert self._pool is not None, "start() first"
        loop = asyncio.get_running_loop()
        transforms = epoch_transforms(self.n_total, epoch, self.seed, self.params)[
            self.global_index
        ]
        n = len(self.images)
        out = np.empty_like(self.images)
        bounds = [(lo, min(n, lo + self.chunk)) for lo in range(0, n, self.chunk)]
        self.backlog += n

        pending = {lo: hi - lo for lo, hi in bounds}  #: chunk start -> images not yet done

        async def one(lo: int, hi: int) -> None:
            for attempt in (1, 2):
                try:
                    if self.workers == 0:
                        job = (augment_images, self.images[lo:hi], transforms[lo:hi])
                    else:
                        job = (_augment_chunk, lo, hi, transforms[lo:hi])
                    part = await loop.run_in_executor(self._pool, *job)
                    break
                except BrokenProcessPool:
                    # A worker died (OOM killer, signal): replace the pool once and retry the chunk.
                    if attempt == 2:
                        raise
                    log.error("augmentation worker pool broke; starting a new one")
                    old, self._pool = self._pool, self._new_pool()
                    if old is not None:
                        old.shutdown(wait=False, cancel_futures=True)
            out[lo:hi] = part
            self.backlog -= pending.pop(lo)
            self.done += hi - lo
            if self._on_progress is not None:
                self._on_progress(hi - lo)

        try:
            await asyncio.gather(*(one(lo, hi) for lo, hi in bounds))
        finally:
            self.backlog -= sum(pending.values())  # chunks that failed or were cancelled
        out.flags.writeable = False
        return out
