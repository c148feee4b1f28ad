"""What replication sends between servers: the ops peers use on ``/rpc``, updates in their
compact form (a dense delta of one shard, activation and error vectors, a compressed update),
batches of a round, a ``repl_multi`` request's results (one per message), the ``not_primary``
answer and a push's outcome. The updates themselves are built and decoded by
adamps/server/decode/ (one decoder per update kind); here they are opaque maps."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from adamps.core.replication.bucket import Assignment, Batch, BucketReplica, Reject
from adamps.core.replication.ready import Answer
from adamps.server.decode import Checked
from adamps.server.store import checksum
from adamps.server.store.shards import StoreError
from adamps.wire.protocol import ENVELOPE, ProtocolError, only_fields, require

#: replication ops served on /rpc (peer traffic: cluster token required like every mutating call)
REPL_OPS = ("repl_prepare", "repl_commit", "repl_ping", "repl_multi", "repl_snapshot", "digest")
#: the ops that may travel inside a repl_multi message
MULTI_OPS = ("repl_prepare", "repl_commit", "repl_ping")
#: the fields of each replication op (beside the envelope's), and of a PREPARE's batches: a
#: peer's message is held to them like a client's (docs/protocol-ps.md, "Unknown fields are
#: refused"). A repl_multi frame's meta is its message, with the frame MAC's `peer` and `mac`.
REPL_FIELDS: dict[str, frozenset[str]] = {
    "repl_prepare": frozenset({"bucket", "sender", "epoch", "entries", "commit"}),
    "repl_commit": frozenset({"bucket", "sender", "epoch", "seq"}),
    "repl_ping": frozenset({"sender", "buckets"}),
    "repl_multi": frozenset({"items", "peer", "mac"}),
    "repl_snapshot": frozenset({"bucket", "joiner", "join"}),
    "digest": frozenset({"bucket"}),
}
BATCH_FIELDS = frozenset({"seq", "epoch", "updates", "clients", "x"})


def check_repl_fields(op: str, msg: dict[str, Any]) -> None:
    """Refuses a replication message naming a field its op does not take (400 bad_request
    naming it): each op's handler calls it first, on /rpc and in a repl_multi alike."""
    only_fields(msg, f"op {op!r}", REPL_FIELDS[op] | ENVELOPE, op=op)


async def multi_results(
    msg: dict[str, Any],
    check: Callable[[dict[str, Any]], Awaitable[Any]],
    step: Callable[[Any], dict[str, Any]],
    batch: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> dict[str, Any]:
    """A repl_multi request: its messages (each an op of MULTI_OPS) checked in order by `check`
    (it may await: a large PREPARE is decoded on a worker thread), then those that passed
    stepped in order by `step`, all inside one `batch` that never awaits (their Ready carried
    out once: Carrier.batch, issue 36); one result each ({"ok": reply} or {"error": ...}), so
    that one refused or failing message fails alone."""
    check_repl_fields("repl_multi", msg)
    items = require(msg, "items", list)
    results: list[dict[str, Any] | None] = [None] * len(items)
    checked: list[tuple[int, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or item.get("op") not in MULTI_OPS:
            op = item.get("op") if isinstance(item, dict) else None
            err = {"code": "unknown_op", "message": f"{op!r} not allowed in repl_multi"}
            results[i] = {"error": err}
            continue
        try:
            checked.append((i, await check(item)))
        except (ProtocolError, StoreError) as exc:
            results[i] = _error(exc)
    with batch():
        for i, m in checked:
            try:
                results[i] = {"ok": step(m)}
            except (ProtocolError, StoreError) as exc:
                results[i] = _error(exc)
    return {"results": results}


def _error(exc: ProtocolError | StoreError) -> dict[str, Any]:
    """A message's failure as its result (a StoreError, e.g. a tensor not defined here: this
    message fails only)."""
    if isinstance(exc, StoreError):
        exc = ProtocolError(exc.code, exc.message)
    return {"error": exc.to_dict()}


def not_primary(
    rep: BucketReplica | None,
    bucket: int,
    addresses: dict[str, str],
    why: str,
    code: str = "not_primary",
) -> ProtocolError:
    a = rep.assignment if rep is not None else Assignment(0, None)
    return ProtocolError(
        code,
        f"bucket {bucket}: {why}",
        bucket=bucket,
        epoch=a.epoch,
        primary=addresses.get(a.primary or "", None),
    )


def refusal(
    rej: Reject, rep: BucketReplica | None, bucket: int, addresses: dict[str, str]
) -> ProtocolError:
    """A refusal of the replication core as the protocol error a client or peer gets."""
    if rej.code == "not_primary":
        return not_primary(rep, bucket, addresses, rej.message)
    if rej.code == "bucket_unavailable":
        return ProtocolError(rej.code, rej.message, bucket=bucket)
    epoch = rej.epoch or (rep.assignment.epoch if rep is not None else 0)
    return ProtocolError(rej.code, rej.message, bucket=bucket, epoch=epoch)


def settle(ans: Answer, rep: BucketReplica | None, addresses: dict[str, str]) -> None:
    """A push's outcome to its waiter (a future): acknowledged, or unknown, as a retryable
    primary_changed (its round may still commit on another copy: never "not applied")."""
    fut = ans.waiter
    if not isinstance(fut, asyncio.Future) or fut.done():
        return
    if ans.outcome == "ok":
        fut.set_result(None)
    else:
        fut.set_exception(not_primary(rep, ans.bucket, addresses, ans.why, "primary_changed"))


#: str(dtype).encode() by dtype: numpy's dtype.__str__ is Python code, and took a third of the
#: digest's time over a 256 KiB delta (issue 27's profile of an RF 3 push)
_DTYPE_NAMES: dict[np.dtype, bytes] = {}


def _dtype_name(dtype: np.dtype) -> bytes:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).encode()
    return name


#: the map type of a primary's decoded updates (a dict subclass): walked as a plain map, not
#: through ``_walk_other`` (the same bytes; issue 36: every field of a primary's batch took the
#: slow path, a call and an isinstance chain each)
_CHECKED: type = Checked


def updates_digest(updates: Iterable[Any]) -> int:
    """xxh3 of a batch's updates: every field, arrays by their bytes, in order (issue 29:
    corruption in memory or on the wire is caught where it enters a copy, not applied).

    The bytes hashed, in order: a map's keys sorted (as ``str``), each key's text then its
    value; a list's items; an array's dtype name then its bytes; bytes as they are; a scalar's
    ``repr``. The small pieces are gathered into one buffer and hashed with the arrays' memory
    as they come (xxh3 of a concatenation does not depend on how it is cut): issue 36's profile
    of the convnet at RF 3 found this walk, one hash update per field, the largest own time of
    a secondary's PREPARE path."""
    h = checksum.hasher()
    buf = bytearray()

    def walk(x: Any) -> None:
        nonlocal buf
        t = type(x)
        if t is dict or t is _CHECKED:
            keys = sorted(x, key=str)  # a hostile map may mix key types
            for k in keys:
                buf += k.encode() if type(k) is str else str(k).encode()
                v = x[k]
                tv = type(v)
                if tv is str or tv is int or tv is float:  # most fields: no call
                    buf += repr(v).encode()
                elif tv is np.ndarray:  # an update's arrays: no call either
                    buf += _dtype_name(v.dtype)
                    if v.size:
                        h.update(buf)
                        buf.clear()
                        h.update(memoryview(np.ascontiguousarray(v)).cast("B"))
                else:
                    walk(v)
        elif t is np.ndarray:
            buf += _dtype_name(x.dtype)
            if x.size:  # an empty array has no bytes (and numpy's (0, n) view cannot be cast:
                # a PREPARE holding one raised TypeError, a 500, before its checks refused it)
                h.update(buf)
                buf.clear()
                h.update(memoryview(np.ascontiguousarray(x)).cast("B"))
        elif t is list or t is tuple:
            for v in x:
                walk(v)
        elif t is str or t is int or t is float or t is bool or x is None:
            buf += repr(x).encode()
        else:
            _walk_other(x, walk, h, buf)

    walk(updates)
    h.update(buf)
    return h.intdigest()


def _walk_other(x: Any, walk: Callable[[Any], None], h: Any, buf: bytearray) -> None:
    """updates_digest's subclasses and other types: the same bytes as their exact types'."""
    if isinstance(x, np.ndarray):
        buf += _dtype_name(x.dtype)
        if x.size:
            h.update(buf)
            buf.clear()
            h.update(memoryview(np.ascontiguousarray(x)).cast("B"))
    elif isinstance(x, dict):
        for k in sorted(x, key=str):
            buf += str(k).encode()
            walk(x[k])
    elif isinstance(x, list | tuple):
        for v in x:
            walk(v)
    elif isinstance(x, bytes | bytearray | memoryview):
        buf += x
    else:  # a scalar: numpy's decode to Python's on the wire, so compare those
        buf += repr(x.item() if isinstance(x, np.generic) else x).encode()


#: the wire form of every batch sent, received or persisted, by id, for as long as the batch
#: lives (a finalizer drops it with the batch, so an id is never reused meanwhile). A batch is
#: digested once: its PREPARE to every secondary, its resends and every flush cut that persists
#: it while prepared (repl_persist.positions) reuse that digest. Issue 36's profile of an RF 3
#: push_rows run: a cache of the last 64 batches was thrashed by the flush cut, which persists a
#: prepared batch of each of the 64 buckets, and the digest was recomputed on every send and
#: every cut (a tenth of a server's event loop); a secondary re-digested what it had just verified.
_WIRE: dict[int, dict[str, Any]] = {}


def _keep(b: Batch, wire: dict[str, Any]) -> None:
    _WIRE[id(b)] = wire
    weakref.finalize(b, _WIRE.pop, id(b), None)


def batch_to_wire(b: Batch) -> dict[str, Any]:
    """The wire form of a batch (shared: not to be changed by the caller). Its digest is
    computed once, when the batch is first sent (or verified when it was received): a batch
    changed in memory afterwards is then caught by the copies it is sent to next, not sent with
    a new digest of the damage."""
    wire = _WIRE.get(id(b))
    if wire is not None:
        return wire
    wire = {
        "seq": b.seq,
        "epoch": b.epoch,
        "updates": list(b.updates),
        "clients": [None if c is None else [c[0], c[1]] for c in b.clients],
        "x": updates_digest(b.updates),
    }
    _keep(b, wire)
    return wire


def batch_from_wire(d: dict[str, Any], decode: Callable[[Any], Any] | None = None) -> Batch:
    """A batch received or read back, its digest verified; with `decode`, each of its updates
    replaced by what `decode` makes of it (a copy's decoded updates, adamps/server/decode/),
    after the digest: the wire form kept for resends and flushes is the one received."""
    seq = require(d, "seq", int)
    epoch = require(d, "epoch", int)
    updates = require(d, "updates", list)
    clients = require(d, "clients", list)
    if len(clients) != len(updates):
        raise ProtocolError("bad_request", "batch clients and updates differ in length")
    keys = tuple(_client_key(c) for c in clients)
    for u in updates:
        if not isinstance(u, list | tuple):
            raise ProtocolError("bad_request", "a batch's updates must be lists of updates")
    want = require(d, "x", int)  # the updates' digest: every batch carries one
    if updates_digest(updates) != want:
        raise ProtocolError(
            "bad_request",
            f"batch {seq} of epoch {epoch} fails its checksum: damaged in memory or on the wire",
        )
    pushes = updates if decode is None else [[decode(u) for u in push] for push in updates]
    batch = Batch(seq, epoch, tuple(tuple(u) for u in pushes), keys)
    # verified: its wire form when this copy sends or persists it
    _keep(batch, {"seq": seq, "epoch": epoch, "updates": updates, "clients": clients, "x": want})
    return batch


def message_from_wire(
    op: str, msg: dict[str, Any], decode: Callable[[int], Callable[[Any], Any] | None] | None = None
) -> dict[str, Any]:
    """A peer's repl_prepare, repl_commit or repl_ping as the replication core steps it: every
    field checked (ProtocolError bad_request), a PREPARE's batches decoded (`decode(bucket)`:
    the decoder of that bucket's updates, or None to keep them as maps)."""
    check_repl_fields(op, msg)
    if op == "repl_ping":
        sender = require(msg, "sender", str)
        pinged = require(msg, "buckets", dict)
        for key, epoch in pinged.items():
            if (
                not isinstance(key, str)
                or not (key.isascii() and key.isdigit())
                or type(epoch) is not int
            ):
                raise ProtocolError("bad_request", "field 'buckets' must map bucket ids to epochs")
        return {"op": op, "sender": sender, "buckets": {int(k): e for k, e in pinged.items()}}
    b = require(msg, "bucket", int)
    if op == "repl_commit":
        return {"op": op, "bucket": b, "sender": require(msg, "sender", str),
                "epoch": require(msg, "epoch", int), "seq": require(msg, "seq", int)}  # fmt: skip
    raw = require(msg, "entries", list)
    if not all(isinstance(e, dict) for e in raw):
        raise ProtocolError("bad_request", "field 'entries' must be a list of batches")
    for e in raw:  # a peer's batches (not those read back from this server's own disk)
        only_fields(e, "op 'repl_prepare': a batch of 'entries'", BATCH_FIELDS, op=op)
    dec = None if decode is None else decode(b)
    entries = [batch_from_wire(e, dec) for e in raw]
    sender, epoch = require(msg, "sender", str), require(msg, "epoch", int)
    commit = require(msg, "commit", int, default=0)
    return {"op": op, "bucket": b, "sender": sender, "epoch": epoch, "entries": entries,
            "commit": commit}  # fmt: skip


def _client_key(c: Any) -> tuple[str, int] | None:
    """A batch's (client id, seq) of one push, or None; ProtocolError if malformed (a peer's
    message is checked like a client's: issue 28 answered a malformed one with a 500)."""
    if c is None:
        return None
    if (
        not isinstance(c, list | tuple)
        or len(c) != 2
        or not isinstance(c[0], str)
        or isinstance(c[1], bool)
        or not isinstance(c[1], int)
    ):
        raise ProtocolError("bad_request", "a batch's clients must be null or [client id, seq]")
    return (c[0], c[1])
