"""The frequency filter's counts (issue 23): how many times each id without a row was pushed, in
bounded memory, as a count-min sketch (Cormode and Muthukrishnan 2005) with conservative update
(Estan and Varghese 2002) and aging.

A sketch is ``DEPTH`` rows of ``width`` uint32 counters; an id's cells are SplitMix64 of the id
under ``DEPTH`` salts modulo ``width``; its count is the smallest of its cells. A sighting
raises each of the id's cells to (count + 1) if lower (conservative update: the cells shared
with other ids grow less than with plain increments). Memory is ``DEPTH * width * 4`` bytes per
bucket's row block, whatever the number of ids: 64 KB at the default width of 4,096.

**Error.** A count is never below the true number of sightings since the last halving; it is
above it only by collisions. The counters are halved whenever a row of them sums to more than
``width / 2`` sightings, so every cell holds on average at most 1/2 a sighting of other ids: an
id is over-counted by one or more with probability at most (1/2)^DEPTH = 1/16 by Markov's bound
(about 2.4% if the other ids' mass falls on its cells at random, Poisson(1/2) per cell), and by
two or more with probability below 1e-4. So the filter may admit an id one sighting early, rarely
two, never later than its ``admit_after``-th sighting within the aging window.

**Aging.** A halving also halves the counts of ids on their way to admission: an id must be seen
``admit_after`` times while its bucket receives about ``width / 4`` sightings of other new ids
(between two halvings), or proportionally more times over a longer span. A wider sketch has a
longer memory; this is Monolith's filter with a bound on memory instead of a bound on time.

Every copy of a bucket applies the same sightings in the same order: the counters agree bit for
bit (integers, no clock). Pure numpy: no IO.
"""

from __future__ import annotations

import numpy as np

from adamps.tables import splitmix64

#: rows of counters (independent hashes)
DEPTH = 4
_SALTS = np.array(
    [0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89],
    dtype=np.uint64,
)[:, None]


class FrequencySketch:
    """Counts of sightings of ids, bounded memory. Mutated only by its block's owner thread."""

    def __init__(self, width: int, counts: np.ndarray | None = None) -> None:
        self.width = width
        self.counts = np.zeros((DEPTH, width), np.uint32) if counts is None else counts
        #: halvings so far (for tests and status)
        self.halvings = 0

    def cells(self, ids: np.ndarray) -> np.ndarray:
        """[DEPTH, k] cell of each id in each row."""
        u = np.asarray(ids, np.int64).view(np.uint64)[None, :]
        return (splitmix64(u ^ _SALTS) % np.uint64(self.width)).astype(np.intp)

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        cells = self.cells(ids)
        return np.take_along_axis(self.counts, cells, axis=1).min(axis=0)

    def see(self, ids: np.ndarray) -> np.ndarray:
        """One sighting of each of the distinct `ids`; returns their counts including it."""
        if not len(ids):
            return np.empty(0, np.uint32)
        cells = self.cells(ids)
        est = np.take_along_axis(self.counts, cells, axis=1).min(axis=0) + np.uint32(1)
        for r in range(DEPTH):
            np.maximum.at(self.counts[r], cells[r], est)
        if int(self.counts.sum(axis=1, dtype=np.uint64).max()) > self.width // 2:
            self.counts >>= np.uint32(1)
            self.halvings += 1
        return est

    def raise_to(self, ids: np.ndarray, counts: np.ndarray) -> None:
        """Each id's cells at least its count (an exact count carried over from the previous
        format's pairs)."""
        cells = self.cells(ids)
        c = np.minimum(counts, 0xFFFFFFFF).astype(np.uint32)
        for r in range(DEPTH):
            np.maximum.at(self.counts[r], cells[r], c)

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes

    def tobytes(self) -> bytes:
        return self.counts.astype("<u4").tobytes()

    @classmethod
    def from_bytes(cls, width: int, data: bytes | memoryview) -> FrequencySketch:
        a = np.frombuffer(data, "<u4")
        if a.size != DEPTH * width:
            raise ValueError(
                f"a sketch of width {width} has {DEPTH * width} counters, got {a.size}"
            )
        return cls(width, a.astype(np.uint32).reshape(DEPTH, width))
