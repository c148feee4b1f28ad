"""The id -> slot index of a row block: a sorted array searched in one vectorised pass
(``np.searchsorted``), plus a dict of the ids added since the array was last rebuilt, merged
into it once it holds a quarter as many ids (so a merge's sort costs O(log n) per id added,
amortised). A lookup of 4,096 ids costs one binary search per id in C instead of one dict call
per id in Python: the row store's hottest step (benchmarks/embeddings.py).

Mutated only by its block's owner thread; `lookup` from another thread is a racy read, used
only where an approximate answer is fine (RowBlock.missing)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

#: the recent dict is merged when it holds more than max(MERGE_MIN, len(sorted) // 4) ids
MERGE_MIN = 256


class RowIndex:
    """int64 id -> int slot."""

    def __init__(self) -> None:
        #: (sorted ids, their slots), replaced as one tuple: a racy reader never pairs the
        #: arrays of two different merges
        self.sorted = (np.empty(0, np.int64), np.empty(0, np.int64))
        self.recent: dict[int, int] = {}

    @property
    def keys(self) -> np.ndarray:
        return self.sorted[0]

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where it has none."""
        # The dict first: a merge publishes the new arrays before it empties the dict, so a
        # racy reader sees each id in one or the other.
        recent = self.recent
        keys, slots = self.sorted
        if len(keys):
            pos = np.searchsorted(keys, ids)
            np.minimum(pos, len(keys) - 1, out=pos)
            out = np.where(keys[pos] == ids, slots[pos], -1)
        else:
            out = np.full(len(ids), -1, np.int64)
        if recent:
            miss = np.flatnonzero(out < 0)
            if len(miss):
                get = recent.get
                out[miss] = np.fromiter(
                    (get(i, -1) for i in ids[miss].tolist()), np.int64, len(miss)
                )
        return out

    def add(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Ids without a slot get these slots."""
        self.recent.update(zip(ids.tolist(), slots.tolist(), strict=True))
        if len(self.recent) > max(MERGE_MIN, len(self.keys) // 4):
            self._merge()

    def _merge(self) -> None:
        ids = np.fromiter(self.recent.keys(), np.int64, len(self.recent))
        slots = np.fromiter(self.recent.values(), np.int64, len(self.recent))
        old_keys, old_slots = self.sorted
        keys = np.concatenate([old_keys, ids])
        order = np.argsort(keys, kind="stable")
        self.sorted = (keys[order], np.concatenate([old_slots, slots])[order])
        self.recent = {}

    def rebuild(self, ids: np.ndarray) -> None:
        """The index of rows `ids` in slots 0 .. len(ids) - 1 (after removals or a load)."""
        order = np.argsort(ids, kind="stable")
        self.sorted = (np.ascontiguousarray(ids[order], np.int64), order.astype(np.int64))
        self.recent = {}

    # -- a read-only mapping (tests, status) ------------------------------------------------------

    def __len__(self) -> int:
        return len(self.keys) + len(self.recent)

    def __contains__(self, i: object) -> bool:
        if not isinstance(i, int | np.integer):
            return False
        return bool(self.lookup(np.array([int(i)], np.int64))[0] >= 0)

    def __getitem__(self, i: int) -> int:
        s = int(self.lookup(np.array([int(i)], np.int64))[0])
        if s < 0:
            raise KeyError(i)
        return s

    def __iter__(self) -> Iterator[int]:
        yield from self.keys.tolist()
        yield from self.recent
