"""A bucket's copy as the store holds it, read and written as replication needs it: the
replicated batches applied on the shards' owner threads, the primary's consistent snapshot for a
joining copy (values, accumulators, versions, rows, position and deduplication table), a fetched
snapshot installed, the digests of the copies offered to the controllers, and the digests that show
replicas bit-identical. Store IO only, kept apart from the replication shell
(adamps.server.replication.shell), which decides nothing either: it carries out what the core
(adamps.core.replication.node) asks and calls these."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from adamps import runs
from adamps.core.replication.values import Batch
from adamps.server.decode import deleted_run_of, gone_with_run, update_parts
from adamps.server.store import checksum
from adamps.server.store.shards import StoreError
from adamps.server.store.store import Store
from adamps.server.store.tickets import owner_future
from adamps.wire.protocol import ProtocolError

if TYPE_CHECKING:
    from adamps.server.storage.catalog import TensorCatalog

log = logging.getLogger("adamps.server.replication.shell")


def apply_batches(store: Store, batches: Iterable[Batch]) -> None:
    """Enqueues the batches, each as one group per shard, in order, so that every copy applies
    the same groups and the copies end bit-identical. Raises nothing: it runs inside the shell's
    drain, whose other actions (answers, messages) must all be carried out, so an update that
    cannot be applied is refused alone (issue 39). Nothing comes back to the event loop (a
    failure is logged by the owner thread): issue 36's profile of an RF 3 push_rows run had a
    future, a cross-thread wakeup of the loop and a gather per committed batch on every copy,
    for a result no one awaited. Work queued to the same owner threads later (a read, a flush's
    copy) runs after it."""
    for batch in batches:
        store.push_group(
            _committed_parts(store, batch), functools.partial(_log_apply_error, batch.seq)
        )


def _committed_parts(store: Store, batch: Batch) -> list[Any]:
    """A committed batch's store parts, update by update: one that names a deleted run's tensor
    or table (gone since the round began) is skipped; anything else unknown here is a bug,
    logged, and skipped too rather than stopping the bucket's rounds."""
    parts: list[Any] = []
    for push in batch.updates:
        for u in push:
            try:
                parts += update_parts(store, u)
            except (StoreError, ProtocolError) as exc:
                if gone_with_run(store, u, exc):
                    log.info("batch %d: an update of deleted run %r refused: %s",
                             batch.seq, deleted_run_of(store, u), exc)  # fmt: skip
                else:
                    log.error("batch %d: an update cannot be applied here: %r", batch.seq, exc)
    return parts


def _log_apply_error(seq: int, _versions: object, error: BaseException | None) -> None:
    """Owner thread: a committed batch's groups are applied (or failed)."""
    if error is not None:
        log.error("applying committed batch %d failed: %r", seq, error)


def _bucket_shards(store: Store, b: int) -> list[Any]:
    """Bucket b's shards held here, in id order (the order digests are taken in)."""
    bucket_of = store.layout.bucket_of
    return sorted((st for st in store.shards.values() if bucket_of[st.id] == b), key=lambda s: s.id)


def _buffers(states: list[Any]) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
    """Empty value and accumulator buffers for a read of `states`."""
    outs = [np.empty(st.shard.shape, np.float32) for st in states]
    accs = [np.empty(st.accum.shape, np.float32) if st.accum is not None else None for st in states]
    return outs, accs


def shard_digest(value: np.ndarray, accum: np.ndarray | None) -> int:
    """xxh3 of a shard's values and accumulator as a snapshot carries them."""
    parts = [memoryview(np.ascontiguousarray(value)).cast("B")]
    if accum is not None:
        parts.append(memoryview(np.ascontiguousarray(accum)).cast("B"))
    return checksum.digest(*parts)


async def read_snapshot(
    store: Store, catalog: TensorCatalog, b: int, meta: dict[str, Any]
) -> dict[str, Any]:
    """The primary's snapshot of bucket b at the position `meta` (epoch, committed, dedup) the
    core gave in this same loop step: the reads are queued before any await, so the values are
    exactly those of that position."""
    states = _bucket_shards(store, b)
    outs, accs = _buffers(states)
    read = owner_future(lambda cb: store.read(states, outs, cb, accums=accs))
    # Queued in the same loop step as the shards' reads: the rows are of the same position.
    rows = store.tables.in_bucket(b)
    row_states = await owner_future(
        lambda cb: store.call(rows, lambda st: (st.version, st.value.tobytes()), cb)
    )
    versions = await read
    xs = await _hashed(
        lambda: [shard_digest(o, a) for o, a in zip(outs, accs, strict=True)], _nbytes(outs, accs)
    )
    tensors = {st.shard.tensor for st in states}
    return {
        "bucket": b,
        **meta,
        "tensors": [catalog.definition(name) for name in sorted(tensors)],
        "tables": [st.table.spec.to_dict() for st in rows],
        "rows": {sid: {"version": v, "state": data} for sid, (v, data) in row_states.items()},
        "shards": {
            st.id: {
                "value": out,
                "accum": acc,
                "version": versions[st.id],
                "x": x,
            }
            for st, out, acc, x in zip(states, outs, accs, xs, strict=True)
        },
    }


#: bytes of shards from which a snapshot's checksums are computed on a worker thread (xxh3 of
#: a bucket of 1 GiB: a tenth of a second or more, on the event loop of both copies, issue 39)
HASH_OFF_LOOP = 4 << 20
#: the key `verified` sets in a fetched snapshot: the first shard failing its checksum, or None
_CHECKED = "_corrupt_shard"
_UNCHECKED = object()


def _nbytes(values: Iterable[Any], accums: Iterable[Any]) -> int:
    return sum(int(getattr(v, "nbytes", 0)) for v in [*values, *accums] if v is not None)


async def _hashed(fn: Any, nbytes: int) -> Any:
    return await asyncio.to_thread(fn) if nbytes >= HASH_OFF_LOOP else fn()


def _first_corrupt(snap: dict[str, Any]) -> str | None:
    for sid, rec in snap["shards"].items():
        want = rec.get("x")  # every shard of a snapshot carries its digest
        if not isinstance(want, int) or shard_digest(rec["value"], rec.get("accum")) != want:
            return str(sid)
    return None


async def verified(
    snap: dict[str, Any] | None, store: Store, catalog: TensorCatalog
) -> dict[str, Any] | None:
    """A fetched snapshot with its shards' checksums checked (on a worker thread when large):
    `install` refuses it then without hashing it again on the event loop. Its tensors are
    defined here (their values allocated and written on a worker thread). A snapshot this
    cannot read is left for `install`'s own checks."""
    if snap is None:
        return None
    try:
        for d in snap["tensors"]:
            if runs.run_of(str(d.get("name"))) not in store.deleted_runs:
                await catalog.ensure_off_loop(d)
    except Exception:  # malformed, or a definition that differs: install's checks name it
        pass
    try:
        recs = list(snap["shards"].values())
        size = _nbytes([r.get("value") for r in recs], [r.get("accum") for r in recs])
        snap[_CHECKED] = await _hashed(lambda: _first_corrupt(snap), size)
    except Exception:  # malformed: install's check names it
        snap.pop(_CHECKED, None)
    return snap


def install(
    store: Store, catalog: TensorCatalog, b: int, snap: dict[str, Any], on_corrupt: Any
) -> list[asyncio.Future]:
    """Queues a snapshot's values to the owner threads (after checking every shard's checksum,
    unless `verified` did: ValueError, nothing installed, if one fails). The caller moves the
    copy's position in the same loop step, then awaits the futures."""
    bad = snap.pop(_CHECKED, _UNCHECKED)
    if bad is _UNCHECKED:
        bad = _first_corrupt(snap)  # before anything changes here
    if bad is not None:
        on_corrupt("transfer")
        raise ValueError(f"shard {bad} of the snapshot of bucket {b} fails its checksum")
    # What a deleted run left on a primary that has not learned of the deletion yet is not
    # created again here (its updates in flight are refused alone: decode.store_parts).
    dead = store.deleted_runs
    for d in snap["tensors"]:
        if runs.run_of(str(d.get("name"))) not in dead:
            catalog.ensure(d)
    for d in snap.get("tables", []):
        if runs.run_of(str(d.get("name"))) not in dead:
            catalog.tables.ensure(d)
    rows = {sid: store.tables.shard(sid) for sid in snap.get("rows", {}) if _live(sid, dead)}

    def put_rows(st: Any) -> int:
        rec = snap["rows"][st.id]
        st.value.load_bytes(rec["state"])
        return int(rec["version"])

    rows_done = owner_future(lambda cb: store.replace(list(rows.values()), put_rows, cb))
    states, values, accums, versions = [], [], [], []
    for sid, rec in snap["shards"].items():
        if not _live(sid, dead):
            continue
        st = store.shard(sid)
        states.append(st)
        values.append(rec["value"])
        accums.append(rec.get("accum"))
        versions.append(int(rec["version"]))
    done = owner_future(lambda cb: store.overwrite(states, values, accums, versions, cb))
    return [done, rows_done]


def _live(sid: str, dead: frozenset[str]) -> bool:
    return runs.run_of(sid) not in dead


async def offers(
    store: Store, copies: dict[int, list[int]], committed: dict[int, int]
) -> dict[int, list[Any]]:
    """The copies this server offers the controllers, each [epoch, seq, committed, digest]:
    the digest (xxh3 of every shard's values and accumulator, in shard order) of the copy
    at its committed seq, which the controllers compare between candidates that tie on
    (epoch, seq) (issue 29). Positions are read and the reads queued in one loop step, so
    each digest is of exactly the committed values."""
    plan: list[tuple[int, int, list[Any], list[np.ndarray], list[Any]]] = []
    states_all, outs_all, accs_all = [], [], []
    for b in copies:
        states = _bucket_shards(store, b)
        outs, accs = _buffers(states)
        plan.append((b, committed[b], states, outs, accs))
        states_all += states
        outs_all += outs
        accs_all += accs
    if states_all:
        await owner_future(lambda cb: store.read(states_all, outs_all, cb, accums=accs_all))

    def digests() -> dict[int, list[Any]]:
        out: dict[int, list[Any]] = {}
        for b, committed, states, outs, accs in plan:
            parts: list[bytes | memoryview] = []
            for st, value, acc in zip(states, outs, accs, strict=True):
                parts += [st.id.encode(), memoryview(value).cast("B")]
                if acc is not None:
                    parts.append(memoryview(acc).cast("B"))
            out[b] = [*copies[b], committed, f"{checksum.digest(*parts):016x}"]
        return out

    return await _hashed(digests, _nbytes(outs_all, accs_all))


async def digest(store: Store, b: int) -> str:
    """sha256 of bucket b's shards and rows on this server, in id order (replicas compare it)."""
    states = _bucket_shards(store, b)
    outs, _accs = _buffers(states)
    await owner_future(lambda cb: store.read(states, outs, cb))
    rows = sorted(store.tables.in_bucket(b), key=lambda s: s.id)
    row_digests = await owner_future(lambda cb: store.call(rows, lambda st: st.value.digest(), cb))
    h = hashlib.sha256()
    for st, out in zip(states, outs, strict=True):
        h.update(st.id.encode())
        h.update(out.tobytes())
    for st in rows:  # an embedding table's rows of this bucket
        h.update(st.id.encode())
        h.update(row_digests[st.id])
    return h.hexdigest()
