"""A consistent checkpoint's cut by copy-on-write (issue 38 item 7): writes are held only while
each shard of the cut is marked, not while every shard is copied.

At the cut (``ckpt_hold``) every shard of the buckets this server is primary of is marked on its
owner thread, after every batch up to the cut's position and before any later one (the marks are
queued like a read). From then on the owner thread copies a marked shard before it applies the
first write after the cut (``keep``, called by the store before it changes a shard), and the
cut's reader (``ckpt_read`` with the cut) takes that copy, or, for a shard no write touched
since, copies it as it is then (``take``): the same values either way, those of the cut. Only
the shards written between the cut and their reading are copied twice; before, the hold lasted
a copy of every primary bucket (550-751 ms for 1 GB on 3 servers; issue 38's goal is 100 ms).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adamps.server.store.tables.rowtables import RowShardState


class Cut:
    """One cut's marks and copies on this server. ``copies`` is written by the owner threads
    (each shard's entry by its own owner only)."""

    def __init__(self, cut: str) -> None:
        self.cut = cut
        #: shard id -> (version, values, optimizer state) or (version, row block bytes, None)
        self.copies: dict[str, tuple[int, Any, Any]] = {}
        #: dropped (released with drop, or expired): marks left on shards are ignored
        self.dropped = False

    def mark(self, st: Any) -> None:
        """Owner thread, at the cut: `st` is copied before its next write."""
        st.cuts = (*(st.cuts or ()), self)

    def take(self, st: Any) -> tuple[int, Any, Any]:
        """Owner thread, when the cut is read: `st` as it was at the cut."""
        got = self.copies.pop(st.id, None)
        if got is not None:
            return got
        if not st.cuts or self not in st.cuts:
            raise RuntimeError(f"shard {st.id} is neither marked nor copied for cut {self.cut}")
        st.cuts = tuple(c for c in st.cuts if c is not self) or None
        return copy_of(st)


def keep(st: Any) -> None:
    """Owner thread, before a write to `st` that carries marks: one copy of it for every cut
    that still wants it, then no marks (the next writes change it freely)."""
    cuts = [c for c in st.cuts if not c.dropped]
    st.cuts = None
    if cuts:
        copy = copy_of(st)
        for c in cuts:
            c.copies[st.id] = copy


def copy_of(st: Any) -> tuple[int, Any, Any]:
    """(version, values, optimizer state) of a dense shard, (version, block bytes, None) of a
    row shard: copies, taken on its owner thread."""
    if isinstance(st, RowShardState):
        return st.version, st.value.tobytes(), None
    acc = None if st.accum is None else st.accum.reshape(-1).copy()
    return st.version, np.array(st.value.reshape(-1), copy=True), acc
