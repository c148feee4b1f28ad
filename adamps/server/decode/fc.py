"""Activation and error vectors of a fully connected layer (``push_fc``, a round's
``layers``; replicated kind ``"f"``) decoded into the row-block parts the owner threads apply
(``shards.fc_parts``): a (k x N) and e (k x M) of a 2-D tensor cut on whole rows, 1 <= k <=
MAX_FC_K, ``k * max|a| * max|e|`` within the gradient bound (bounds.check_fc). The primary
decodes a push with ``layer``, a copy the replicated map with ``replicated``: the same checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from adamps.server.decode.fields import Later, bad, f32, named_optimizer, only, run, string, strings
from adamps.server.store.shards import ShardState, TensorState, fc_parts
from adamps.server.store.store import Store
from adamps.server.updates import bounds
from adamps.server.updates.optim import Fc
from adamps.wire.protocol import MAX_FC_K, ProtocolError, require_array

#: one layer decoded: (tensor name, its state, a, e, the shards its rows update)
Layer = tuple[str, TensorState, np.ndarray, np.ndarray, list[ShardState]]

#: the fields of an ``"f"`` update: what ``update`` writes (``o``: only when the push named one)
FIELDS = frozenset({"k", "t", "s", "a", "e", "o"})


def update(
    tensor: str, sids: Sequence[str], a: np.ndarray, e: np.ndarray, o: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The replicated form of one layer's vectors for the shards `sids` of one bucket."""
    u: dict[str, Any] = {"k": "f", "t": tensor, "s": list(sids), "a": a, "e": e}
    if o is not None:
        u["o"] = o
    return u


def _row_cut(t: TensorState, name: str) -> tuple[int, int]:
    """(M, N) of a 2-D tensor cut on whole rows, else bad_request."""
    if len(t.spec.shape) != 2 or not all(s.rows_aligned for s in t.layout_shards):
        raise ProtocolError(
            "bad_request",
            f"push_fc needs a 2-D tensor cut on whole rows; {name!r} has shape {list(t.spec.shape)}",
        )
    m, n = t.spec.shape
    return m, n


def _rows_k(a: np.ndarray, e: np.ndarray) -> None:
    if not 1 <= a.shape[0] <= MAX_FC_K or e.shape[0] != a.shape[0]:
        raise ProtocolError(
            "bad_shape",
            f"a and e need the same number of rows k, 1 <= k <= {MAX_FC_K}; "
            f"got {a.shape[0]} and {e.shape[0]}",
        )


def layer(
    store: Store, addressing: Any, name: str, fields: dict[str, Any], later: Later | None = None
) -> Layer:
    """One layer of a push: `fields` holds ``a``, ``e`` and optionally ``shards`` (unique
    shards of that tensor; else every shard of it, held here). `later`: the bounds' pass is
    appended there instead of run now (a round runs them before it queues anything)."""
    if isinstance(fields.get("shards"), list):
        # The role first, as for every op naming shard ids: a server restarted without its
        # data knows no tensor until a state transfer, and its 404 unknown_tensor to a client
        # with an old routing table would refuse for good a push the new primary may hold.
        addressing.check_ids(fields["shards"])
    t = store.tensor(name)
    m, n = _row_cut(t, name)
    a = require_array(fields, "a", shape=(None, n), finite=False)
    e = require_array(fields, "e", shape=(None, m), finite=False)
    _rows_k(a, e)
    run(later, a.nbytes + e.nbytes, lambda: bounds.check_fc(a, e))
    if "shards" in fields:
        states = addressing.shard_ids(fields, "shards", twice_ok=False)
        wrong = [st.id for st in states if st.shard.tensor != name]
        if wrong:
            raise ProtocolError("bad_request", f"shards {wrong} are not shards of {name!r}")
    else:
        states = addressing.held(name)
    return name, t, a, e, states


def replicated(store: Store, u: dict[str, Any]) -> list[tuple[ShardState, Fc]]:
    """A copy's decoding of an ``"f"`` update: what the primary checked of its push."""
    only(u, FIELDS)
    name = string(u, "t")
    t = store.tensor(name)
    sids = strings(u, "s", "an fc update")
    m, n = _row_cut(t, name)
    a, e = f32(u, "a", 2), f32(u, "e", 2)
    if a.shape[1] != n or e.shape[1] != m:
        raise ProtocolError(
            "bad_shape",
            f"replicated batch: fc update needs a (k, {n}) and e (k, {m}); "
            f"got {list(a.shape)} and {list(e.shape)}",
        )
    _rows_k(a, e)
    if len(set(sids)) != len(sids):
        raise bad("an fc update names a shard twice")
    states = [store.shard(s) for s in sids]
    for st in states:
        if st.shard.tensor != name:
            raise bad(f"shard {st.id!r} is not a shard of {name!r}")
    bounds.check_fc(a, e)
    return fc_parts(t, a, e, states, named_optimizer(store, u, name))
