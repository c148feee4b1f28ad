"""Dense deltas (``push_dense``, a round's ``dense``, the data plane's raw float32 payload;
replicated kind ``"d"``) decoded into the parts the owner threads apply: (shard, ``Dense``).

Each checked part is what is applied, replicated (``update``: its compact map) and persisted;
a copy decodes the map with ``replicated``, the same checks (shape, finite bounds, the
optimizer its push named). The primary's decoders take the server's ``Addressing`` (duck
typed, so this package imports nothing above the store): the role of every bucket named is
checked before its tensor is looked up, as for every op naming shard ids."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from adamps.server.decode.fields import Later, named_optimizer, only, run, string
from adamps.server.store.shards import ShardState
from adamps.server.store.store import Store
from adamps.server.updates import bounds
from adamps.server.updates.hyper import push_hyper
from adamps.server.updates.optim import Dense
from adamps.wire.protocol import ProtocolError, require, require_array

Parts = list[tuple[ShardState, Dense]]
#: (shards, builder of their compact update): what the primary replicates (writepath.py)
Wire = list[tuple[list[ShardState], Callable[[list[ShardState]], dict[str, Any]]]]


#: the fields of a ``"d"`` update: what ``update`` writes (``o``: only when the push named one)
FIELDS = frozenset({"k", "s", "d", "o"})


def update(sid: str, delta: np.ndarray, o: dict[str, Any] | None = None) -> dict[str, Any]:
    """The replicated form of one shard's delta (``o``: the optimizer its push named)."""
    u: dict[str, Any] = {"k": "d", "s": sid, "d": delta}
    if o is not None:
        u["o"] = o
    return u


def replicated(store: Store, u: dict[str, Any]) -> Parts:
    """A copy's decoding of a ``"d"`` update: what the primary checked of its push."""
    only(u, FIELDS)
    st = store.shard(string(u, "s"))
    d = u.get("d")
    if not isinstance(d, np.ndarray) or d.dtype != np.float32 or d.size != st.shard.size:
        raise ProtocolError(
            "bad_shape",
            f"replicated batch: delta of shard {st.id} must be float32 with "
            f"{st.shard.size} elements",
        )
    bounds.check_dense(st.id, d)
    return [(st, Dense(d, named_optimizer(store, u, st.shard.tensor)))]


def wire(parts: Parts) -> Wire:
    """The compact (replication) form of checked dense parts (with a push's hyper)."""
    return [([st], lambda sts, u=upd: update(sts[0].id, u.delta, _o(u))) for st, upd in parts]


def _o(u: Any) -> dict[str, Any] | None:
    """The wire form of the optimizer a push named for update `u` (None: the tensor's own)."""
    return None if u.opt is None else u.opt.to_dict()


def with_hyper(parts: Parts, hyper: dict[str, Any]) -> Parts:
    """Dense parts with the hyperparameters their push named for their tensors."""
    if not hyper:
        return parts
    return [
        (st, Dense(u.delta, hyper[st.shard.tensor][0]) if st.shard.tensor in hyper else u)
        for st, u in parts
    ]


def of_tensor(store: Store, addressing: Any, msg: dict[str, Any]) -> Parts:
    """push_dense of a whole tensor (``tensor``, ``delta``): every shard held here."""
    name = require(msg, "tensor", str)
    sts = addressing.held(name)
    delta = require_array(msg, "delta", shape=store.tensors[name].spec.shape, finite=False)
    bounds.check_dense("delta", delta)  # finite, and small enough to stay finite
    flat = delta.reshape(-1)
    opt = push_hyper(msg, store.tensors).get(name, (None,))[0]
    return [(st, Dense(flat[st.shard.start : st.shard.stop], opt)) for st in sts]


def of_shards(
    store: Store,
    addressing: Any,
    deltas: dict[str, Any],
    limit: int,
    arrays: bool,
    checked: bool = False,
) -> Parts:
    """push_dense by shard, from /rpc (`arrays`: wire arrays, checked for dtype and shape) or
    the data plane (float32 views cut to each shard's shape already): at most `limit` shards,
    the primary role of every bucket named, every shard held here, the finite bounds
    (`checked`: already found within them over the whole payload, bounds.within)."""
    if len(deltas) > limit:
        raise ProtocolError(
            "too_large", f"push_dense names {len(deltas)} shards; the limit is {limit}"
        )
    addressing.check_ids(deltas)
    parts: Parts = []
    for sid in deltas:
        if not isinstance(sid, str):
            raise ProtocolError("bad_request", "field 'shards' must map shard ids to arrays")
        st = store.shard(sid)
        if arrays:
            d = require_array(deltas, sid, shape=st.shard.shape, finite=False)
        else:
            d = deltas[sid]
            if d.shape != st.shard.shape:  # cut by the layout the meta was checked against
                raise ProtocolError("bad_shape", f"shard {sid!r} changed shape meanwhile")
        if not checked:
            bounds.check_dense(sid, d)
        parts.append((st, Dense(d)))
    if not parts:
        raise ProtocolError(
            "bad_request", "push_dense needs 'tensor' + 'delta' or a non-empty 'shards'"
        )
    return parts


def of_round(
    store: Store, addressing: Any, msg: dict[str, Any], limit: int, later: Later | None = None
) -> Parts:
    """A round's dense deltas: `dense_shards` (ids) and `dense`, their values one after the
    other in one float32 array (one array to decode and bound, not one per shard)."""
    states = addressing.shard_ids(msg, "dense_shards", twice_ok=False)
    values = require_array(msg, "dense", shape=(None,), finite=False)
    want = sum(st.shard.size for st in states)
    if values.size != want:
        raise ProtocolError(
            "bad_shape", f"field 'dense' needs {want} values for its shards, got {values.size}"
        )
    deltas, pos = {}, 0
    for st in states:
        deltas[st.id] = values[pos : pos + st.shard.size].reshape(st.shard.shape)
        pos += st.shard.size
    # the bound of every shard's part at once
    run(later, values.nbytes, lambda: bounds.check_dense("dense", values))
    return of_shards(store, addressing, deltas, limit, arrays=False, checked=True) if deltas else []
