"""One decoder per update kind: the wire form of an update turned, once, into the checked
parts that are applied (the owner threads' (shard, update) pairs), replicated (the compact
map every copy receives) and persisted (that map, in the replication log).

| kind | requests (primary) | replicated | module |
| --- | --- | --- | --- |
| dense delta | ``push_dense`` (/rpc and the data plane), a round's ``dense`` | ``"d"`` | dense.py |
| activation/error vectors | ``push_fc``, a round's ``layers`` | ``"f"`` | fc.py |
| Strom's compressed update | ``push_compressed``, a round's ``compressed`` | ``"c"`` | compressed.py |
| table rows | ``push_rows``, ``put_rows``, a round's ``rows`` | ``"r"`` | rows.py |
| checkpoint install | ``ckpt_install`` (shards, row shards) | ``"i"``, ``"j"`` | install.py |
| vector op (Sandblaster) | ``vec`` | ``"v"`` | vector.py |

The primary decodes a request with the kind's request decoder (writepath.py, tableops.py,
checkpoint_ops.py, vecops.py and roundop.py only add the role checks and the scheduling) and
keeps the parts with the compact map (``Checked``): applied as they are when the round
commits, nothing rebuilt. Every copy decodes a PREPARE's maps with ``replicated`` (the same
checks: a copy applies nothing the primary would have refused as a push) and keeps the parts
the same way until the commit; a batch read back from disk or received in a state transfer is
decoded by ``update_parts`` when it is applied. Bad input raises ProtocolError (a 4xx naming
the problem) or StoreError (an unknown shard, tensor or table) before anything is queued.

May import the store and what it is built of (shards, row tables, optimizers, bounds, hyper):
nothing of the replication or the HTTP shells.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from adamps import runs
from adamps.server.decode import compressed, dense, fc, install, rows, vector
from adamps.server.decode.fields import bad
from adamps.server.store.shards import ShardState, StoreError
from adamps.server.store.store import Store
from adamps.server.store.tables.rowtables import RowShardState
from adamps.server.updates.vecapply import VecOp
from adamps.wire.protocol import ProtocolError

#: replicated kind -> its decoder: (store, map) -> the (shard, update) parts every copy applies
DECODERS: dict[str, Callable[[Store, dict[str, Any]], list[tuple[Any, Any]]]] = {
    "d": dense.replicated,
    "f": fc.replicated,
    "c": compressed.replicated,
    "r": rows.replicated,
    "i": install.replicated,
    "j": install.replicated,
    "v": vector.replicated,
}


def replicated(store: Store, u: Any) -> list[tuple[ShardState, Any]]:
    """The checked (shard, update) parts of one replicated update, whoever sent it: ProtocolError
    (StoreError for what this store does not hold) unless the primary could have accepted it."""
    if not isinstance(u, dict):
        raise bad("an update must be a map")
    decoder = DECODERS.get(u.get("k"))  # type: ignore[arg-type]
    if decoder is None:
        raise bad(f"unknown update kind {u.get('k')!r}")
    return decoder(store, u)


class Checked(dict):
    """An update decoded once, holding the store parts it was decoded into: applied as they
    are when its round commits here. On the wire and on disk it is the plain map it is.
    Issue 36: the primary validated a push into store parts, dropped them and rebuilt them at
    commit, and a secondary checked a batch, dropped the result and built it again at commit
    (a compressed update decoded twice)."""

    __slots__ = ("parts",)


def checked(u: dict[str, Any], parts: list[tuple[ShardState, Any]]) -> Checked:
    c = Checked(u)
    c.parts = parts
    return c


def _current(store: Store, st: ShardState, part: Any) -> bool:
    """`st` (and the source vector a vector op reads) is still the state this store holds under
    its id (not a deleted run's, not one released and held again since it was decoded)."""
    held = store.tables.shards if isinstance(st, RowShardState) else store.shards
    if held.get(st.id) is not st:
        return False
    # (not getattr(part, "src", None): a miss on a slotted part raises inside, a microsecond
    # per part of every batch)
    return type(part) is not VecOp or part.src is None or store.shards.get(part.src.id) is part.src


def update_parts(store: Store, u: Any) -> list[tuple[ShardState, Any]]:
    """The (shard, update) parts of one update of a batch being applied: those it was decoded
    into (``Checked``), else decoded now (a batch read back from disk or from a state
    transfer, or one whose shards were released and held again since)."""
    parts = getattr(u, "parts", None)
    if parts is not None:
        # Applied once, at commit: not held on in the replication log (a resend or a flush
        # uses the map), so the log keeps no second, expanded form of its updates.
        u.parts = None
        if all(_current(store, st, p) for st, p in parts):
            return parts
    return replicated(store, u)


#: the codes saying that an update names a tensor, shard or table this server does not hold
UNKNOWN = frozenset({"unknown_tensor", "unknown_shard", "unknown_table"})


def deleted_run_of(store: Store, u: Any) -> str | None:
    """The deleted run (``Store.deleted_runs``) whose tensor or table update `u` names, if any."""
    if not store.deleted_runs or not isinstance(u, dict):
        return None
    s = u.get("s")
    names = [s] if isinstance(s, str) else list(s) if isinstance(s, list) else []
    if u.get("k") == "f":  # an fc update also names its tensor ("t" is tau or time elsewhere)
        names.append(u.get("t"))
    for name in names:
        if isinstance(name, str) and (run := runs.run_of(name)) in store.deleted_runs:
            return run
    return None


def gone_with_run(store: Store, u: Any, exc: Exception) -> bool:
    """`exc`, raised by update `u`, says that `u` names what a deleted run took away: `u` is
    then refused alone (issue 39: such an update in a round in flight wedged the bucket)."""
    return getattr(exc, "code", None) in UNKNOWN and deleted_run_of(store, u) is not None


def decoded(store: Store, u: Any) -> Any:
    """A received update decoded (``Checked``), or `u` itself when it names a deleted run's
    tensor or table that is gone here (refused alone when its batch is applied, as the
    primary refuses it, never the whole batch); raises for anything else malformed."""
    try:
        return checked(u, replicated(store, u))
    except (ProtocolError, StoreError) as exc:
        if gone_with_run(store, u, exc):
            return u
        raise


def store_parts(store: Store, updates: Iterable[Any]) -> list[tuple[ShardState, Any]]:
    """The (shard, update) parts of a batch's pushes, in order; unknown shards and kinds raise,
    except that an update naming a deleted run's tensor or table, gone here, is refused alone
    (skipped): the round goes on for the bucket's other updates. Copies that learn of the
    deletion at different times therefore differ only in the deleted run's values, which every
    copy drops; every other update is applied by every copy."""
    parts: list[tuple[ShardState, Any]] = []
    for push in updates:
        for u in push:
            try:
                parts += update_parts(store, u)
            except (StoreError, ProtocolError) as exc:
                if not gone_with_run(store, u, exc):
                    raise
    return parts
