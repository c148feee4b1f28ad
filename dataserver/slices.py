"""Elastic replicas (issue 25): the work of a run's epochs handed out as leased slices, pure.

A run's epoch ``e`` is the whole training set in the order ``stream_positions(n, 0, 1, e,
seed)`` (dataserver/partition.py), cut into contiguous *slices* of ``slice_size`` positions.
Replicas join and leave at any time; each asks for work with ``acquire`` and gets the next
slice nobody holds, leased to it for ``lease`` seconds. Every ``acquire`` or ``heartbeat``
of a replica renews all its leases, so a replica that trains slowly but is alive keeps its
slice; one that died or stalled past its lease loses it and the slice goes to the next replica
that asks, before any newer work. A replica reports a slice ``complete`` once every push of its
examples is acknowledged.

Guarantee: every example of every epoch is trained at least once; exactly once unless a
replica dies (or stalls past its lease) in the middle of a slice: that slice's examples it
already pushed are trained again by the next holder. A late ``complete`` of a reissued slice
from the old holder still counts (the examples were trained), and the slice is not handed out
again.

The 75% rule (Project Adam 3.2.5) with a changing set of replicas: slices of epoch ``e + 1``
are handed out once ``epoch_fraction`` of the replicas alive *now* (a heartbeat within the
lease) have run out of slices of ``e`` (or every slice of ``e`` is done); until then a replica
without work is told to wait. The others finish their slice of ``e`` meanwhile, so epochs
stay roughly aligned without the last replicas holding the rest up.

An epoch is *complete* once every one of its slices is done; the run is finished once its
last epoch is complete. Time enters as ``now`` (seconds, any monotonic origin); nothing here
reads a clock or does IO. One writer: the data server's event loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Grant:
    """A slice leased to a replica: positions ``start:stop`` of epoch ``epoch``'s order."""

    epoch: int
    slice: int
    start: int
    stop: int


@dataclass
class _Epoch:
    done: set[int] = field(default_factory=set)  #: slices whose examples were trained
    holder: dict[int, str] = field(default_factory=dict)  #: slice -> replica leasing it now
    handed: set[int] = field(default_factory=set)  #: slices ever handed out
    exhausted: set[str] = field(default_factory=set)  #: replicas that found no slice left
    served: int = 0  #: examples handed out (a reissued slice counts again)
    trained: int = 0  #: examples of done slices (each example once)
    reissued: int = 0  #: slices handed out again after their holder's lease lapsed


class SliceTable:
    """The leases of one run. Mutated only through its methods, by one thread."""

    def __init__(
        self,
        n_examples: int,
        slice_size: int,
        lease: float,
        epochs: int,
        epoch_fraction: float = 0.75,
    ) -> None:
        if n_examples < 1 or slice_size < 1 or lease <= 0 or epochs < 1:
            raise ValueError("n_examples, slice_size, epochs must be >= 1 and lease > 0")
        if not 0 < epoch_fraction <= 1:
            raise ValueError("epoch_fraction must be in (0, 1]")
        self.n = n_examples
        self.slice_size = slice_size
        self.n_slices = math.ceil(n_examples / slice_size)
        self.lease = lease
        self.epochs = epochs
        self.epoch_fraction = epoch_fraction
        self._epochs: dict[int, _Epoch] = {}
        self._seen: dict[str, float] = {}  #: replica -> last time it asked or heartbeat
        self.open = 1  #: the newest epoch whose slices are handed out
        #: replica -> (seq, answer) of its last lease request, to answer a retry the same
        self._answered: dict[str, tuple[int, Grant | None]] = {}

    # -- queries

    def live(self, now: float) -> list[str]:
        """Replicas heard from within the lease."""
        return sorted(r for r, t in self._seen.items() if now - t <= self.lease)

    def completed(self) -> int:
        """The last epoch e such that every slice of 1..e is done (0: none)."""
        e = 0
        while e < self.epochs and len(self._ep(e + 1).done) == self.n_slices:
            e += 1
        return e

    def finished(self) -> bool:
        return self.completed() >= self.epochs

    def counters(self) -> dict[int, dict[str, int]]:
        """Per epoch: examples served and trained, slices done and reissued."""
        return {
            e: {
                "served": ep.served,
                "trained": ep.trained,
                "slices_done": len(ep.done),
                "reissued": ep.reissued,
            }
            for e, ep in sorted(self._epochs.items())
        }

    def held(self) -> dict[str, int]:
        """Replica -> how many slices it holds now."""
        out: dict[str, int] = {}
        for ep in self._epochs.values():
            for r in ep.holder.values():
                out[r] = out.get(r, 0) + 1
        return out

    # -- events

    def heartbeat(self, replica: str, now: float) -> None:
        """The replica is alive: its leases run from now."""
        self._seen[replica] = now

    def acquire(self, replica: str, now: float, seq: int | None = None) -> Grant | None:
        """The next slice for ``replica`` (renewing its leases), or None: wait (or the run is
        finished). A replica may hold several slices: it asks for the next one while it still
        trains the last (its batches are read ahead)."""
        self.heartbeat(replica, now)
        self._expire(now)
        last = self._answered.get(replica)
        if seq is not None and last is not None and last[0] == seq:
            # The same request again (its answer was lost): the same slice, not an orphan
            # that the replica, alive and heartbeating, would hold for ever.
            g = last[1]
            if g is None or self._ep(g.epoch).holder.get(g.slice) == replica:
                return g
        g = self._acquire(replica, now)
        if seq is not None:
            self._answered[replica] = (seq, g)
        return g

    def _acquire(self, replica: str, now: float) -> Grant | None:
        for e in range(1, self.open + 1):  # the oldest free slice first: lapsed ones are reissued
            ep = self._ep(e)
            for s in range(self.n_slices):
                if s not in ep.done and s not in ep.holder:
                    return self._hand(e, s, replica)
            ep.exhausted.add(replica)
        if self.open < self.epochs and self._may_open(now):
            self.open += 1
            return self._acquire(replica, now)
        return None

    def complete(self, replica: str, epoch: int, slice_: int, now: float) -> bool:
        """The replica trained the slice (every push acknowledged). True if it counted (the
        first completion of that slice)."""
        self.heartbeat(replica, now)
        if not 1 <= epoch <= self.epochs or not 0 <= slice_ < self.n_slices:
            raise ValueError(f"no slice {slice_} of epoch {epoch}")
        ep = self._ep(epoch)
        if slice_ not in ep.handed:
            raise ValueError(f"slice {slice_} of epoch {epoch} was never handed out")
        if ep.holder.get(slice_) == replica:
            del ep.holder[slice_]
        if slice_ in ep.done:
            return False
        ep.done.add(slice_)
        # Completed (late) by a replica whose lease lapsed: the new holder's work is redundant.
        ep.holder.pop(slice_, None)
        g = self.span(epoch, slice_)
        ep.trained += g.stop - g.start
        return True

    # -- inside

    def _ep(self, e: int) -> _Epoch:
        return self._epochs.setdefault(e, _Epoch())

    def span(self, e: int, s: int) -> Grant:
        start = s * self.slice_size
        return Grant(e, s, start, min(self.n, start + self.slice_size))

    def _hand(self, e: int, s: int, replica: str) -> Grant:
        ep = self._ep(e)
        if s in ep.handed:
            ep.reissued += 1
        ep.handed.add(s)
        ep.holder[s] = replica
        ep.exhausted.discard(replica)
        g = self.span(e, s)
        ep.served += g.stop - g.start
        return g

    def _expire(self, now: float) -> None:
        """Leases of replicas not heard from within the lease lapse: their slices are free."""
        alive = set(self.live(now))
        for ep in self._epochs.values():
            for s in [s for s, r in ep.holder.items() if r not in alive]:
                del ep.holder[s]

    def _may_open(self, now: float) -> bool:
        """The 75% rule over the replicas alive now: enough of them ran out of slices of the
        open epoch (or it is complete)."""
        ep = self._ep(self.open)
        if len(ep.done) == self.n_slices:
            return True
        live = self.live(now)
        need = max(1, min(len(live), math.ceil(self.epoch_fraction * len(live) - 1e-9)))
        return sum(1 for r in live if r in ep.exhausted) >= need
