"""Sandblaster's vector operations (``vec``; replicated kind ``"v"``: ``{"k": "v", "o": kind,
"s": [base shard ids], "y", "x", "a"[, "v", "f"]}``) decoded into the store's (destination
shard, VecOp) parts, on the primary before it queues and on every copy when a batch arrives:
the same checks (the kind, alpha finite and bounded, set's values bounded and fitting the
shard, both vectors present beside every base shard). adamps/server/api/vecops.py serves the
requests; vecapply.py applies."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from adamps.layout import VECTOR_SEP, parse_shard_id, shard_id
from adamps.server.decode.fields import f32, only, string, strings
from adamps.server.store.shards import ShardState
from adamps.server.store.store import Store
from adamps.server.updates import bounds
from adamps.server.updates.vecapply import KINDS, VecOp
from adamps.wire.protocol import ProtocolError

#: the fields of a ``"v"`` update (what adamps/server/api/vecops.py writes: ``x`` and ``a``
#: always, ``""`` and 0.0 for a kind without them), and of a ``set``'s (its values and offset)
FIELDS = frozenset({"k", "o", "s", "y", "x", "a"})
SET_FIELDS = FIELDS | {"v", "f"}


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


def alpha(a: Any) -> float:
    """A vector op's alpha: a finite number within the learning rate's bound."""
    if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a):
        raise ProtocolError("bad_request", f"field 'alpha' must be a finite number, got {a!r}")
    if abs(a) > bounds.MAX_LR:
        raise ProtocolError("bad_request", f"|alpha| must be <= {bounds.MAX_LR:g}, got {a!r}")
    return float(a)


def set_values(values: np.ndarray) -> np.ndarray:
    """The values a ``set`` writes: bounded like initial values."""
    if values.size and bounds.max_abs("values", values) > bounds.MAX_VALUE:
        raise ProtocolError(
            "bad_request", f"set: values must be at most {bounds.MAX_VALUE:g} in magnitude"
        )
    return values


def replicated(store: Store, u: dict[str, Any]) -> list[tuple[ShardState, VecOp]]:
    """A copy's decoding of a ``"v"`` update: what the vec request checked."""
    if u.get("o") not in KINDS:
        raise ProtocolError("bad_request", f"unknown vector op {u.get('o')!r}")
    only(u, SET_FIELDS if u["o"] == "set" else FIELDS)
    strings(u, "s", "a vector update")
    string(u, "y")
    if KINDS[u["o"]][0]:
        string(u, "x")
    alpha(u.get("a", 0.0))
    if u["o"] == "set":
        set_values(f32(u, "v", 1))
        if isinstance(u.get("f"), bool) or not isinstance(u.get("f"), int):
            raise ProtocolError("bad_request", "replicated batch: set: offset 'f' must be an int")
    return parts_of(store, u)


def parts_of(store: Store, u: dict[str, Any]) -> list[tuple[ShardState, VecOp]]:
    """The (destination shard, VecOp) pairs of a checked vec update ``{"k": "v", "o": kind,
    "s": base shard ids, "y": dst vector, "x": src vector, "a": alpha}`` (the request's
    fields, or `replicated`'s)."""
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
