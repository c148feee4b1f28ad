"""The values replication passes around (the controller's record of a bucket, a batch, a refusal,
an action to apply batches) and the bounded exactly-once table: shared by the per-bucket state
machine (adamps.core.replication.bucket), the per-server core (adamps.core.repl_server) and the shell."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

#: (client id, seq) pairs remembered per bucket for deduplication
DEFAULT_DEDUP_LIMIT = 65_536

ClientKey = tuple[str, int]


@dataclass(frozen=True)
class Assignment:
    """What the controller's committed record says about one bucket."""

    epoch: int
    primary: str | None
    secondaries: tuple[str, ...] = ()
    #: copies the controller has joining the bucket (they become learners of the primary)
    joining: tuple[str, ...] = ()

    def members(self) -> tuple[str, ...]:
        return ((self.primary,) if self.primary else ()) + self.secondaries


@dataclass(frozen=True)
class Batch:
    """One replication round's worth of updates, as every replica applies it."""

    seq: int
    epoch: int
    #: the updates, opaque here (compact form: activation/error vectors, codec messages)
    updates: tuple[Any, ...]
    #: (client id, client seq) of the pushes in this batch, parallel to `updates`
    clients: tuple[ClientKey | None, ...]

    @cached_property
    def nbytes(self) -> int:
        """Its updates' bytes as the transport sends them (payload_bytes), counted once: a
        batch is sent to every replica, and again when a round is retried. Issue 36's profile
        of a click-through step at RF 3: the walk at each send, 4% of a primary's event loop.
        (A batch's updates never change once it is made: every replica applies the same.)"""
        return payload_bytes(self.updates)


def payload_bytes(x: Any) -> int:
    """The bytes of a message's entries as the transport sends them: its arrays (anything with
    ``nbytes``: the core imports no numpy), byte strings and strings; 8 for a scalar; a
    batch's once (``Batch.nbytes``)."""
    if isinstance(x, Batch):
        return x.nbytes
    if isinstance(x, dict):
        x = x.values()
    elif not isinstance(x, list | tuple):
        t = type(x)
        if t is int or t is float or t is bool or x is None:
            return 8
        if t is str or t is bytes or t is bytearray:
            return len(x)
        n = getattr(x, "nbytes", None)
        return 8 if n is None else int(n)
    n = 0
    for v in x:
        n += payload_bytes(v)
    return n


@dataclass(frozen=True)
class Reject:
    """A refusal with a protocol error code (stale_epoch, not_primary, conflict, unavailable)."""

    code: str
    message: str
    epoch: int = 0
    #: the bucket refused, where the input named several (a push)
    bucket: int | None = None


@dataclass(frozen=True)
class Apply:
    """Action: apply these batches to the store, in this order."""

    batches: tuple[Batch, ...]


@dataclass
class Pending:
    update: Any
    client: ClientKey | None
    #: the shell's handle to answer the client (a future), opaque here
    waiter: Any


class Dedup:
    """Recently applied (client id, seq) pairs, bounded, in application order."""

    def __init__(self, limit: int = DEFAULT_DEDUP_LIMIT) -> None:
        self.limit = limit
        self._seen: OrderedDict[ClientKey, int] = OrderedDict()  # key -> batch seq

    def batch_of(self, key: ClientKey | None) -> int | None:
        return None if key is None else self._seen.get(key)

    def record(self, batch: Batch) -> None:
        for key in batch.clients:
            if key is not None:
                self._seen[key] = batch.seq
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)

    def to_list(self) -> list[list[Any]]:
        return [[c, s, b] for (c, s), b in self._seen.items()]

    def entries_after(self, seq: int, limit: int) -> list[list[Any]]:
        """The pairs recorded by batches after `seq` (at most the newest `limit`), in order: what
        a flush adds to the persisted table. Cost: the entries returned, not the table."""
        out = []
        for (c, s), b in reversed(self._seen.items()):
            if b <= seq or len(out) >= limit:
                break
            out.append([c, s, b])
        out.reverse()
        return out

    @classmethod
    def from_list(cls, items: Iterable[Sequence[Any]], limit: int = DEFAULT_DEDUP_LIMIT) -> Dedup:
        d = cls(limit)
        for c, s, b in items:
            d._seen[(str(c), int(s))] = int(b)
        while len(d._seen) > limit:
            d._seen.popitem(last=False)
        return d
