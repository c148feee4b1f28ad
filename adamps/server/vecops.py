"""Vector operations on named vectors stored beside each tensor's shards (DistBelief 4.2).

Sandblaster's coordinator never holds the parameters: it asks every parameter-server shard to
combine vectors it holds and keeps the results there. A named vector ``v`` of tensor ``w`` is an
ordinary tensor named ``w@v`` of the same shape, created like any other; ``layout.stable_bucket``
places shard ``w@v/i`` in the bucket of ``w/i`` and on the same owner thread, so an operation on
shard ``i`` of every vector of ``w`` is local to one thread of one server. Because the vectors are
tensors, they are replicated, flushed to LMDB, snapshotted and moved with their bucket exactly
like parameters.

Writes (``vec``: copy, scale, axpy, mul) are updates of a new kind on the one write path:
validated whole, then on a replicated server the primary's lease is checked and the update
(``{"k": "v", ...}``, a few bytes per shard) travels in the bucket's 2PC rounds with the request's
(client, seq) pair, so a retry after a failover is applied exactly once: under failover an
operation either happened on the bucket or did not. Every replica applies it the same way, on
the destination shard's owner thread. Reads (``vec_dot``) are served by the primary like a pull,
as one float64 scalar per shard.

docs/protocol-ps.md specifies both ops.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from adamps.layout import VECTOR_SEP, parse_shard_id, shard_id
from adamps.protocol import ProtocolError, require, require_array
from adamps.server.bounds import MAX_LR, MAX_VALUE
from adamps.server.store import ShardState, Store, owner_future
from adamps.server.vecapply import KINDS, VecOp

if TYPE_CHECKING:
    from adamps.server.app import ParameterServer

#: the ops of POST /rpc this module serves
OPS = ("vec", "vec_dot")

# -- names ---------------------------------------------------------------------------------------


def vector_shard(base_sid: str, vector: str) -> str:
    """The id of vector `vector`'s shard beside base shard `base_sid` ("" = the base itself)."""
    if not vector:
        return base_sid
    tensor, index = parse_shard_id(base_sid)
    return shard_id(f"{tensor}{VECTOR_SEP}{vector}", index)


def _vector_name(msg: dict[str, Any], field: str) -> str:
    name = require(msg, field, str)
    if VECTOR_SEP in name or "/" in name or len(name) > 64:
        raise ProtocolError(
            "bad_request", f"field {field!r}: a vector name without '@' or '/', got {name!r}"
        )
    return name


def _alpha(msg: dict[str, Any]) -> float:
    a = msg.get("alpha")
    if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a):
        raise ProtocolError("bad_request", f"field 'alpha' must be a finite number, got {a!r}")
    if abs(a) > MAX_LR:
        raise ProtocolError("bad_request", f"|alpha| must be <= {MAX_LR:g}, got {a!r}")
    return float(a)


def _base_ids(ps: ParameterServer, msg: dict[str, Any]) -> list[str]:
    ids = ps._unique_names(msg, "shards", "shard ids (strings)")
    if not ids:
        raise ProtocolError("bad_request", "field 'shards' must name at least one shard")
    for sid in ids:
        tensor, _ = parse_shard_id(sid)
        if VECTOR_SEP in tensor:
            raise ProtocolError(
                "bad_request", f"shard {sid!r}: name the base tensor's shards, not a vector's"
            )
    ps._check_ids(ids)
    return ids


def _resolve(store: Store, base: str, vector: str) -> ShardState:
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
        dst = _resolve(store, base, u["y"])
        src = _resolve(store, base, u["x"]) if KINDS[kind][0] else None
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


# -- the ops of POST /rpc ------------------------------------------------------------------------


async def op_vec(ps: ParameterServer, msg: dict[str, Any]) -> dict[str, Any]:
    """y <- f(y, x, alpha) on every named base shard, exactly once per (client, seq)."""
    kind = require(msg, "kind", str)
    if kind not in KINDS:
        raise ProtocolError(
            "bad_request", f"field 'kind' must be one of {sorted(KINDS)}, got {kind!r}"
        )
    takes_x, takes_alpha = KINDS[kind]
    y = _vector_name(msg, "y")
    x = _vector_name(msg, "x") if takes_x else ""
    alpha = _alpha(msg) if takes_alpha else 0.0
    bases = _base_ids(ps, msg)
    wire: dict[str, Any] = {"k": "v", "o": kind, "y": y, "x": x, "a": alpha}
    if kind == "set":
        values = require_array(msg, "values", shape=(None,))
        if values.size and float(np.abs(values).max()) > MAX_VALUE:
            raise ProtocolError(
                "bad_request", f"set: values must be at most {MAX_VALUE:g} in magnitude"
            )
        wire["v"], wire["f"] = values, require(msg, "offset", int, default=0)
    for base in bases:  # everything resolved before anything is queued
        ps.store.shard(base)
    parts = parts_of(ps.store, {**wire, "s": bases})
    if ps.replicator is not None:
        by_id = {dst.id: base for base, (dst, _) in zip(bases, parts, strict=True)}
        return await ps._replicate(
            msg,
            [([dst for dst, _ in parts], lambda sts: {**wire, "s": [by_id[s.id] for s in sts]})],
        )
    ps._record_client(msg)
    # One group per shard, alone (a barrier): later updates never overtake the op's reads.
    versions = await owner_future(lambda cb: ps.store.push_group(parts, cb))
    return {"versions": versions}


async def op_vec_dot(ps: ParameterServer, msg: dict[str, Any]) -> dict[str, Any]:
    """x . y per named base shard, in float64, after every update acknowledged before."""
    x, y = _vector_name(msg, "x"), _vector_name(msg, "y")
    bases = _base_ids(ps, msg)
    pairs = [(_resolve(ps.store, b, x), _resolve(ps.store, b, y)) for b in bases]
    ps._check_serving([ps.store.shard(b) for b in bases])

    def dot(pair: tuple[ShardState, ShardState]) -> float:
        a, b = pair
        return float(np.dot(a.value.reshape(-1).astype(np.float64), b.value.reshape(-1)))

    results = await owner_future(
        lambda cb: ps.store.call([xs for xs, _ in pairs], _per_shard(pairs, dot), cb)
    )
    return {"dots": {b: results[xs.id] for b, (xs, _) in zip(bases, pairs, strict=True)}}


def _per_shard(
    pairs: list[tuple[ShardState, ShardState]], fn: Callable[[Any], float]
) -> Callable[[ShardState], float]:
    by_id = {xs.id: (xs, ys) for xs, ys in pairs}
    return lambda st: fn(by_id[st.id])
