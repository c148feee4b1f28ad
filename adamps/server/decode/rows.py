"""An embedding table's rows (``push_rows``: gradients, ``put_rows``: values, a round's
``rows``; replicated kind ``"r"``, one update per bucket's row shard) decoded into the parts
the row shards' owner threads apply: (row shard, ``RowPush``). The request's own checks (the
table, the role of every bucket, the row limit) are tableops.py's; the values' checks are
here, run by the primary on the push and by every copy on the replicated update: ids int64
[n], values float32 [n, dim], finite and bounded, and distinct ids for put_rows."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from adamps.server.decode.fields import bad, only, string
from adamps.server.store.store import Store
from adamps.server.store.tables.rowblock import RowPush
from adamps.server.store.tables.rowtables import RowShardState
from adamps.server.updates import bounds
from adamps.wire.protocol import ProtocolError

#: the fields of an ``"r"`` update: what ``update`` writes (``a``: only for put_rows' values)
FIELDS = frozenset({"k", "s", "i", "g", "t", "a"})


def update(
    sid: str, ids: np.ndarray, grads: np.ndarray, now: float, assign: bool = False
) -> dict[str, Any]:
    """A push's part for one row shard, in a replication batch (``a``: put_rows' values)."""
    u = {"k": "r", "s": sid, "i": ids, "g": grads, "t": now}
    if assign:
        u["a"] = True
    return u


def check_values(field: str, ids: np.ndarray, values: np.ndarray, assign: bool) -> None:
    """The pass over a push's values (finite, and small enough to stay finite) and, for a
    put_rows (`assign`), its ids' distinctness (a sort): run off the event loop when large."""
    bounds.check_dense(field, values)
    if assign:
        uniq, counts = np.unique(ids, return_counts=True)
        if len(uniq) != len(ids):
            dup = int(uniq[counts > 1][0])
            raise ProtocolError("bad_request", f"put_rows names id {dup} more than once")


def replicated(store: Store, u: dict[str, Any]) -> list[tuple[RowShardState, RowPush]]:
    """A copy's decoding of an ``"r"`` update: what push_rows (put_rows) checked."""
    only(u, FIELDS)
    st = store.tables.shard(string(u, "s"))
    ids, grads, when, assign = u.get("i"), u.get("g"), u.get("t"), u.get("a", False)
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 1 or not len(ids):
        raise ProtocolError(
            "bad_shape", "replicated batch: row ids must be a non-empty int64 array"
        )
    dim = st.table.spec.dim
    if (
        not isinstance(grads, np.ndarray)
        or grads.dtype != np.float32
        or grads.shape != (len(ids), dim)
    ):
        raise ProtocolError(
            "bad_shape",
            f"replicated batch: row grads of {st.id} must be float32 [{len(ids)}, {dim}]",
        )
    if isinstance(when, bool) or not isinstance(when, int | float) or not math.isfinite(when):
        raise bad("a row update's time 't' must be a finite number")
    if not isinstance(assign, bool):
        raise bad("a row update's 'a' (put_rows: values, not gradients) must be a bool")
    check_values(st.id, ids, grads, assign)
    return [(st, RowPush(ids, grads, float(when), assign))]
