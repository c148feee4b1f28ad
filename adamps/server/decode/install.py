"""A checkpoint's restore (``ckpt_install``; replicated kinds ``"i"``, a shard's values and
optimizer state whole, and ``"j"``, a row shard's block whole) decoded into the parts the
owner threads apply (install.py's ``Install`` and ``RowInstall``). The primary decodes each
shard of the request with ``shard`` and ``row_shard``, every copy the replicated update with
``replicated``: float32 arrays of the shard's size, a row block that loads, finite and bounded
state (bounds.check_state), the version it had in the checkpoint. A copy used to check only the
arrays' sizes: a NaN value reached every secondary that the primary would have refused."""

from __future__ import annotations

from typing import Any

import numpy as np

from adamps.server.decode.fields import only, string
from adamps.server.store.shards import ShardState
from adamps.server.store.store import Store
from adamps.server.store.tables.rowtables import RowShardState
from adamps.server.updates import bounds
from adamps.server.updates.install import Install, RowInstall
from adamps.tables import buckets_of
from adamps.wire.limits import MAX_VERSION
from adamps.wire.protocol import ProtocolError

#: the fields of an ``"i"`` update (``update``: ``a`` when the shard has an accumulator, ``n``
#: when the checkpoint recorded a version) and of a ``"j"`` update (``row_update``)
FIELDS = frozenset({"k", "s", "v", "a", "n"})
ROW_FIELDS = frozenset({"k", "s", "b", "n"})


def update(
    sid: str, value: np.ndarray, accum: np.ndarray | None, version: int | None = None
) -> dict[str, Any]:
    """A checkpoint's shard restored whole (values and accumulator; ``n``: the version it had
    in the checkpoint, install.version_after)."""
    u: dict[str, Any] = {"k": "i", "s": sid, "v": value}
    if accum is not None:
        u["a"] = accum
    if version is not None:
        u["n"] = version
    return u


def row_update(sid: str, data: bytes | np.ndarray, version: int | None = None) -> dict[str, Any]:
    """A checkpoint's row shard restored whole (``RowBlock.tobytes``)."""
    u: dict[str, Any] = {"k": "j", "s": sid, "b": data}
    if version is not None:
        u["n"] = version
    return u


def version_of(u: dict[str, Any]) -> int | None:
    """An install's ``n``: the version the checkpoint read the shard at, or None."""
    n = u.get("n")
    if n is not None and (
        not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_VERSION
    ):
        raise ProtocolError(
            "bad_request",
            f"an install's version must be an int in [0, 2^62], got {str(n)[:40]}",
            limit=MAX_VERSION,
        )
    return n


def shard(store: Store, st: ShardState, u: dict[str, Any]) -> Install:
    """The checked store form of install update `u` of shard `st`: float32 arrays of the
    shard's size, an accumulator exactly when given, finite and bounded (as a push's are)."""
    arrays = [u.get("v"), u.get("a")]
    # the optimizer's state (adamps/optspec.py) may be larger than the shard: slots and a step count
    sizes = [st.shard.size, st.shard.size if st.accum is None else st.accum.size]
    for name, a, size in zip(("values", "accumulator"), arrays, sizes, strict=True):
        if a is None and name == "accumulator":
            continue
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.size != size:
            raise ProtocolError(
                "bad_shape", f"install of shard {st.id}: {name} must be float32 of {size} elements"
            )
    version = version_of(u)
    signed = store.tensor(st.shard.tensor).optimizer.signed_state
    bounds.check_state(f"shard {st.id}", arrays[0], arrays[1], signed)
    return Install(arrays[0], arrays[1], version)


def block_bytes(sid: str, data: Any) -> bytes | np.ndarray:
    """A row install's ``b``: bytes (inline, ``/rpc``), or a 1-D uint8 array (a raw payload on
    the data plane, uncopied: issue 38 item 7); anything else is ``bad_request``."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1:
        return data
    raise ProtocolError(
        "bad_request", f"row shard {sid}: a row install needs 'b': bytes or a uint8 array"
    )


def row_shard(st: RowShardState, data: Any, version: int | None) -> RowInstall:
    """A row block's bytes, checked: they load into a scratch block of the table's shape, and
    the rows' values and optimizer state are finite and bounded."""
    data = block_bytes(st.id, data)
    probe = st.table.new_block()
    try:
        probe.load_bytes(data)
    except Exception as exc:  # struct.error, ValueError: a damaged or foreign record
        raise ProtocolError("bad_request", f"row shard {st.id}: not a row block: {exc}") from None
    n = probe.n
    # An id twice in a block was taken: the index kept one slot, the others stayed orphaned
    # (flushed under the same key, exported twice). The load's index holds the ids sorted.
    ids = probe.index.sorted[0]
    if n > 1 and bool(np.any(ids[1:] == ids[:-1])):
        twice = int(ids[1:][ids[1:] == ids[:-1]][0])
        raise ProtocolError(
            "bad_request", f"row shard {st.id}: id {twice} appears more than once in the block"
        )
    # Rows of another bucket would be orphans here: pulls and pushes of their ids go to the
    # bucket they hash to, while flushes and exports would carry them twice.
    where = buckets_of(ids, st.table.n_buckets) if n else ids
    if n and bool(np.any(where != st.bucket)):
        k = int(np.flatnonzero(where != st.bucket)[0])
        raise ProtocolError(
            "bad_request",
            f"row shard {st.id}: id {int(ids[k])} belongs to bucket {int(where[k])}, "
            f"not {st.bucket}",
        )
    acc = None if probe.accum is None else probe.accum[:n]
    signed = st.table.optimizer.signed_state  # sparse_adam's first moments are signed
    bounds.check_state(f"row shard {st.id}", probe.values_f32(0, n), acc, signed)
    return RowInstall(data, version)


def replicated(store: Store, u: dict[str, Any]) -> list[tuple[Any, Any]]:
    """A copy's decoding of an ``"i"`` or ``"j"`` update: what ckpt_install checked."""
    only(u, FIELDS if u.get("k") == "i" else ROW_FIELDS)
    sid = string(u, "s")
    if u.get("k") == "i":
        st = store.shard(sid)
        return [(st, shard(store, st, u))]
    rst = store.tables.shard(sid)
    return [(rst, row_shard(rst, u.get("b"), version_of(u)))]
