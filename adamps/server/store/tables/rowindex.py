"""The id -> slot index of a row block: two sorted numpy arrays searched in one vectorised pass
(``np.searchsorted``): the main one, and a small one of the ids added since the main one was
last rebuilt, merged into it once it holds a quarter as many ids (so a merge costs O(1) per id
added, amortised: both are sorted runs, which the stable sort merges in one pass). A lookup of
4,096 ids costs one binary search per id in C instead of one dict call per id in Python: the
row store's hottest step (benchmarks/embeddings.py).

No Python object per id (issue 38): a dict of the recent ids cost ~100 bytes per entry, and the
index now costs 12 bytes per row (an int64 id, an int32 slot: a block holds < 2**31 rows).

Mutated only by its block's owner thread; `lookup` from another thread is a racy read, used
only where an approximate answer is fine (RowBlock.missing)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

#: the recent arrays are merged when they hold more than max(MERGE_MIN, len(main) // 4) ids
MERGE_MIN = 4096

_EMPTY = (np.empty(0, np.int64), np.empty(0, np.int32))


def _find(pair: tuple[np.ndarray, np.ndarray], ids: np.ndarray) -> np.ndarray:
    keys, slots = pair
    if not len(keys):
        return np.full(len(ids), -1, np.int64)
    pos = np.searchsorted(keys, ids)
    np.minimum(pos, len(keys) - 1, out=pos)
    return np.where(keys[pos] == ids, slots[pos].astype(np.int64), -1)


def _merged(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple:
    """Two sorted runs of distinct ids as one."""
    if 8 * len(b[0]) < len(a[0]):
        # a few ids into many (each push's new ids into `recent`): their places by binary
        # search and two scatters, at 0.4-0.6 of the merge sort's time (issue 38: the index
        # was ~0.4 us of a new row's ~0.7 us apply at 300,000 rows a bucket)
        pos = np.searchsorted(a[0], b[0]) + np.arange(len(b[0]))
        n = len(a[0]) + len(b[0])
        keys, slots = np.empty(n, np.int64), np.empty(n, np.int32)
        rest = np.ones(n, bool)
        rest[pos] = False
        keys[pos], slots[pos] = b
        keys[rest], slots[rest] = a
        return keys, slots
    keys = np.concatenate([a[0], b[0]])
    order = np.argsort(keys, kind="stable")  # two sorted runs: one merge pass
    return keys[order], np.concatenate([a[1], b[1]])[order]


class RowIndex:
    """int64 id -> int slot."""

    def __init__(self) -> None:
        #: (sorted ids, their int32 slots), each pair replaced as one tuple: a racy reader
        #: never pairs the arrays of two different merges
        self.sorted: tuple[np.ndarray, np.ndarray] = _EMPTY
        #: the same, of the ids added since the last merge
        self.recent: tuple[np.ndarray, np.ndarray] = _EMPTY

    @property
    def keys(self) -> np.ndarray:
        return self.sorted[0]

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id (int64), -1 where it has none."""
        # recent first: a merge publishes the new main arrays before it empties recent, so a
        # racy reader sees each id in one or the other.
        recent = self.recent
        out = _find(self.sorted, ids)
        if len(recent[0]):
            miss = np.flatnonzero(out < 0)
            if len(miss):
                out[miss] = _find(recent, ids[miss])
        return out

    def add(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Ids without a slot get these slots."""
        ids = np.asarray(ids, np.int64)
        order = np.argsort(ids, kind="stable")
        new = (ids[order], np.asarray(slots)[order].astype(np.int32))
        self.recent = _merged(self.recent, new)
        if len(self.recent[0]) > max(MERGE_MIN, len(self.keys) // 4):
            self.sorted = _merged(self.sorted, self.recent)
            self.recent = _EMPTY

    def rebuild(self, ids: np.ndarray) -> None:
        """The index of rows `ids` in slots 0 .. len(ids) - 1 (after removals or a load)."""
        order = np.argsort(ids, kind="stable")
        self.sorted = (np.ascontiguousarray(ids[order], np.int64), order.astype(np.int32))
        self.recent = _EMPTY

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.sorted, *self.recent))

    # -- a read-only mapping (tests, status) ------------------------------------------------------

    def __len__(self) -> int:
        return len(self.keys) + len(self.recent[0])

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
        yield from self.recent[0].tolist()
