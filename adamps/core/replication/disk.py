"""The replication core's side of the server's disk (no IO, no clock): the copies reloaded at
start, the cut each flush took of a copy, a copy whose records are written afresh, and whether a
transferred copy can be persisted now. Part of ``ReplCore`` (adamps.core.replication.node), which holds
the state these inputs change; the shell (adamps.server.replication.disk, the app's scrub) reads and
writes LMDB and feeds what it found in here, never by writing the core's attributes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from adamps.core.replication.bucket import BucketReplica
from adamps.core.replication.values import Batch


class DiskSide:
    """The disk-facing inputs of ``ReplCore``."""

    buckets: dict[int, BucketReplica]
    roles: dict[int, str]
    #: bucket -> seq of the last cut taken for the flush (absent: its next cut is written
    #: fresh, with the whole exactly-once table)
    persisted: dict[int, int]
    persist_blocked: str | None

    def new_replica(self, b: int) -> BucketReplica: ...

    def reloaded(
        self,
        b: int,
        seq: int,
        epoch: int,
        dedup: Iterable[Sequence[Any]],
        prepared: Iterable[Batch],
    ) -> None:
        """A copy reloaded from disk at start: held as standby until the controllers decide."""
        rep = self.buckets[b] = self.new_replica(b)
        rep.restore(seq, epoch, dedup, prepared)
        self.roles[b] = "standby"
        self.persisted[b] = seq

    def cut_taken(self, b: int) -> None:
        """A flush took the cut of bucket b's copy at its committed seq (its next cut writes the
        exactly-once pairs recorded after it)."""
        self.persisted[b] = self.buckets[b].committed

    def rewrite_copy(self, b: int) -> None:
        """Bucket b's records on disk were found damaged (the scrub): its next cut is written
        fresh, position and whole exactly-once table."""
        self.persisted.pop(b, None)

    def cannot_persist(self, why: str | None) -> None:
        """Why this server cannot persist a transferred copy now, or None (the shell asks its
        flusher before each tick while a copy joins): no snapshot is asked for meanwhile."""
        self.persist_blocked = why
