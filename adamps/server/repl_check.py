"""What a copy re-checks in every replicated batch before it keeps it (issue 28, item 1).

A secondary used to trust its primary's batches: shard ids and update kinds were looked up, but a
NaN delta, a delta of the wrong length or a tau of 1e39 was applied as sent, so a copy that may
later be promoted could hold NaN, and a malformed batch raised TypeError (a 500). Each copy now
runs the same checks on a batch as the primary ran on the push it came from (shapes, dtypes,
finiteness, the bounds of adamps/server/bounds.py), whoever sent it. A batch that fails is
refused as a whole (ProtocolError, a 4xx) before the replica state machine sees it.

The cost is one min/max pass over each array a secondary receives (what the primary paid on the
push); the store parts are built when the batch is applied (a vector op's also here: its shards
are looked up only then).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Container, Sequence
from typing import Any

import numpy as np

from adamps.core.replication import Batch
from adamps.protocol import ProtocolError
from adamps.server import bounds
from adamps.server.compressed import signs_of_wire
from adamps.server.install import install_of
from adamps.server.repl_wire import gone_with_run, message_from_wire, named_optimizer, store_parts
from adamps.server.shards import StoreError
from adamps.server.store import Store
from adamps.server.vecapply import KINDS

#: most rows k of the activation/error vectors of one push_fc (writepath.MAX_FC_K)
MAX_FC_K = 65_536


def _bad(message: str) -> ProtocolError:
    return ProtocolError("bad_request", f"replicated batch: {message}")


def _str(u: dict[str, Any], name: str) -> str:
    v = u.get(name)
    if not isinstance(v, str):
        raise _bad(f"field {name!r} of a {u.get('k')!r} update must be a string")
    return v


def _f32(u: dict[str, Any], name: str, ndim: int) -> np.ndarray:
    v = u.get(name)
    if not isinstance(v, np.ndarray) or v.dtype != np.float32 or v.ndim != ndim:
        raise ProtocolError(
            "bad_shape", f"replicated batch: field {name!r} must be a {ndim}-D float32 array"
        )
    return v


def check_update(store: Store, u: Any) -> None:
    """Raises ProtocolError (or StoreError for an unknown shard) unless `u` is an update the
    primary could have accepted: a copy applies nothing it would have refused as a push."""
    if not isinstance(u, dict):
        raise _bad("an update must be a map")
    kind = u.get("k")
    if kind == "d":
        st = store.shard(_str(u, "s"))
        d = u.get("d")
        if not isinstance(d, np.ndarray) or d.dtype != np.float32 or d.size != st.shard.size:
            raise ProtocolError(
                "bad_shape",
                f"replicated batch: delta of shard {st.id} must be float32 with "
                f"{st.shard.size} elements",
            )
        bounds.check_dense(st.id, d)
    elif kind == "f":
        t = store.tensor(_str(u, "t"))
        sids = u.get("s")
        if not isinstance(sids, list) or not all(isinstance(s, str) for s in sids):
            raise _bad("field 's' of an fc update must be a list of shard ids")
        if len(t.spec.shape) != 2:
            raise _bad(f"fc update of tensor {t.spec.name!r}, which is not 2-D")
        m, n = t.spec.shape
        a, e = _f32(u, "a", 2), _f32(u, "e", 2)
        k = a.shape[0]
        if a.shape[1] != n or e.shape != (k, m) or not 1 <= k <= MAX_FC_K:
            raise ProtocolError(
                "bad_shape",
                f"replicated batch: fc update needs a (k, {n}) and e (k, {m}), "
                f"1 <= k <= {MAX_FC_K}; got {list(a.shape)} and {list(e.shape)}",
            )
        for sid in sids:
            if store.shard(sid).shard.tensor != t.spec.name:
                raise _bad(f"shard {sid!r} is not a shard of {t.spec.name!r}")
        bounds.check_fc(a, e)
    elif kind == "c":
        st = store.shard(_str(u, "s"))
        signs_of_wire(u, st.shard.size)  # tau (finite, > 0, bounded), words or Rice stream
    elif kind == "r":
        _check_rows(store, u)
    elif kind == "i":  # a checkpoint's shard restored whole (checkpoint_ops.py)
        install_of(u, store.shard(_str(u, "s")))
    elif kind == "j":  # a checkpoint's row shard restored whole
        st = store.tables.shard(_str(u, "s"))
        if not isinstance(u.get("b"), bytes):
            raise _bad("a row install needs bytes 'b'")
        try:
            st.table.new_block().load_bytes(u["b"])
        except Exception as exc:  # struct.error, ValueError: a damaged or foreign record
            raise _bad(f"row install of {st.id}: not a row block: {exc}") from None
    elif kind == "v":
        _check_vec(u)
    else:
        raise _bad(f"unknown update kind {kind!r}")
    if kind in ("d", "f", "c") and "o" in u:  # the hyperparameters its push named (hyper.py)
        tensor = u["t"] if kind == "f" else store.shard(u["s"]).shard.tensor
        named_optimizer(store, u, tensor)


def _check_rows(store: Store, u: dict[str, Any]) -> None:
    """An embedding table's rows of one bucket (tableops.row_update): what push_rows checked."""
    st = store.tables.shard(_str(u, "s"))
    ids, grads, when = u.get("i"), u.get("g"), u.get("t")
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 1 or not len(ids):
        raise ProtocolError(
            "bad_shape", "replicated batch: row ids must be a non-empty int64 array"
        )
    dim = st.table.spec.dim
    if (
        not isinstance(grads, np.ndarray)
        or grads.dtype != np.float32
        or grads.shape
        != (
            len(ids),
            dim,
        )
    ):
        raise ProtocolError(
            "bad_shape",
            f"replicated batch: row grads of {st.id} must be float32 [{len(ids)}, {dim}]",
        )
    bounds.check_dense(st.id, grads)
    if isinstance(when, bool) or not isinstance(when, int | float) or not math.isfinite(when):
        raise _bad("a row update's time 't' must be a finite number")
    if not isinstance(u.get("a", False), bool):
        raise _bad("a row update's 'a' (put_rows: values, not gradients) must be a bool")


def _check_vec(u: dict[str, Any]) -> None:
    op = u.get("o")
    if op not in KINDS:
        raise _bad(f"unknown vector op {op!r}")
    sids = u.get("s")
    if not isinstance(sids, list) or not all(isinstance(s, str) for s in sids):
        raise _bad("field 's' of a vector update must be a list of shard ids")
    _str(u, "y")
    if KINDS[op][0]:
        _str(u, "x")
    a = u.get("a", 0.0)
    if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a):
        raise _bad(f"vector op alpha must be a finite number, got {a!r}")
    if abs(a) > bounds.MAX_LR:
        raise _bad(f"|alpha| must be <= {bounds.MAX_LR:g}, got {a!r}")
    if op == "set":
        v = _f32(u, "v", 1)
        if v.size and bounds.max_abs("v", v) > bounds.MAX_VALUE:
            raise _bad(f"set: values must be at most {bounds.MAX_VALUE:g} in magnitude")
        if isinstance(u.get("f"), bool) or not isinstance(u.get("f"), int):
            raise _bad("set: offset 'f' must be an int")


def check_batches(store: Store, batches: Sequence[Batch]) -> None:
    """Every update of every push of every batch (see check_update), then their store parts
    built as the owner threads will apply them (what the store cannot take raises here, before
    the replica state machine sees the batch). An update naming a deleted run's tensor or table
    that is gone here passes: it is refused alone at apply, as the primary refuses it."""
    for b in batches:
        for push in b.updates:
            if not isinstance(push, tuple | list):
                raise _bad("a push must be a list of updates")
            for u in push:
                try:
                    check_update(store, u)
                except (ProtocolError, StoreError) as exc:
                    # A deleted run's update, in flight: gone here, refused alone when the
                    # batch is applied (repl_wire.store_parts), never the whole batch.
                    if not gone_with_run(store, u, exc):
                        raise
    # Only a vector op's parts can fail where its check passed (vecwire.parts_of looks up its
    # shards); every other kind's check built or looked up all its parts need (issue 36: a
    # secondary built every batch's parts here, dropped them and built them again at commit,
    # decoding a compressed update three times).
    vector_ops = [[u for u in push if u.get("k") == "v"] for b in batches for push in b.updates]
    store_parts(store, [p for p in vector_ops if p])


#: array bytes of a PREPARE from which it is checked on a worker thread: its digest (xxh3 of
#: every byte) and the finite bounds of its arrays (a min and a max pass) held a secondary's
#: event loop 20-100 ms for a 64 MiB batch (issue 39); below, the hop costs more than the work
CHECK_OFF_LOOP = 4 << 20


def _array_bytes(msg: dict[str, Any]) -> int:
    """The bytes of the arrays a PREPARE's batches carry (an estimate: their updates' fields);
    0 for anything malformed (checked on the loop then, and refused there)."""
    total = 0
    try:
        for e in msg.get("entries") or ():
            for push in e.get("updates") or ():
                for u in push:
                    total += sum(v.nbytes for v in u.values() if isinstance(v, np.ndarray))
    except (AttributeError, TypeError):
        return 0
    return total


def _checked(store: Store, buckets: Container[int], op: str, msg: dict[str, Any]) -> Any:
    m = message_from_wire(op, msg)
    if op == "repl_prepare" and m["bucket"] in buckets:
        # Every copy re-checks what it will apply (shapes, finiteness, bounds), whoever sent
        # it: nothing is kept of a batch the primary itself would have refused as a push.
        check_batches(store, m["entries"])
    return m


async def checked_message(
    store: Store, buckets: Container[int], op: str, msg: dict[str, Any]
) -> dict[str, Any]:
    """A peer's replication message decoded (repl_wire.message_from_wire, its batches'
    checksums verified) and, for a PREPARE of a bucket this server holds, every update checked
    (check_batches): on a worker thread when its arrays are large. Only reads the store."""
    if op == "repl_prepare" and _array_bytes(msg) >= CHECK_OFF_LOOP:
        return await asyncio.to_thread(_checked, store, buckets, op, msg)
    return _checked(store, buckets, op, msg)
