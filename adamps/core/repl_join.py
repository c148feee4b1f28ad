"""The joining side of a state transfer, as the replication core decides it (no IO, no clock):
which primary to ask for a snapshot, whether a fetched snapshot still fits, and when the
installed copy starts to learn (take its primary's rounds). Part of ``ReplCore``
(adamps.core.repl_core), which holds the state these methods read."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from adamps.core.replication import BucketReplica


class JoiningCopy:
    """The joining-side methods of ``ReplCore``."""

    buckets: dict[int, BucketReplica]
    roles: dict[int, str]
    join_ids: dict[int, int]
    persisted: dict[int, int]
    last_heard: dict[int, float]
    #: bucket -> (primary, epoch) its installed snapshot came from, while it is persisted
    installing: dict[int, tuple[str | None, int]]

    def join_target(self, b: int) -> tuple[str | None, int, int] | None:
        """(primary, epoch, join id) to ask for a snapshot while bucket b is joining, else None."""
        if self.roles.get(b) != "joining":
            return None
        a = self.buckets[b].assignment
        return a.primary, a.epoch, self.join_ids.get(b, 0)

    def snapshot_fits(self, b: int, asked: tuple[str | None, int], snap_epoch: int) -> bool:
        """A snapshot fetched from `asked` = (primary, epoch) is installed only if the copy is still
        joining under that very record, and the primary sent it under that epoch."""
        rep = self.buckets.get(b)
        return (
            rep is not None
            and self.roles.get(b) == "joining"
            and (rep.assignment.primary, rep.assignment.epoch) == asked
            and snap_epoch == asked[1]
        )

    def installed(
        self, b: int, committed: int, dedup: Iterable[Sequence[Any]], epoch: int, now: float
    ) -> None:
        """The shell queued the snapshot's values: the position moves in the same step. The copy
        does not learn (so acknowledges no round and is never reported caught up) until it and
        its position are on disk (`install_persisted`): a member held only in memory is lost
        with every copy's crash, and the bucket with it (issue 29). The flush holds it meanwhile."""
        rep = self.buckets[b]
        rep.install_snapshot(committed, dedup, epoch)
        rep.learning = False
        self.installing[b] = (rep.assignment.primary, rep.assignment.epoch)
        self.persisted.pop(b, None)

    def install_persisted(self, b: int, ok: bool, now: float) -> None:
        """The installed copy was persisted (ok) or could not be: it learns only if it is still
        joining under the record it was fetched from (else the shell asks the new primary)."""
        of, rep = self.installing.pop(b, None), self.buckets.get(b)
        if ok and rep is not None and self.roles.get(b) == "joining":
            if of == (rep.assignment.primary, rep.assignment.epoch):
                rep.learning = True
                self.last_heard[b] = now

    def learning(self, b: int) -> bool:
        """A joining copy holds its snapshot and takes its primary's rounds."""
        rep = self.buckets.get(b)
        return rep is not None and self.roles.get(b) == "joining" and rep.learning
