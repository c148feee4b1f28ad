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

from typing import Any

import numpy as np

from adamps.layout import VECTOR_SEP, parse_shard_id
from adamps.server.addressing import Addressing
from adamps.server.decode import vector
from adamps.server.store.shards import ShardState
from adamps.server.store.store import Store
from adamps.server.store.tickets import owner_future
from adamps.server.updates.vecapply import KINDS
from adamps.server.writepath import WritePath
from adamps.wire.protocol import ENVELOPE, ProtocolError, only_fields, require, require_array

# -- names ---------------------------------------------------------------------------------------


def _vector_name(msg: dict[str, Any], field: str) -> str:
    name = require(msg, field, str)
    if VECTOR_SEP in name or "/" in name or len(name) > 64:
        raise ProtocolError(
            "bad_request", f"field {field!r}: a vector name without '@' or '/', got {name!r}"
        )
    return name


class VectorOps:
    """The ``vec`` and ``vec_dot`` ops (event-loop thread): writes through the write path,
    reads like a pull."""

    def __init__(self, store: Store, addressing: Addressing, writes: WritePath) -> None:
        self.store = store
        self.addressing = addressing
        self.writes = writes

    def _base_ids(self, msg: dict[str, Any]) -> list[str]:
        ids = self.addressing.unique_names(msg, "shards", "shard ids (strings)")
        if not ids:
            raise ProtocolError("bad_request", "field 'shards' must name at least one shard")
        for sid in ids:
            tensor, _ = parse_shard_id(sid)
            if VECTOR_SEP in tensor:
                raise ProtocolError(
                    "bad_request", f"shard {sid!r}: name the base tensor's shards, not a vector's"
                )
        self.addressing.check_ids(ids)
        return ids

    async def op_vec(self, msg: dict[str, Any]) -> dict[str, Any]:
        """y <- f(y, x, alpha) on every named base shard, exactly once per (client, seq)."""
        kind = require(msg, "kind", str)
        if kind not in KINDS:
            raise ProtocolError(
                "bad_request", f"field 'kind' must be one of {sorted(KINDS)}, got {kind!r}"
            )
        takes_x, takes_alpha = KINDS[kind]
        # a field of another kind (a `scale` carrying `x`) would be silently ignored: refused
        takes = {"kind", "shards", "y", "client", "seq", *ENVELOPE}
        takes |= {"x"} if takes_x else set()
        takes |= {"alpha"} if takes_alpha else set()
        takes |= {"values", "offset"} if kind == "set" else set()
        only_fields(msg, f"op 'vec' of kind {kind!r}", takes, op="vec")
        y = _vector_name(msg, "y")
        x = _vector_name(msg, "x") if takes_x else ""
        alpha = vector.alpha(msg.get("alpha")) if takes_alpha else 0.0
        bases = self._base_ids(msg)
        wire: dict[str, Any] = {"k": "v", "o": kind, "y": y, "x": x, "a": alpha}
        if kind == "set":
            values = vector.set_values(require_array(msg, "values", shape=(None,)))
            wire["v"], wire["f"] = values, require(msg, "offset", int, default=0)
        for base in bases:  # everything resolved before anything is queued
            self.store.shard(base)
        parts = vector.parts_of(self.store, {**wire, "s": bases})
        by_id = {dst.id: base for base, (dst, _) in zip(bases, parts, strict=True)}
        # One group per shard, alone (a barrier): later updates never overtake the op's reads.
        return await self.writes.replicate_or_apply(
            msg,
            [([dst for dst, _ in parts], lambda sts: {**wire, "s": [by_id[s.id] for s in sts]})],
            lambda: parts,
            group=True,
        )

    async def op_vec_dot(self, msg: dict[str, Any]) -> dict[str, Any]:
        """x . y per named base shard, in float64, after every update acknowledged before."""
        x, y = _vector_name(msg, "x"), _vector_name(msg, "y")
        bases = self._base_ids(msg)
        pairs = [
            (vector.resolve(self.store, b, x), vector.resolve(self.store, b, y)) for b in bases
        ]
        for b, (xs, ys) in zip(bases, pairs, strict=True):
            # A vector created with another shape than its base (issue 28: np.dot raised, a 500)
            if xs.value.shape != ys.value.shape:
                raise ProtocolError(
                    "bad_shape",
                    f"vectors {x!r} and {y!r} of {b!r} differ in shape: "
                    f"{list(xs.value.shape)} and {list(ys.value.shape)}",
                )
        self.addressing.check_serving([self.store.shard(b) for b in bases])
        by_id = {xs.id: ys for xs, ys in pairs}

        def dot(st: ShardState) -> float:
            other = by_id[st.id]
            return float(np.dot(st.value.reshape(-1).astype(np.float64), other.value.reshape(-1)))

        results = await owner_future(lambda cb: self.store.call([xs for xs, _ in pairs], dot, cb))
        return {"dots": {b: results[xs.id] for b, (xs, _) in zip(bases, pairs, strict=True)}}
