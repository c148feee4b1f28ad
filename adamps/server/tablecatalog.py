"""The embedding tables a parameter server defines: ``create_table`` (idempotent, persisted
before it returns), ``list_tables``, the reload of saved tables at start, and the definitions
copied between replicas of a bucket (``definitions``, ``ensure``). A table's definition is kept
in LMDB beside the tensors' (its record has a ``table`` field) and its row shards beside theirs."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from adamps.protocol import ProtocolError, require
from adamps.server import bounds
from adamps.server.config import PsConfig
from adamps.server.optim import OptimError, Optimizer
from adamps.server.persist import Persister
from adamps.server.rowtables import TableState
from adamps.server.store import Store
from adamps.tables import ROWS_SEP, Admission, TableError, TableSpec, normalize_row_init

log = logging.getLogger("adamps.server.app")

#: a table's rows start so unless create_table says otherwise
DEFAULT_INIT = {"kind": "normal", "mean": 0.0, "std": 0.01, "seed": 0}


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

    def _held(self) -> list[int]:
        b = self.store.buckets
        return list(range(self.cfg.n_buckets)) if b is None else sorted(b)

    # -- definitions ---------------------------------------------------------------------------

    def _spec(self, msg: dict[str, Any]) -> TableSpec:
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
            )
        except (TableError, OptimError) as exc:
            raise ProtocolError("bad_request", str(exc)) from None

    async def op_create_table(self, msg: dict[str, Any]) -> dict[str, Any]:
        spec = self._spec(msg)
        created, t = self._define(spec)
        return {"created": created, "table": self._describe(t)}

    def _define(self, spec: TableSpec) -> tuple[bool, TableState]:
        existing = self.tables.tables.get(spec.name)
        if existing is not None:
            if existing.spec == spec:
                return False, existing
            raise ProtocolError(
                "exists",
                f"table {spec.name!r} exists with a different definition",
                existing=existing.spec.to_dict(),
            )
        t = self.tables.define(spec, self._held())
        meta = {
            "spec": {"name": spec.name + ROWS_SEP[:-1]},  # what the saved row shards group by
            "table": spec.to_dict(),
            "seq": self.next_seq(),
        }
        # Written before the caller yields (as a tensor's create): no push is queued yet.
        self.persister.write_tensor(
            meta,
            [
                (st.id, st.version, np.frombuffer(st.value.tobytes(), "<f4"), None)
                for st in t.shards.values()
            ],
        )
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
        self.tables.define(spec, self._held(), shards, rows)

    def ensure(self, d: dict[str, Any]) -> bool:
        """Defines a table from a peer's definition (state transfer) unless it exists here."""
        return self._define(self._spec(d))[0]

    def definitions(self, names: list[str]) -> list[dict[str, Any]]:
        return [self.tables.table(n).spec.to_dict() for n in names]

    def _describe(self, t: TableState) -> dict[str, Any]:
        return {**t.spec.to_dict(), "rows_held": t.rows(), "buckets_held": sorted(t.shards)}

    async def op_list_tables(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"tables": [self._describe(t) for t in self.tables.tables.values()]}
