"""The joining side of a state transfer, as the replication core decides it (no IO, no clock):
when to ask which primary for a snapshot (``Fetch`` in the Ready; again after ``join_retry``
when one failed or did not fit, after ``persist_retry`` while this server cannot persist),
whether a fetched snapshot still fits, and when the installed copy starts to learn (take its
primary's rounds). Part of ``ReplCore`` (adamps.core.replication.node), which holds the state these
methods read; the shell fetches, installs and persists."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from adamps.core.replication.bucket import BucketReplica
from adamps.core.replication.ready import Fetch, Ready
from adamps.core.replication.settings import ReplSettings


class JoiningCopy:
    """The joining-side methods of ``ReplCore``."""

    buckets: dict[int, BucketReplica]
    roles: dict[int, str]
    join_ids: dict[int, int]
    persisted: dict[int, int]
    last_heard: dict[int, float]
    #: bucket -> (primary, epoch) its installed snapshot came from, while it is persisted
    installing: dict[int, tuple[str | None, int]]
    settings: ReplSettings
    _ready: Ready
    #: why this server cannot persist a copy now, or None (``cannot_persist``, disk.py,
    #: from the shell's flusher): no transfer is asked for meanwhile, it would only hold the primary's rounds for
    #: a learner that cannot become a durable member (issue 29)
    persist_blocked: str | None = None
    #: bucket -> the fetch in flight (the shell answers it with ``snapshot_fetched``)
    _fetching: dict[int, Fetch]
    #: bucket -> time before which no snapshot is asked for
    _fetch_after: dict[int, float]
    _next_fid: int = 0

    def _joins_tick(self, now: float) -> None:
        """Asks for a snapshot for every joining copy that holds none, fetches none and installs
        none, once its wait is over."""
        for b, target, at in self._joins_waiting(now):
            if now < at:
                continue
            primary, epoch, join = target
            if self.persist_blocked is not None:
                self._fetch_after[b] = now + self.settings.persist_retry
            elif primary is None:
                self._fetch_after[b] = now + self.settings.join_retry
                self._ready.heartbeat = True
            else:
                self._next_fid += 1
                self._fetching[b] = f = Fetch(b, primary, epoch, join, self._next_fid)
                self._ready.fetches.append(f)

    def _joins_waiting(self, now: float) -> list[tuple[int, tuple[str | None, int, int], float]]:
        """(bucket, join target, when its snapshot may be asked for) of every joining copy that
        holds none, fetches none and installs none."""
        out = []
        for b, role in self.roles.items():
            if role != "joining":  # (join_target's test first: most buckets are not joining)
                continue
            target = self.join_target(b)
            if target is None or b in self._fetching or b in self.installing:
                continue
            if not self.buckets[b].learning:
                out.append((b, target, self._fetch_after.get(b, now)))
        return out

    def _joins_due(self, now: float) -> float:
        """When ``_joins_tick`` next asks for a snapshot (inf: no copy waits for one)."""
        return min((at for _b, _t, at in self._joins_waiting(now)), default=float("inf"))

    def _stop_join(self, b: int) -> None:
        self._fetching.pop(b, None)
        self._fetch_after.pop(b, None)
        self._ready.stop_joins.append(b)

    def join_target(self, b: int) -> tuple[str | None, int, int] | None:
        """(primary, epoch, join id) to ask for a snapshot while bucket b is joining, else None."""
        if self.roles.get(b) != "joining":
            return None
        a = self.buckets[b].assignment
        return a.primary, a.epoch, self.join_ids.get(b, 0)

    def snapshot_fetched(self, f: Fetch, snap_epoch: int | None, now: float) -> bool:
        """The answer to `f`: the epoch its snapshot was sent under, or None (the fetch failed).
        True: install it now (then ``installed`` in the same step). A snapshot is installed only
        if the copy is still joining under the very record it was asked under, and the primary
        sent it under that epoch; else the record is asked for and the fetch tried again."""
        if self._fetching.get(f.bucket) != f:
            return False  # a fetch the core no longer waits for
        del self._fetching[f.bucket]
        rep = self.buckets.get(f.bucket)
        if (
            rep is not None
            and self.roles.get(f.bucket) == "joining"
            and (rep.assignment.primary, rep.assignment.epoch) == (f.primary, f.epoch)
            and snap_epoch == f.epoch
        ):
            return True
        self._fetch_after[f.bucket] = now + self.settings.join_retry
        self._ready.heartbeat = True
        return False

    def snapshot_corrupt(self, f: Fetch, now: float) -> None:
        """The fitting snapshot of `f` failed its checksum: nothing was installed; fetch again."""
        self._fetch_after[f.bucket] = now + self.settings.join_retry

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
        if not ok and self.roles.get(b) == "joining":
            self._fetch_after[b] = now + self.settings.persist_retry
        elif ok and rep is not None and self.roles.get(b) == "joining":
            if of == (rep.assignment.primary, rep.assignment.epoch):
                rep.learning = True
                self.last_heard[b] = now

    def learning(self, b: int) -> bool:
        """A joining copy holds its snapshot and takes its primary's rounds."""
        rep = self.buckets.get(b)
        return rep is not None and self.roles.get(b) == "joining" and rep.learning
