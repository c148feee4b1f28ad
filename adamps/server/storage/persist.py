"""Delayed persistence (Adam 3.3.2): the store is a write-back cache, flushed to LMDB lazily.

Updates never wait for the disk. A background thread takes, every ``flush_interval`` seconds, a
consistent snapshot of every dirty shard (copied on the shard's owner thread, so never torn,
straight into its sealed record: ``shardrecord``) and writes them in chunks of whole buckets, one
LMDB transaction each (``Flusher``): the many updates applied to a shard since the last flush
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
- ``rowpages``: ``<row shard id>/<page, 4 bytes big-endian>`` -> a page of an embedding table's
  rows (ids, values, optimizer state: ``adamps.server.store.tables.rowdelta``), written by the flush that
  follows a push to one of its rows, in the same transaction as its row shard's record in
  ``shards`` (the block's header) and its bucket's position: a flush writes the pages touched
  since the previous one, not the bucket's whole row block (``adamps.server.store.tables.rowpages``);
- ``dedup``: ``%08d/%020d`` (bucket, seq) -> JSON ``[[client, client_seq, batch_seq], ...]``: the
  exactly-once pairs of the batches applied since the previous flush; the newest
  ``DEDUP_CHUNKS`` chunks of a bucket are kept, so a client's retry of a push is recognized after
  a restart if it comes within that many flushes.

Every record is sealed with a checksum (``adamps.server.store.checksum``) in the transaction that writes
it, and verified wherever it is read: at start (``verify``, before a copy is offered), by the
background scrub, and by ``load``. A database ``meta`` holds the format stamp (``format`` ->
``3``), written when the environment is created. An environment that holds records but no stamp,
or a stamp of another format (``2``, one record per row, was never released), was not written by
this version and is refused with a message naming its stamp: no format is migrated.

``sync`` stays on (no ``writemap``): a committed flush survives a crash of the process or machine.
MapFullError grows the map (doubling) and retries; ``set_mapsize`` needs no transaction open in this
process, which holds because every transaction goes through ``_lock``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
from collections.abc import Callable, Collection, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from adamps.config import ConfigError
from adamps.layout import stable_bucket
from adamps.server.storage import memtrim
from adamps.server.storage.flush_times import OwnedLock
from adamps.server.store import shardrecord
from adamps.server.store.checksum import CorruptRecord, seal, unseal
from adamps.server.store.shardrecord import HEADER
from adamps.server.store.shards import Snapshot
from adamps.server.store.tables import rowpages
from adamps.server.store.tables.rowdelta import sid_of_key
from adamps.tables import parse_row_shard_id
from adamps.wire import protocol

log = logging.getLogger(__name__)

#: flushes' worth of exactly-once pairs kept per bucket (see the module docstring)
DEDUP_CHUNKS = 64
#: pairs persisted per bucket and flush at most (a flush covers far fewer in practice)
DEDUP_PER_FLUSH = 65_536
#: the on-disk format this version writes (records sealed with checksums)
FORMAT = b"3"
#: the named databases whose records are sealed
_SEALED_DBS = ("tensors", "shards", "positions", "dedup", "prepared", "rowpages")


@dataclass
class Corruption:
    """What ``Persister.verify`` found: records whose checksum failed."""

    #: bucket -> why its copy cannot be trusted (first failing record)
    buckets: dict[int, str] = field(default_factory=dict)
    #: set when a record no bucket can be told from failed (a tensor definition): every copy
    #: of this server is then untrusted
    everything: str | None = None
    #: records checked
    records: int = 0

    def bad(self, b: int) -> bool:
        return self.everything is not None or b in self.buckets


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
    #: an embedding table's row shard id -> its row records (rowpages.SavedRows)
    rows: dict[str, rowpages.SavedRows] = field(default_factory=dict)


class Persister:
    """The LMDB environment of this process. Thread-safe (one transaction at a time)."""

    def __init__(
        self,
        path: str | Path,
        map_size: int = 1 << 30,
        sync: bool = True,
        on_corrupt: Callable[[str], None] | None = None,
    ) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        #: every transaction of this process (see above), with who holds it
        self._lock = OwnedLock()
        #: around the flush's wait for `_lock` (the Flusher's account of whom it waited for)
        self.waiting_for: Callable[[OwnedLock], AbstractContextManager[None]] = lambda lock: (
            contextlib.nullcontext()
        )
        self.env = lmdb.open(
            self.path,
            map_size=map_size,
            max_dbs=8,
            sync=sync,
            metasync=sync,
            writemap=False,
            readahead=False,
            # No lock file: every transaction of this process goes through `_lock`, and no
            # other process opens the environment. LMDB's lock file is a shared writable map;
            # on a stalled (frozen) file system its first write page-faults and blocks in
            # mdb_txn_begin, which py-lmdb calls holding the GIL: the whole server would hang,
            # /healthz included (issue 29). Without it, only the commit waits for the disk,
            # and py-lmdb releases the GIL there.
            lock=False,
        )
        self._tensors = self.env.open_db(b"tensors")
        self._shards = self.env.open_db(b"shards")
        self._positions = self.env.open_db(b"positions")
        self._dedup = self.env.open_db(b"dedup")
        self._prepared = self.env.open_db(b"prepared")
        self._meta = self.env.open_db(b"meta")
        self._rowpages = self.env.open_db(b"rowpages")
        #: called with where ("load", "scrub") for every record that fails its checksum
        self.on_corrupt = on_corrupt or (lambda where: None)
        #: records that failed their checksum, by where they were found
        self.corrupt_records: dict[str, int] = {}
        self._stamp_or_refuse()
        #: buckets with prepared batches on disk (None: not read yet)
        self._prepared_on_disk: set[int] | None = None
        #: bucket -> (epoch, seq) last written (positions of buckets not held any more are deleted)
        self._written: dict[int, tuple[int, int]] | None = None
        self.map_grows = 0
        #: tensors deleted (a deleted run's): a snapshot of their shards cut before is not written
        self._forgotten: set[str] = set()

    def close(self) -> None:
        with self._lock:
            self.env.close()

    def drop_file_view(self) -> bool:
        """Unmaps the file pages reads touched (memtrim.drop_file_view: LMDB's map is read-only
        here, no ``writemap``); they stay in the page cache."""
        with self._lock:
            return memtrim.drop_file_view(str(Path(self.path, "data.mdb").resolve()))

    # -- writing ------------------------------------------------------------------------------

    def _write(self, fn: Callable[[lmdb.Transaction], None]) -> None:
        with self.waiting_for(self._lock):
            self._lock.acquire()
        try:
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
        finally:
            self._lock.release()

    def write_tensor(
        self,
        meta: dict[str, Any],
        shards: Iterable[tuple[str, int, np.ndarray, np.ndarray | None]],
        only_new: bool = False,
    ) -> bool:
        """A new tensor's definition and its held shards' initial state, in one transaction.
        `only_new` (a create written off the event loop): nothing is written if a definition
        of that name exists already (a peer's, written meanwhile, then transferred state and
        flushed: this older initial state must not overwrite it). Returns whether it wrote."""
        return self.write_tensors([(meta, shards)], only_new)[0]

    def write_tensors(
        self,
        tensors: Iterable[tuple[dict[str, Any], Iterable[tuple[str, int, np.ndarray, Any]]]],
        only_new: bool = False,
    ) -> list[bool]:
        """`write_tensor` of several tensors in one transaction (one synced commit: a
        restore's ``create_tensors``, issue 38 item 7); per tensor whether it was written."""
        tensors = [(meta, list(shards)) for meta, shards in tensors]
        wrote = [True] * len(tensors)

        def fn(txn: lmdb.Transaction) -> None:
            for i, (meta, shards) in enumerate(tensors):
                key = meta["spec"]["name"].encode()
                wrote[i] = not (only_new and txn.get(key, db=self._tensors) is not None)
                if not wrote[i]:
                    continue
                txn.put(key, seal(json.dumps(meta).encode()), db=self._tensors)
                for sid, version, value, accum in shards:
                    txn.put(sid.encode(), shardrecord.pack(version, value, accum), db=self._shards)

        for meta, _shards in tensors:
            self._forgotten.discard(meta["spec"]["name"])
        self._write(fn)
        memtrim.trim()  # the records and LMDB's dirty pages of a big tensor are free now
        return wrote

    def writes_nothing(
        self, snaps: Collection[Snapshot], positions: dict[int, Position] | None, held: Any = None
    ) -> bool:
        """Whether ``write_snapshots(snaps, positions, held)`` would change nothing on disk (no
        shard; every position as last written, no exactly-once pairs, nothing prepared, no copy
        to forget): an idle server's flush, every second, then opens no transaction (issue 36)."""
        if snaps or positions is None:
            return not snaps
        written = self._written
        if written is None or self._prepared_on_disk:
            return False  # the first write reads what is on disk
        keep = set(positions) if held is None else set(held)
        if any(b not in keep for b in written):
            return False
        return all(
            written.get(b) == (p.epoch, p.seq) and not (p.dedup or p.fresh or p.prepared)
            for b, p in positions.items()
        )

    def positions_on_disk(self) -> dict[int, tuple[int, int]] | None:
        """Bucket -> (epoch, seq) last written (None: unknown, or prepared batches on disk)."""
        return None if self._written is None or self._prepared_on_disk else self._written

    def write_snapshots(
        self,
        snaps: Iterable[Snapshot],
        positions: dict[int, Position] | None = None,
        held: Collection[int] | None = None,
    ) -> int:
        """Shards in one transaction (a flush chunk: whole buckets), with the positions of the
        same cut of those buckets. `held` is every bucket this server holds a copy of (None:
        those of `positions`, a whole cut): the positions of the others are deleted. Returns the
        bytes written."""
        snaps = list(snaps)
        if self._forgotten:
            snaps = [s for s in snaps if s.shard_id.rpartition("/")[0] not in self._forgotten]
        nbytes = 0
        if positions is not None and self._written is None:
            loaded = self.load_positions()
            self._written = {b: (p.epoch, p.seq) for b, p in loaded.items()}
            self._prepared_on_disk = {b for b, p in loaded.items() if p.prepared}
        keep = set(positions or ()) if held is None else set(held)

        def fn(txn: lmdb.Transaction) -> None:
            nonlocal nbytes
            nbytes = 0
            for s in snaps:
                # The record as the owner thread packed it: LMDB copies it into its page once.
                txn.put(s.shard_id.encode(), s.record, db=self._shards)
                nbytes += len(s.record)
                if s.rows is not None:
                    nbytes += rowpages.write(txn, self._rowpages, s.shard_id, s.rows)
            if positions is None or self._written is None:
                return
            for b in [b for b in self._written if b not in keep]:
                txn.delete(b"%08d" % b, db=self._positions)
                self._delete_chunks(txn, b, keep=0)
            for b in self._prepared_on_disk or set():
                if b not in keep or (b in positions and not positions[b].prepared):
                    self._delete_prefix(txn, self._prepared, b)
            for b, p in positions.items():
                if p.prepared:
                    # Rewritten whole each cut: few batches (the rounds in flight), and a cut
                    # must hold exactly what the copy held prepared at that instant.
                    self._delete_prefix(txn, self._prepared, b)
                    for batch in p.prepared:
                        rec = seal(protocol.encode(batch))
                        txn.put(b"%08d/%020d" % (b, batch["seq"]), rec, db=self._prepared)
                        nbytes += len(rec)
                if self._written.get(b) == (p.epoch, p.seq) and not p.dedup and not p.fresh:
                    continue
                txn.put(
                    b"%08d" % b, seal(json.dumps([p.epoch, p.seq]).encode()), db=self._positions
                )
                if p.fresh:
                    self._delete_chunks(txn, b, keep=0)
                if p.dedup:
                    key = b"%08d/%020d" % (b, p.seq)
                    txn.put(key, seal(json.dumps(p.dedup).encode()), db=self._dedup)
                    self._delete_chunks(txn, b, keep=DEDUP_CHUNKS)
                nbytes += 64

        self._write(fn)
        if positions is not None and self._written is not None:
            written = {b: v for b, v in self._written.items() if b in keep}
            written.update({b: (p.epoch, p.seq) for b, p in positions.items()})
            self._written = written
            on_disk = {b for b in self._prepared_on_disk or set() if b in keep}
            on_disk -= set(positions)
            on_disk |= {b for b, p in positions.items() if p.prepared}
            self._prepared_on_disk = on_disk
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

    # -- format ----------------------------------------------------------------------------------

    def _stamp_or_refuse(self) -> None:
        """Stamps a new environment with FORMAT. An environment stamped otherwise, or holding
        records without a stamp, is refused: this version cannot tell what its records mean."""
        with self._lock, self.env.begin() as txn:
            stamp = txn.get(b"format", db=self._meta)
            n = txn.stat(self._tensors)["entries"] + txn.stat(self._positions)["entries"]
        if stamp is not None and bytes(stamp) == FORMAT:
            return
        if stamp is not None or n:
            self.env.close()
            shown = repr(bytes(stamp)) if stamp is not None else "none (records without checksums)"
            raise ConfigError(
                f"{self.path}: LMDB format {shown} is not this version's {FORMAT!r} (written by "
                "another adamps?): run that version, or move the directory aside"
            )

        def stamp_new(txn: lmdb.Transaction) -> None:
            txn.put(b"format", FORMAT, db=self._meta)

        self._write(stamp_new)

    def report_corrupt(self, where: str, db: str, key: bytes, exc: Exception) -> str:
        """Counts, reports and logs a record that failed its checksum; returns why."""
        self.corrupt_records[where] = self.corrupt_records.get(where, 0) + 1
        self.on_corrupt(where)
        why = f"{db} record {key.decode(errors='replace')!r}: {exc}"
        log.error("CORRUPT record in %s (%s): %s", self.path, where, why)
        return why

    def delete(self, db: str, key: bytes) -> None:
        """Deletes one record if it is still damaged (a flush may have rewritten it since the
        scrub read it): the next flush rewrites it."""
        assert db in _SEALED_DBS
        handle = getattr(self, "_" + db)

        def fn(txn: lmdb.Transaction) -> None:
            v = txn.get(key, db=handle)
            if v is not None and self.check_record(db, key, v) is not None:
                txn.delete(key, db=handle)

        self._write(fn)
        if db in ("positions", "prepared"):
            self._written = None  # read again at the next flush

    def forget_tensors(self, names: Iterable[str]) -> int:
        """Deletes tensors' definitions and shard records (a deleted run's, issue 25); a flush
        that cut their shards before does not write them back. Returns the records deleted."""
        gone = set(names)
        self._forgotten |= gone
        deleted = 0

        def fn(txn: lmdb.Transaction) -> None:
            nonlocal deleted
            deleted = 0
            for name in sorted(gone):
                deleted += bool(txn.delete(name.encode(), db=self._tensors))
                prefix = (name + "/").encode()  # shard ids are "<tensor>/<index>"
                cur = txn.cursor(db=self._shards)
                keys = []
                if cur.set_range(prefix):
                    for k in cur.iternext(values=False):
                        if not bytes(k).startswith(prefix):
                            break
                        keys.append(bytes(k))
                for k in keys:
                    deleted += bool(txn.delete(k, db=self._shards))

        self._write(fn)
        memtrim.trim()
        return deleted

    def bucket_of_record(self, db: str, key: bytes, n_buckets: int) -> int | None:
        """The bucket a record belongs to (None: a tensor definition, which is every bucket's)."""
        if db in ("shards", "rowpages"):
            sid = key.decode(errors="replace") if db == "shards" else sid_of_key(key)
            row = parse_row_shard_id(sid)  # a row shard names its bucket
            return row[1] if row is not None else stable_bucket(sid, n_buckets)
        if db == "tensors":
            return None
        return int(key.split(b"/")[0])

    def check_record(self, db: str, key: bytes, value: bytes | memoryview) -> Exception | None:
        """The reason record (db, key) does not verify, or None."""
        try:
            payload = unseal(value)
            if db == "shards":
                _check_lengths(payload)  # the values' copies _unpack makes are not needed here
            elif db == "rowpages":
                pass  # its length is its table's: checked when loaded
            elif db == "prepared":
                protocol.decode(bytes(payload))
            else:
                json.loads(bytes(payload))
        except (CorruptRecord, ValueError, struct.error, protocol.ProtocolError) as exc:
            return exc
        return None

    def verify(self, n_buckets: int, where: str = "load") -> Corruption:
        """Checks every record's checksum: which buckets' copies on disk cannot be trusted."""
        out = Corruption()
        with self._lock, self.env.begin() as txn:
            for name in _SEALED_DBS:
                for k, v in txn.cursor(db=getattr(self, "_" + name)):
                    out.records += 1
                    exc = self.check_record(name, bytes(k), v)
                    if exc is None:
                        continue
                    why = self.report_corrupt(where, name, bytes(k), exc)
                    b = self.bucket_of_record(name, bytes(k), n_buckets)
                    if b is None:
                        out.everything = out.everything or why
                    else:
                        out.buckets.setdefault(b, why)
        return out

    def discard(self, bad: Corruption, n_buckets: int) -> int:
        """Deletes, in one transaction, the records of the copies `bad` marks (and every record
        that fails its checksum): they are never offered, and their buckets come back by state
        transfer. Returns the records deleted."""
        deleted = 0

        def fn(txn: lmdb.Transaction) -> None:
            nonlocal deleted
            deleted = 0
            for name in _SEALED_DBS:
                db = getattr(self, "_" + name)
                doomed = []
                for k, v in txn.cursor(db=db):
                    key = bytes(k)
                    b = self.bucket_of_record(name, key, n_buckets)
                    gone = (b is not None and bad.bad(b)) or (
                        self.check_record(name, key, v) is not None
                    )
                    if gone:
                        doomed.append(key)
                for key in doomed:
                    txn.delete(key, db=db)
                deleted += len(doomed)

        self._write(fn)
        self._written = None  # read again at the next flush
        return deleted

    def scan(
        self, after: tuple[str, bytes] | None, budget: int
    ) -> tuple[list[tuple[str, bytes, Exception]], tuple[str, bytes] | None, int]:
        """Verifies records in (db, key) order from just after `after` until about `budget`
        bytes were read (the scrub's step: one short read transaction). Returns (failures, the
        last record checked or None at the end of a pass, bytes read)."""
        failures: list[tuple[str, bytes, Exception]] = []
        nbytes = 0
        start = 0 if after is None else _SEALED_DBS.index(after[0])
        with self._lock, self.env.begin() as txn:
            for i in range(start, len(_SEALED_DBS)):
                name = _SEALED_DBS[i]
                cur = txn.cursor(db=getattr(self, "_" + name))
                if after is not None and i == start:
                    ok = cur.set_range(after[1])
                    if ok and bytes(cur.key()) == after[1]:
                        ok = cur.next()
                else:
                    ok = cur.first()
                while ok:
                    k, v = bytes(cur.key()), cur.value()
                    nbytes += len(v)
                    exc = self.check_record(name, k, v)
                    if exc is not None:
                        failures.append((name, k, exc))
                    if nbytes >= budget:
                        return failures, (name, k), nbytes
                    ok = cur.next()
        return failures, None, nbytes

    # -- reading ------------------------------------------------------------------------------

    def load_positions(self, skip: Corruption | None = None) -> dict[int, Position]:
        """The persisted copies: bucket -> position with its exactly-once pairs, oldest first.
        Buckets `skip` marks corrupt are left out (their copy is not offered)."""
        out: dict[int, Position] = {}
        with self._lock, self.env.begin() as txn:
            for k, v in txn.cursor(db=self._positions):
                try:
                    epoch, seq = json.loads(bytes(unseal(v)))
                except (CorruptRecord, ValueError) as exc:
                    self.report_corrupt("load", "positions", bytes(k), exc)
                    continue
                b = int(bytes(k))
                if skip is None or not skip.bad(b):
                    out[b] = Position(int(epoch), int(seq), [])
            for k, v in txn.cursor(db=self._dedup):
                b = int(bytes(k).split(b"/")[0])
                if b in out:
                    out[b].dedup.extend(json.loads(bytes(unseal(v))))
            for k, v in txn.cursor(db=self._prepared):
                b = int(bytes(k).split(b"/")[0])
                if b in out:
                    out[b].prepared.append(protocol.decode(bytes(unseal(v))))
        return out

    def load(self) -> list[SavedTensor]:
        """Every saved tensor in creation order, with the shards saved for it; a record that
        fails its checksum is left out (logged: ``verify`` has kept its bucket from being
        offered)."""
        with self._lock, self.env.begin() as txn:
            metas = []
            for k, v in txn.cursor(db=self._tensors):
                try:
                    metas.append(json.loads(bytes(unseal(v))))
                except (CorruptRecord, ValueError) as exc:
                    log.error("tensor definition %r does not verify (%s): skipped", bytes(k), exc)
            metas.sort(key=lambda m: m["seq"])
            out = {m["spec"]["name"]: SavedTensor(m, {}) for m in metas}
            for k, v in txn.cursor(db=self._shards):
                sid = bytes(k).decode()
                tensor = sid.rpartition("/")[0]
                if tensor in out:
                    try:
                        out[tensor].shards[sid] = _unpack(unseal(v))
                    except (CorruptRecord, ValueError, struct.error) as exc:
                        log.error("shard %s does not verify (%s): not loaded", sid, exc)
            for sid, rows in rowpages.load(
                txn, self._rowpages, lambda sid: sid.rpartition("/")[0] in out
            ).items():
                out[sid.rpartition("/")[0]].rows[sid] = rows
        self.drop_file_view()  # every record was read (copied) once: the map's pages may go
        return list(out.values())


def _check_lengths(rec: bytes | memoryview) -> tuple[int, int, int]:
    """(version, value bytes, accumulator bytes) of a shard record's payload, whose lengths must
    add up to the record's."""
    version, nv, na = HEADER.unpack_from(rec)
    if HEADER.size + nv + na != len(rec) or nv % 4 or na % 4:
        raise ValueError(f"shard record of {len(rec)} bytes does not hold {nv} + {na} bytes")
    return version, nv, na


def _unpack(rec: bytes | memoryview) -> tuple[int, np.ndarray, np.ndarray | None]:
    version, nv, na = _check_lengths(rec)
    off = HEADER.size
    # A copy (bytes -> new array): the values become mutable state of the store.
    value = np.frombuffer(rec, dtype="<f4", count=nv // 4, offset=off).copy()
    accum = np.frombuffer(rec, dtype="<f4", count=na // 4, offset=off + nv).copy() if na else None
    return version, value, accum
