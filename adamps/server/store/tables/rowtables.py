"""The embedding tables a parameter server holds: per table, one row shard per held bucket
(``<table>#rows/<bucket>``), each a :class:`RowBlock` mutated only by its owner thread, as a
dense shard is.

A row shard is a :class:`ShardState` whose ``value`` is its ``RowBlock``, so the store's
machinery carries it unchanged: updates are owner-thread work items (applied as one group per
batch under replication), a push marks it dirty, a flush snapshot stores ``value.tobytes()``
(the whole block) in the same cut as every shard and bucket position, and a reload gets those
bytes back. Who may mutate what: ``RowTables``' maps on the event-loop thread (define, hold,
release); a block on its owner thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter

from adamps.layout import Shard, stable_bucket
from adamps.server.store.shards import ShardState, StoreError
from adamps.server.store.tables.rowblock import ApplyStats, RowBlock, RowPush
from adamps.server.store.tables.rowpages import SavedRows
from adamps.server.updates.install import RowInstall
from adamps.server.updates.optim import Optimizer
from adamps.tables import ROWS_SEP, TableSpec, row_shard_id


class RowShardState(ShardState):
    """One bucket's rows of one table (``value`` is the RowBlock; ``accum`` stays None: the
    block holds its accumulators)."""

    table: TableState
    bucket: int

    def apply_rows(self, pushes: Iterable[RowPush | RowInstall]) -> None:
        """Owner thread: the pushes in order; the table's counters follow."""
        stats = ApplyStats()
        for p in pushes:
            if isinstance(p, RowInstall):  # a checkpoint's restore: the whole block
                self.value.load_bytes(p.data)
            else:
                self.value.apply(p, stats)
        self.table.count(stats)


class TableState:
    """A table's definition and its held row shards (bucket -> state)."""

    def __init__(self, spec: TableSpec, n_buckets: int, metrics: TableMetrics) -> None:
        self.spec = spec
        self.n_buckets = n_buckets
        self.optimizer = Optimizer.from_dict(spec.optimizer)
        self.limit = spec.admission.bucket_limit(n_buckets)
        self.shards: dict[int, RowShardState] = {}
        self.m = metrics

    def new_block(self) -> RowBlock:
        s = self.spec
        return RowBlock(s.dim, s.init, self.optimizer, s.admission, self.limit, dtype=s.dtype)

    def count(self, st: ApplyStats) -> None:
        name = self.spec.name
        m = self.m
        if st.created:
            m.created.labels(name).inc(st.created)
        if st.dropped_full:
            m.dropped.labels(name, "full").inc(st.dropped_full)
        if st.filtered:
            m.dropped.labels(name, "filtered").inc(st.filtered)
        if st.expired:
            m.expired.labels(name).inc(st.expired)

    def held_bytes(self) -> int:
        """Bytes the blocks' arrays and indexes take (RowBlock.held_bytes; a racy read)."""
        return sum(st.value.held_bytes for st in list(self.shards.values()))

    def rows(self) -> int:
        """Rows held here (a racy read of the owner threads' counts; for status and metrics)."""
        return sum(st.value.n for st in list(self.shards.values()))


class TableMetrics:
    """``adamps_table_*``: what admission and expiry did, per table."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.created = Counter(
            "adamps_table_rows_created", "rows created on first push", ["table"], registry=registry
        )
        self.dropped = Counter(
            "adamps_table_rows_dropped",
            "gradients of ids without a row that got none: 'full' (the bucket's share of "
            "max_rows is used, on_full=drop, or a race past the reject check) or 'filtered' "
            "(seen fewer than admit_after times)",
            ["table", "why"],
            registry=registry,
        )
        self.rejected = Counter(
            "adamps_table_pushes_rejected",
            "push_rows refused with table_full (on_full=reject)",
            ["table"],
            registry=registry,
        )
        self.expired = Counter(
            "adamps_table_rows_expired",
            "rows removed after expire_after seconds without a push",
            ["table"],
            registry=registry,
        )


class RowTables:
    """name -> TableState; the row shards of the buckets the store holds. Event-loop thread."""

    def __init__(
        self, n_buckets: int, n_owners: int, registry: CollectorRegistry | None = None
    ) -> None:
        self.n_buckets = n_buckets
        self.n_owners = n_owners
        self.tables: dict[str, TableState] = {}
        #: row shard id -> state
        self.shards: dict[str, RowShardState] = {}
        self.m = TableMetrics(registry)

    def define(
        self,
        spec: TableSpec,
        buckets: Iterable[int],
        saved: Mapping[str, tuple[int, np.ndarray, Any]] | None = None,
        rows: Mapping[str, SavedRows] | None = None,
    ) -> TableState:
        """Adds a table with empty row shards for `buckets`, or their `saved` state (row shard
        id -> (version, the block's header or whole bytes as float32, unused), and its `rows`:
        row shard id -> its records read from LMDB, rowpages.py). The caller checked the
        name."""
        t = TableState(spec, self.n_buckets, self.m)
        self.tables[spec.name] = t
        saved = saved or {}
        rows = rows or {}
        for b in buckets:
            st = self._add(t, b)
            rec = saved.get(st.id)
            if rec is not None:
                st.version = int(rec[0])
                blk = st.value
                # popped: each shard's records are freed once parsed, so a start holds the
                # records and the arrays of one shard at a time beside the rest's records
                got = rows.pop(st.id, None) if isinstance(rows, dict) else rows.get(st.id)
                parsed = (
                    None
                    if got is None
                    else got.parse(spec.dim, blk.acc_width, blk.page_rows, spec.dtype)
                )
                blk.load_flushed(np.ascontiguousarray(rec[1]).tobytes(), parsed)
        return t

    def _add(self, t: TableState, b: int) -> RowShardState:
        sid = row_shard_id(t.spec.name, b)
        shard = Shard(t.spec.name + ROWS_SEP[:-1], b, 0, 0, False, 0, 0, (0,))
        st = RowShardState(
            shard, owner=stable_bucket(sid, self.n_owners), value=t.new_block(), accum=None
        )
        st.table = t
        st.bucket = b
        t.shards[b] = st
        self.shards[sid] = st
        return st

    def hold(self, bucket: int) -> None:
        """A bucket newly held: empty row shards, which a state transfer then replaces."""
        for t in self.tables.values():
            if bucket not in t.shards:
                self._add(t, bucket)

    def release(self, bucket: int) -> None:
        for t in self.tables.values():
            st = t.shards.pop(bucket, None)
            if st is not None:
                del self.shards[st.id]

    def forget(self, name: str) -> int:
        """Removes a table (a deleted run's, issue 25) and its row shards; returns how many."""
        t = self.tables.pop(name, None)
        if t is None:
            return 0
        for st in t.shards.values():
            self.shards.pop(st.id, None)
        return len(t.shards)

    def table(self, name: str) -> TableState:
        t = self.tables.get(name)
        if t is None:
            raise StoreError("unknown_table", f"no table named {name!r}")
        return t

    def shard(self, sid: str) -> RowShardState:
        st = self.shards.get(sid)
        if st is None:
            raise StoreError("unknown_shard", f"no row shard {sid!r} on this server")
        return st

    def in_bucket(self, b: int) -> list[RowShardState]:
        return [t.shards[b] for t in self.tables.values() if b in t.shards]
