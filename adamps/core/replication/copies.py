"""What a server's copies are, as its replication core holds them: the copies offered to the
controllers, the cut a flush persists, the status page and the digest op's position. Functions
of a ``ReplCore`` (no IO, no clock: time comes in) that only read it, except ``positions``,
which takes a flush's cut and tells the core so through its input ``cut_taken`` (a copy
reloaded from disk is the core's input ``reloaded``)."""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from typing import Any

from adamps.core.replication.bucket import BucketReplica
from adamps.core.replication.node import ReplCore
from adamps.core.replication.values import Batch


def copies(core: ReplCore) -> dict[int, list[int]]:
    """The copies held whole, with the (epoch, seq) of the newest batch held applied or
    prepared: what this server offers the controllers (ReplCore.offered)."""
    return core.offered()


def _persists(core: ReplCore, b: int, rep: BucketReplica) -> bool:
    # Also a joining copy whose installed snapshot is being persisted before it learns.
    return core.holds(b, rep) or b in core.installing


def held_copies(core: ReplCore) -> set[int]:
    """The buckets whose copy a flush persists."""
    return {b for b, r in core.buckets.items() if _persists(core, b, r)}


def positions(
    core: ReplCore,
    buckets: Container[int] | None,
    dedup_per_flush: int,
    make: Callable[[int, int, list[list[Any]], bool, list[Batch]], Any],
) -> dict[int, Any]:
    """Per held copy (of `buckets`; None: all), make(epoch, seq, dedup pairs, fresh, prepared
    batches): its position and the exactly-once pairs recorded since the last cut. Taken in
    the same step as the flush's copies are queued: they describe exactly what it writes."""
    out = {}
    for b, rep in core.buckets.items():
        if not _persists(core, b, rep) or (buckets is not None and b not in buckets):
            continue
        last = core.persisted.get(b)
        if last is None:
            dedup, fresh = rep.dedup.to_list(), True
        else:
            dedup, fresh = rep.dedup.entries_after(last, dedup_per_flush), False
        out[b] = make(rep.committed_epoch, rep.committed, dedup, fresh, rep.held_prepared())
        core.cut_taken(b)
    return out


def cut_unchanged(core: ReplCore, on_disk: Mapping[int, tuple[int, int]]) -> bool:
    """Whether a flush's cut now would write no position (what ``positions`` would give, looked
    at without building it: the flush's turn, issue 36): every copy a flush persists has its
    cut taken at its committed seq (no exactly-once pair since), holds nothing prepared past
    it, and is on disk at its (committed epoch, seq), and no copy on disk is gone."""
    held = 0
    for b, rep in core.buckets.items():
        if not _persists(core, b, rep):
            continue
        held += 1
        seq = rep.committed
        if core.persisted.get(b) != seq or (seq + 1) in rep.prepared:
            return False
        if on_disk.get(b) != (rep.committed_epoch, seq):
            return False
    return held == len(on_disk)


def position(core: ReplCore, b: int) -> dict[str, Any]:
    """A copy's committed seq, role and epoch (None when no copy is held): what the digest op
    answers beside the digest of its values."""
    rep = core.buckets.get(b)
    return {
        "committed": rep.committed if rep else None,
        "role": core.roles.get(b),
        "epoch": rep.assignment.epoch if rep else None,
    }


def primaries(core: ReplCore) -> list[int]:
    return [b for b, r in core.roles.items() if r == "primary"]


def lag(core: ReplCore, b: int) -> int:
    """Batches the slowest replica of a primary bucket has yet to commit."""
    rep = core.buckets[b]
    low = min((rep.acked_commit.get(m, -1) for m in rep.replicas), default=rep.committed)
    return max(0, rep.committed - max(low, 0))


def status(core: ReplCore, now: float) -> dict[str, Any]:
    out = {}
    for b, rep in sorted(core.buckets.items()):
        d = core.leases.deadline(b)
        out[str(b)] = {
            "role": core.roles.get(b),
            "epoch": rep.assignment.epoch,
            "primary": rep.assignment.primary,
            "secondaries": list(rep.assignment.secondaries),
            "committed": rep.committed,
            "committed_epoch": rep.committed_epoch,
            "learners": dict(rep.learners),
            "prepared": sorted(rep.prepared),
            "pending": len(rep.pending),
            "lease_left": None if d is None else round(d - now, 3),
        }
    return out
