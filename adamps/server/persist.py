"""Delayed persistence (Adam 3.3.2): the store is a write-back cache, flushed to LMDB lazily.

Updates never wait for the disk. A background thread takes, every ``flush_interval`` seconds, a
consistent snapshot of every dirty shard (copied on the shard's owner thread, so never torn) and
writes them all in one LMDB transaction: the many updates applied to a shard since the last flush
fold into one write. The age of the oldest update not yet committed is the loss window.

LMDB layout (one Environment per process, five named databases):

- ``tensors``: tensor name -> JSON ``{"spec", "optimizer", "init", "seq"}`` (written at create,
  synchronously, in the same transaction as the initial values of the held shards);
- ``shards``: shard id -> ``<QQQ`` (version, value bytes, accumulator bytes) + value + accumulator;
- ``positions`` (replicated servers): bucket (``%08d``) -> JSON ``[epoch, seq]``: the
  replication position of the bucket's copy, written in the same transaction as the values of
  the same cut (the flush), so a reloaded copy is exactly at (epoch, seq);
- ``prepared``: ``%08d/%020d`` (bucket, seq) -> the protocol's msgpack encoding of a batch the
  copy held prepared (not yet applied) at the cut, written in the same transaction: with
  ``ack = "prepared"`` a push is acknowledged once every member holds its batch prepared, so a
  copy reloaded from disk must still hold what it had prepared when its cut was taken;
- ``dedup``: ``%08d/%020d`` (bucket, seq) -> JSON ``[[client, client_seq, batch_seq], ...]``: the
  exactly-once pairs of the batches applied since the previous flush; the newest
  ``DEDUP_CHUNKS`` chunks of a bucket are kept, so a client's retry of a push is recognized after
  a restart if it comes within that many flushes.

``sync`` stays on (no ``writemap``): a committed flush survives a crash of the process or machine.
MapFullError grows the map (doubling) and retries; ``set_mapsize`` needs no transaction open in this
process, which holds because every transaction goes through ``_lock``.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from adamps import protocol
from adamps.server.shards import Snapshot
from adamps.server.store import Store

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<QQQ")
#: flushes' worth of exactly-once pairs kept per bucket (see the module docstring)
DEDUP_CHUNKS = 64
#: pairs persisted per bucket and flush at most (a flush covers far fewer in practice)
DEDUP_PER_FLUSH = 65_536


@dataclass
class Position:
    """Where a bucket's copy stands: the (epoch, seq) of its last applied batch, and exactly-once
    pairs [client, client_seq, batch_seq] (when writing: those recorded since the last flush)."""

    epoch: int
    seq: int
    dedup: list[list[Any]]
    #: the copy was (re)installed: `dedup` is its whole table and replaces what was persisted
    fresh: bool = False
    #: batches held prepared past `seq` at the cut, in seq order (wire form: batch_to_wire)
    prepared: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class SavedTensor:
    meta: dict[str, Any]
    #: shard id -> (version, values, accumulator or None), float32 1-D arrays
    shards: dict[str, tuple[int, np.ndarray, np.ndarray | None]]


class Persister:
    """The LMDB environment of this process. Thread-safe (one transaction at a time)."""

    def __init__(self, path: str | Path, map_size: int = 1 << 30, sync: bool = True) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self._lock = threading.Lock()
        self.env = lmdb.open(
            self.path,
            map_size=map_size,
            max_dbs=5,
            sync=sync,
            metasync=sync,
            writemap=False,
            readahead=False,
        )
        self._tensors = self.env.open_db(b"tensors")
        self._shards = self.env.open_db(b"shards")
        self._positions = self.env.open_db(b"positions")
        self._dedup = self.env.open_db(b"dedup")
        self._prepared = self.env.open_db(b"prepared")
        #: buckets with prepared batches on disk (None: not read yet)
        self._prepared_on_disk: set[int] | None = None
        #: bucket -> (epoch, seq) last written (positions of buckets not held any more are deleted)
        self._written: dict[int, tuple[int, int]] | None = None
        self.map_grows = 0

    def close(self) -> None:
        with self._lock:
            self.env.close()

    # -- writing ------------------------------------------------------------------------------

    def _write(self, fn: Callable[[lmdb.Transaction], None]) -> None:
        with self._lock:
            while True:
                try:
                    with self.env.begin(write=True) as txn:
                        fn(txn)
                    return
                except lmdb.MapFullError:
                    # The transaction was aborted by the context manager: none is open now.
                    size = self.env.info()["map_size"] * 2
                    log.warning("LMDB map full; growing it to %d MiB", size >> 20)
                    self.env.set_mapsize(size)
                    self.map_grows += 1

    def write_tensor(
        self, meta: dict[str, Any], shards: Iterable[tuple[str, int, np.ndarray, np.ndarray | None]]
    ) -> None:
        """A new tensor's definition and its held shards' initial state, in one transaction."""
        shards = list(shards)

        def fn(txn: lmdb.Transaction) -> None:
            txn.put(meta["spec"]["name"].encode(), json.dumps(meta).encode(), db=self._tensors)
            for sid, version, value, accum in shards:
                txn.put(
                    sid.encode(),
                    _pack(version, value.tobytes(), None if accum is None else accum.tobytes()),
                    db=self._shards,
                )

        self._write(fn)

    def write_snapshots(
        self, snaps: Iterable[Snapshot], positions: dict[int, Position] | None = None
    ) -> int:
        """Many shards in one transaction, with the positions of the same cut (every bucket this
        server holds a copy of; the positions of the others are deleted). Returns the bytes
        written."""
        snaps = list(snaps)
        nbytes = 0
        if positions is not None and self._written is None:
            loaded = self.load_positions()
            self._written = {b: (p.epoch, p.seq) for b, p in loaded.items()}
            self._prepared_on_disk = {b for b, p in loaded.items() if p.prepared}

        def fn(txn: lmdb.Transaction) -> None:
            nonlocal nbytes
            nbytes = 0
            for s in snaps:
                rec = _pack(s.version, s.value, s.accum)
                nbytes += len(rec)
                txn.put(s.shard_id.encode(), rec, db=self._shards)
            if positions is None or self._written is None:
                return
            for b in [b for b in self._written if b not in positions]:
                txn.delete(b"%08d" % b, db=self._positions)
                self._delete_chunks(txn, b, keep=0)
            on_disk = self._prepared_on_disk or set()
            for b in on_disk - {b for b, p in positions.items() if p.prepared}:
                self._delete_prefix(txn, self._prepared, b)
            for b, p in positions.items():
                if p.prepared:
                    # Rewritten whole each cut: few batches (the rounds in flight), and a cut
                    # must hold exactly what the copy held prepared at that instant.
                    self._delete_prefix(txn, self._prepared, b)
                    for batch in p.prepared:
                        rec = protocol.encode(batch)
                        txn.put(b"%08d/%020d" % (b, batch["seq"]), rec, db=self._prepared)
                        nbytes += len(rec)
                if self._written.get(b) == (p.epoch, p.seq) and not p.dedup and not p.fresh:
                    continue
                txn.put(b"%08d" % b, json.dumps([p.epoch, p.seq]).encode(), db=self._positions)
                if p.fresh:
                    self._delete_chunks(txn, b, keep=0)
                if p.dedup:
                    key = b"%08d/%020d" % (b, p.seq)
                    txn.put(key, json.dumps(p.dedup).encode(), db=self._dedup)
                    self._delete_chunks(txn, b, keep=DEDUP_CHUNKS)
                nbytes += 64

        self._write(fn)
        if positions is not None:
            self._written = {b: (p.epoch, p.seq) for b, p in positions.items()}
            self._prepared_on_disk = {b for b, p in positions.items() if p.prepared}
        return nbytes

    def _delete_chunks(self, txn: lmdb.Transaction, b: int, keep: int) -> None:
        self._delete_prefix(txn, self._dedup, b, keep)

    @staticmethod
    def _delete_prefix(txn: lmdb.Transaction, db: Any, b: int, keep: int = 0) -> None:
        """Deletes bucket b's ``%08d/...`` records of `db` but the newest `keep`."""
        prefix = b"%08d/" % b
        cur = txn.cursor(db=db)
        keys = []
        if cur.set_range(prefix):
            for k in cur.iternext(values=False):
                if not bytes(k).startswith(prefix):
                    break
                keys.append(bytes(k))
        for k in keys[: max(0, len(keys) - keep)]:
            txn.delete(k, db=db)

    # -- reading ------------------------------------------------------------------------------

    def load_positions(self) -> dict[int, Position]:
        """The persisted copies: bucket -> position with its exactly-once pairs, oldest first."""
        out: dict[int, Position] = {}
        with self._lock, self.env.begin() as txn:
            for k, v in txn.cursor(db=self._positions):
                epoch, seq = json.loads(bytes(v))
                out[int(bytes(k))] = Position(int(epoch), int(seq), [])
            for k, v in txn.cursor(db=self._dedup):
                b = int(bytes(k).split(b"/")[0])
                if b in out:
                    out[b].dedup.extend(json.loads(bytes(v)))
            for k, v in txn.cursor(db=self._prepared):
                b = int(bytes(k).split(b"/")[0])
                if b in out:
                    out[b].prepared.append(protocol.decode(bytes(v)))
        return out

    def load(self) -> list[SavedTensor]:
        """Every saved tensor in creation order, with the shards saved for it."""
        with self._lock, self.env.begin() as txn:
            metas = [json.loads(v) for _, v in txn.cursor(db=self._tensors)]
            metas.sort(key=lambda m: m["seq"])
            out = {m["spec"]["name"]: SavedTensor(m, {}) for m in metas}
            for k, v in txn.cursor(db=self._shards):
                sid = bytes(k).decode()
                tensor = sid.rpartition("/")[0]
                if tensor in out:
                    out[tensor].shards[sid] = _unpack(bytes(v))
        return list(out.values())


def _pack(version: int, value: bytes, accum: bytes | None) -> bytes:
    accum = accum or b""
    return b"".join((_HEADER.pack(version, len(value), len(accum)), value, accum))


def _unpack(rec: bytes) -> tuple[int, np.ndarray, np.ndarray | None]:
    version, nv, na = _HEADER.unpack_from(rec)
    off = _HEADER.size
    # A copy (bytes -> new array): the values become mutable state of the store.
    value = np.frombuffer(rec, dtype="<f4", count=nv // 4, offset=off).copy()
    accum = np.frombuffer(rec, dtype="<f4", count=na // 4, offset=off + nv).copy() if na else None
    return version, value, accum


class Flusher:
    """The background flush thread, the forced flush, and the loss-window bookkeeping."""

    def __init__(
        self,
        store: Store,
        persister: Persister,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
        on_flush: Callable[[int, int, float], None] | None = None,
    ) -> None:
        #: takes the flush's cut: (dirty shards, positions of the same instant or None). Default:
        #: the dirty shards alone; a replicated server sets one that reads its positions too.
        self.cut: Callable[[], tuple[list[Snapshot], dict[int, Position] | None]] = lambda: (
            self.store.snapshot_dirty(),
            None,
        )
        #: positions taken but not yet committed (a failed write retries them with the shards)
        self._pending_positions: dict[int, Position] | None = None
        self.store = store
        self.persister = persister
        self.interval = interval
        self.clock = clock
        self._on_flush = on_flush
        self._flush_lock = threading.Lock()
        #: snapshots taken but not yet committed (a failed write keeps them for the next round)
        self._pending: dict[str, Snapshot] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: wall-clock time and stats of the last successful flush
        self.last_flush: dict[str, Any] = {"time": None, "shards": 0, "bytes": 0, "seconds": 0.0}
        self.failures = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="adamps-flusher", daemon=True)
        self._thread.start()

    def stop(self, final_flush: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if final_flush:
            self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except Exception:  # logged; the snapshots stay pending and are retried next round
                log.exception("background flush failed")

    def flush(self) -> dict[str, Any]:
        """Writes every dirty shard now (blocking). Returns {shards, bytes, seconds}."""
        with self._flush_lock:
            t0 = self.clock()
            dirty, positions = self.cut()
            if positions is not None:
                old = self._pending_positions
                if old:  # a failed write's pairs are still unwritten: keep them, in order
                    for b, p in positions.items():
                        if b in old and not p.fresh:
                            p.dedup[:0] = old[b].dedup
                            p.fresh = old[b].fresh
                self._pending_positions = positions
            for s in dirty:
                old = self._pending.get(s.shard_id)
                # Keep the oldest dirty time: those updates are still not on disk.
                since = s.dirty_since if old is None else min(old.dirty_since, s.dirty_since)
                self._pending[s.shard_id] = Snapshot(s.shard_id, s.version, s.value, s.accum, since)
            snaps = list(self._pending.values())
            try:
                positions = self._pending_positions
                nbytes = (
                    self.persister.write_snapshots(snaps, positions)
                    if snaps or positions is not None
                    else 0
                )
            except Exception:
                self.failures += 1
                raise
            self._pending.clear()
            self._pending_positions = None
            seconds = self.clock() - t0
            self.last_flush = {
                "time": time.time(),
                "shards": len(snaps),
                "bytes": nbytes,
                "seconds": seconds,
            }
            if self._on_flush is not None:
                self._on_flush(len(snaps), nbytes, seconds)
            return dict(self.last_flush)

    def loss_window(self) -> float:
        """Seconds since the oldest update that is not yet committed to LMDB (0 when clean)."""
        oldest = self.store.oldest_dirty()
        for s in list(self._pending.values()):
            if oldest is None or s.dirty_since < oldest:
                oldest = s.dirty_since
        return 0.0 if oldest is None else max(0.0, self.clock() - oldest)
