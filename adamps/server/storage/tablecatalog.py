"""The embedding tables a parameter server defines: ``create_table`` (idempotent, persisted
before it returns), ``list_tables``, the reload of saved tables at start, and the definitions
copied between replicas of a bucket (``definitions``, ``ensure``). A table's definition is kept
in LMDB beside the tensors' (its record has a ``table`` field) and its row shards beside theirs."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from adamps.server.config import PsConfig
from adamps.server.storage.persist import Persister
from adamps.server.store.store import Store
from adamps.server.store.tables.freqsketch import DEPTH
from adamps.server.store.tables.rowtables import TableState
from adamps.server.updates import bounds
from adamps.server.updates.optim import OptimError, Optimizer
from adamps.tables import (
    ROWS_SEP,
    Admission,
    TableError,
    TableSpec,
    normalize_row_init,
    row_shard_id,
)
from adamps.wire.protocol import ProtocolError, require

log = logging.getLogger("adamps.server.api.app")

#: a table's rows start so unless create_table says otherwise
DEFAULT_INIT = {"kind": "normal", "mean": 0.0, "std": 0.01, "seed": 0}


def _sketch_cells(adm: Admission, buckets: int) -> int:
    return DEPTH * adm.filter_width * buckets if adm.admit_after > 1 else 0


class TableCatalog:
    """Definitions of tables: the store's and LMDB's. Event-loop thread (and start-up) only."""

    def __init__(
        self, cfg: PsConfig, store: Store, persister: Persister, next_seq: Callable[[], int]
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.tables = store.tables
        self.persister = persister
        #: the tensor catalog's counter that orders definitions in LMDB
        self.next_seq = next_seq
        #: one create at a time (op_create_table)
        self._creating = asyncio.Lock()

    def _held(self) -> list[int]:
        b = self.store.buckets
        return list(range(self.cfg.n_buckets)) if b is None else sorted(b)

    # -- definitions ---------------------------------------------------------------------------

    def check(self, msg: dict[str, Any]) -> TableSpec:
        try:
            opt = Optimizer.from_dict(require(msg, "optimizer", dict, default={"kind": "sgd"}))
            opt.check_for_table()
            bounds.check_optimizer(opt)
            return TableSpec(
                require(msg, "name", str),
                require(msg, "dim", int),
                normalize_row_init(require(msg, "init", dict, default=DEFAULT_INIT)),
                opt.to_dict(),
                Admission.from_dict(require(msg, "admission", dict, default={})),
                require(msg, "dtype", str, default="float32"),
            )
        except (TableError, OptimError) as exc:
            raise ProtocolError("bad_request", str(exc)) from None

    def sketch_cells(self) -> int:
        """4-byte counters the frequency filters of the tables here may hold (one sketch per
        held bucket, made at its first sighting): counted in max_server_elems."""
        return sum(
            _sketch_cells(t.spec.admission, len(t.shards)) for t in self.tables.tables.values()
        )

    def _check_room(self, spec: TableSpec, held: list[int]) -> None:
        """A new table's filters fit in max_server_elems beside the tensors' elements and the
        other tables' filters (issue 39: a filter of 2^24 counters was 256 MiB per bucket)."""
        new = _sketch_cells(spec.admission, len(held))
        if not new:
            return
        used = sum(st.shard.size for st in self.store.shards.values()) + self.sketch_cells()
        if used + new > self.cfg.max_server_elems:
            raise ProtocolError(
                "too_large",
                f"table {spec.name!r}'s frequency filters would put {used + new} 4-byte cells "
                f"on this server ({new} for its {len(held)} buckets, filter_width "
                f"{spec.admission.filter_width}); the limit is {self.cfg.max_server_elems}",
                limit=self.cfg.max_server_elems,
            )

    async def op_create_table(self, msg: dict[str, Any]) -> dict[str, Any]:
        spec = self.check(msg)
        async with self._creating:
            if self._existing(spec) is None:
                self._check_room(spec, self._held())
                # The definition and its empty row shards go to LMDB on a worker thread (the
                # persister's lock may wait for a flush), before the table exists in memory:
                # no push or flush of it can come first (issue 39).
                held = self._held()
                wrote = await asyncio.to_thread(self._persist, spec, held, self.next_seq(), True)
                if wrote and self._existing(spec) is None:
                    t = self.tables.define(spec, held)
                    for b in self._held():  # a bucket held meanwhile (rare): an empty block
                        if b not in t.shards:
                            self.tables.hold(b)
                    log.info(
                        "created table %s dim %d (%s)", spec.name, spec.dim, spec.optimizer["kind"]
                    )
                    return {"created": True, "table": self._describe(t)}
            created, t = self._define(spec)
        return {"created": created, "table": self._describe(t)}

    def _existing(self, spec: TableSpec) -> TableState | None:
        """The table of this name if its definition is `spec`; `exists` if another."""
        existing = self.tables.tables.get(spec.name)
        if existing is not None and existing.spec != spec:
            raise ProtocolError(
                "exists",
                f"table {spec.name!r} exists with a different definition",
                existing=existing.spec.to_dict(),
            )
        return existing

    def _persist(self, spec: TableSpec, held: list[int], seq: int, only_new: bool = False) -> bool:
        """A new table's definition and its empty row shards (a header each: a block's
        frequency sketch is made at its first sighting) in one transaction; `only_new`: not if
        a definition exists (a peer's, written meanwhile: Persister.write_tensor)."""
        meta = {
            "spec": {"name": spec.name + ROWS_SEP[:-1]},  # what the saved row shards group by
            "table": spec.to_dict(),
            "seq": seq,
        }
        empty = TableState(spec, self.cfg.n_buckets, self.tables.m).new_block().tobytes()
        rec = np.frombuffer(empty, "<f4")
        recs = [(row_shard_id(spec.name, b), 0, rec, None) for b in held]
        return self.persister.write_tensor(meta, recs, only_new)

    def _define(self, spec: TableSpec) -> tuple[bool, TableState]:
        """A peer's definition (state transfer) or a repeated create: defined here at once."""
        existing = self._existing(spec)
        if existing is not None:
            return False, existing
        held = self._held()
        self._persist(spec, held, self.next_seq())
        t = self.tables.define(spec, held)
        log.info("created table %s dim %d (%s)", spec.name, spec.dim, spec.optimizer["kind"])
        return True, t

    def load(
        self, meta: dict[str, Any], shards: dict[str, Any], rows: dict[str, Any] | None = None
    ) -> None:
        """A saved table at start: its definition and the saved row shards of held buckets
        (their headers in `shards`, their row records in `rows`: persist.SavedTensor)."""
        spec = TableSpec.from_dict(meta["table"])
        # a definition saved before the torch kinds names the old Adagrad as "adagrad" (with
        # initial_accumulator): its canonical form, so that a create repeating it still matches
        opt = Optimizer.from_dict(spec.optimizer).to_dict()
        spec = dataclasses.replace(spec, optimizer=opt)
        t = self.tables.define(spec, self._held(), shards, rows)
        # pages read not intact (or a whole block): rewritten as pages by the next
        # flush, not left as they are until a push touches each block (issue 38)
        stale = [st for st in t.shards.values() if st.value.full and st.value.n]
        if stale:
            self.store.mark_dirty(stale, lambda _r, _e: None)

    def ensure(self, d: dict[str, Any]) -> bool:
        """Defines a table from a peer's definition (state transfer) unless it exists here."""
        return self._define(self.check(d))[0]

    def definitions(self, names: list[str]) -> list[dict[str, Any]]:
        return [self.tables.table(n).spec.to_dict() for n in names]

    def _describe(self, t: TableState) -> dict[str, Any]:
        return {
            **t.spec.to_dict(),
            "rows_held": t.rows(),
            "buckets_held": sorted(t.shards),
            # per bucket, so a reader can count one copy (its primary's): a secondary's
            # commit may lag the primary's by a delayed COMMIT (up to a second)
            "bucket_rows": {str(b): st.value.n for b, st in list(t.shards.items())},
            # the row arrays' and index's bytes here (spare room included): a racy read
            "bytes_held": t.held_bytes(),
        }

    async def op_list_tables(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"tables": [self._describe(t) for t in self.tables.tables.values()]}
