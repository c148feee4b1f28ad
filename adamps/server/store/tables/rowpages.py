"""An embedding table's rows in LMDB (issue 38): the flush's writes of a row shard's pages, and
what a start reads back (rowdelta.py holds the format). Called inside adamps/server/storage/persist.py's transactions.

Both formats load: pages (``rowpages``, this version), and the older record per row (``rows``,
issue 23), read once and rewritten as pages by the next flush (the block is loaded as replaced
whole), which deletes the row records in the same transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import lmdb
import numpy as np

from adamps import rowdtype
from adamps.server.store.checksum import CorruptRecord, unseal
from adamps.server.store.tables.rowdelta import (
    RowDelta,
    id_of_key,
    parse_page,
    parse_rows,
    row_prefix,
    sid_of_key,
)

log = logging.getLogger(__name__)


@dataclass
class SavedRows:
    """A row shard's records as read at a start (payloads, verified; parsed by its table)."""

    #: (page number, payload) in page order
    pages: list[tuple[int, bytes]] = field(default_factory=list)
    #: the older format: ids and row payloads
    legacy_ids: list[int] = field(default_factory=list)
    legacy: list[bytes] = field(default_factory=list)
    #: a record failed its checksum: the rows read are not the whole shard
    damaged: bool = False

    def parse(
        self, dim: int, acc_width: int, page_rows: int, dtype: str = "float32"
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, bool]:
        """(ids, seen, values, accum, intact): `intact` when the pages are 0, 1, ... with
        `page_rows` rows each but the last, so the slots on disk are the slots in memory and the
        next flush may write only the touched pages (else the block is rewritten whole)."""
        if self.legacy and not self.pages:
            ids, seen, values, accum = parse_rows(self.legacy_ids, self.legacy, dim, acc_width)
            return ids, seen, rowdtype.encode(values, dtype), accum, False
        got = [parse_page(p, dim, acc_width, dtype) for _, p in self.pages]
        nums = [n for n, _ in self.pages]
        sizes = [len(g[0]) for g in got]
        intact = nums == list(range(len(nums))) and all(s == page_rows for s in sizes[:-1])
        intact = (
            intact
            and (not sizes or 0 < sizes[-1] <= page_rows)
            and not self.legacy
            and not self.damaged
        )
        n = sum(sizes)
        ids = np.concatenate([g[0] for g in got]) if got else np.empty(0, np.int64)
        seen = (
            np.concatenate([g[1] for g in got])
            if got and got[0][1] is not None
            else np.zeros(n, np.float64)
        )
        vt = rowdtype.storage(dtype)
        values = np.concatenate([g[2] for g in got]) if got else np.empty((0, dim), vt)
        values = values.astype(vt, copy=False)
        accum = None
        if acc_width:
            accum = np.concatenate([g[3] for g in got]) if got else np.empty((0, acc_width))
            accum = accum.astype(np.float32)
        return ids.astype(np.int64), seen.astype(np.float64), values, accum, intact


def write(txn: lmdb.Transaction, pages_db: object, rows_db: object, sid: str, d: RowDelta) -> int:
    """A row shard's pages of one cut; returns the bytes written."""
    prefix = row_prefix(sid)
    if d.full:  # replaced whole: no page or row of an earlier state may survive
        _delete_from(txn, rows_db, prefix, prefix)
        _delete_from(txn, pages_db, prefix, prefix)
    else:  # pages past the shard's end (it shrank: expiry)
        _delete_from(txn, pages_db, prefix, prefix + d.n_pages.to_bytes(4, "big"))
    recs = d.records(sid)
    if recs:
        txn.cursor(db=pages_db).putmulti(recs)
    return sum(len(k) + len(v) for k, v in recs)


def _delete_from(txn: lmdb.Transaction, db: object, prefix: bytes, start: bytes) -> None:
    cur = txn.cursor(db=db)
    if cur.set_range(start):
        while bytes(cur.key()).startswith(prefix):
            if not cur.delete():
                break


def load(
    txn: lmdb.Transaction, pages_db: object, rows_db: object, wanted: Callable[[str], bool]
) -> dict[str, SavedRows]:
    """Row shard id -> its verified records, of the shards `wanted` says (their table is
    defined); a record that fails its checksum is left out (logged; ``verify`` has kept its
    bucket from being offered, and the shard then loads as replaced whole)."""
    out: dict[str, SavedRows] = {}
    for db, name in ((pages_db, "rowpages"), (rows_db, "rows")):
        for k, v in txn.cursor(db=db):
            key = bytes(k)
            sid = sid_of_key(key, name)
            if not wanted(sid):
                continue
            try:
                payload = bytes(unseal(v))
            except CorruptRecord as exc:
                log.error("%s record %r does not verify (%s): not loaded", name, key, exc)
                out.setdefault(sid, SavedRows()).damaged = True
                continue
            saved = out.setdefault(sid, SavedRows())
            if name == "rowpages":
                saved.pages.append((int.from_bytes(key[-4:], "big"), payload))
            else:
                saved.legacy_ids.append(id_of_key(key))
                saved.legacy.append(payload)
    return out
