"""A bounded memory cache of decoded images and of augmented epochs (Project Adam 3.1: pre-cache).

The decoded base images are pinned (they are the source of every variant); augmented epochs are
evicted least recently used when the bound would be exceeded. An evicted epoch that is asked for
again is recomputed: augmentation is deterministic in (seed, epoch, image), so it comes back the same.
Only the event-loop thread of the data server mutates a cache.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class CacheTooSmall(ValueError):
    """The bound cannot hold the decoded images plus one augmented epoch."""


class EpochCache:
    """Pinned base bytes + LRU augmented epochs, never more than `bound` bytes in total."""

    def __init__(self, bound: int, base_bytes: int, epoch_bytes: int) -> None:
        if base_bytes + epoch_bytes > bound:
            raise CacheTooSmall(
                f"cache bound {bound} bytes cannot hold the decoded images ({base_bytes} bytes) "
                f"plus one augmented epoch ({epoch_bytes} bytes); raise cache_bytes or use more slices"
            )
        self.bound = bound
        self.base_bytes = base_bytes
        self.epoch_bytes = epoch_bytes
        self._epochs: OrderedDict[int, np.ndarray] = OrderedDict()  #: epoch -> images, LRU first
        self.evictions = 0  #: epochs dropped to respect the bound

    @property
    def capacity_epochs(self) -> int:
        """How many augmented epochs fit beside the base images."""
        return max(1, (self.bound - self.base_bytes) // max(1, self.epoch_bytes))

    @property
    def nbytes(self) -> int:
        return self.base_bytes + sum(a.nbytes for a in self._epochs.values())

    def epochs(self) -> list[int]:
        return sorted(self._epochs)

    def __contains__(self, epoch: int) -> bool:
        return epoch in self._epochs

    def get(self, epoch: int) -> np.ndarray | None:
        arr = self._epochs.get(epoch)
        if arr is not None:
            self._epochs.move_to_end(epoch)
        return arr

    def put(self, epoch: int, images: np.ndarray) -> list[int]:
        """Stores an augmented epoch, evicting least recently used ones; returns the evicted epochs."""
        self._epochs.pop(epoch, None)
        evicted = []
        while self._epochs and self.nbytes + images.nbytes > self.bound:
            old, _ = self._epochs.popitem(last=False)
            evicted.append(old)
            self.evictions += 1
        if self.nbytes + images.nbytes > self.bound:
            raise CacheTooSmall(
                f"epoch of {images.nbytes} bytes does not fit the cache bound {self.bound}"
            )
        self._epochs[epoch] = images
        return evicted
