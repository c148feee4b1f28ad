"""Sandblaster's vector operations on the wire: a ``vec`` update in a replication batch
(``{"k": "v", "o": kind, "s": [base shard ids], "y", "x", "a"[, "v", "f"]}``) turned into the
store's (destination shard, VecOp) parts, on the primary before it queues and on a secondary
when a batch arrives. adamps/server/vecops.py serves the requests; vecapply.py applies."""

from __future__ import annotations

from typing import Any

import numpy as np

from adamps.layout import VECTOR_SEP, parse_shard_id, shard_id
from adamps.protocol import ProtocolError
from adamps.server.shards import ShardState
from adamps.server.store import Store
from adamps.server.vecapply import KINDS, VecOp


def vector_shard(base_sid: str, vector: str) -> str:
    """The id of vector `vector`'s shard beside base shard `base_sid` ("" = the base itself)."""
    if not vector:
        return base_sid
    tensor, index = parse_shard_id(base_sid)
    return shard_id(f"{tensor}{VECTOR_SEP}{vector}", index)


def resolve(store: Store, base: str, vector: str) -> ShardState:
    st = store.shards.get(vector_shard(base, vector))
    if st is None:
        tensor, _ = parse_shard_id(base)
        raise ProtocolError(
            "unknown_tensor"
            if f"{tensor}{VECTOR_SEP}{vector}" not in store.tensors
            else "unknown_shard",
            f"no vector {vector!r} beside shard {base!r} on this server (create tensor "
            f"'{tensor}{VECTOR_SEP}{vector}' with the shape of {tensor!r})",
        )
    return st


def parts_of(store: Store, u: dict[str, Any]) -> list[tuple[ShardState, VecOp]]:
    """The (destination shard, VecOp) pairs of a wire update ``{"k": "v", "o": kind, "s": base
    shard ids, "y": dst vector, "x": src vector, "a": alpha}``: on the primary before it queues,
    on a secondary when a batch arrives (which validates shard ids and kinds)."""
    kind = u.get("o")
    if kind not in KINDS:
        raise ProtocolError("bad_request", f"unknown vector op {kind!r}")
    parts = []
    for base in u["s"]:
        dst = resolve(store, base, u["y"])
        src = resolve(store, base, u["x"]) if KINDS[kind][0] else None
        if src is not None and (src.owner != dst.owner or src.value.shape != dst.value.shape):
            raise ProtocolError(
                "bad_shape", f"vectors {u['x']!r} and {u['y']!r} of {base!r} differ"
            )
        values, offset = None, 0
        if kind == "set":
            values, offset = u["v"], u["f"]
            if not isinstance(values, np.ndarray) or values.dtype != np.float32 or values.ndim != 1:
                raise ProtocolError("bad_request", "vector op set: values must be 1-D float32")
            if not isinstance(offset, int) or not 0 <= offset <= dst.shard.size - values.size:
                raise ProtocolError(
                    "bad_shape",
                    f"vector op set: offset {offset!r} + {values.size} values do not fit "
                    f"shard {dst.id} of {dst.shard.size} elements",
                )
        parts.append((dst, VecOp(kind, float(u.get("a", 0.0)), src, values, offset)))
    return parts
