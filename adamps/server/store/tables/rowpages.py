"""An embedding table's rows in LMDB (issue 38): the flush's writes of a row shard's pages, and
what a start reads back (rowdelta.py holds the format). Called inside adamps/server/storage/persist.py's transactions.

Only pages load (format 3): an environment of another format is refused before anything is
read (persist.py's format stamp).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import lmdb
import numpy as np

from adamps import rowdtype
from adamps.server.store.checksum import CorruptRecord, unseal
from adamps.server.store.tables.rowdelta import RowDelta, parse_page, row_prefix, sid_of_key

log = logging.getLogger(__name__)


@dataclass
class SavedRows:
    """A row shard's records as read at a start (payloads, verified; parsed by its table)."""

    #: (page number, payload) in page order
    pages: list[tuple[int, bytes]] = field(default_factory=list)
    #: a record failed its checksum: the rows read are not the whole shard
    damaged: bool = False

    def parse(
        self, dim: int, acc_width: int, page_rows: int, dtype: str = "float32"
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, bool]:
        """(ids, seen, values, accum, intact): `intact` when the pages are 0, 1, ... with
        `page_rows` rows each but the last, so the slots on disk are the slots in memory and the
        next flush may write only the touched pages (else the block is rewritten whole)."""
        got = [parse_page(p, dim, acc_width, dtype) for _, p in self.pages]
        nums = [n for n, _ in self.pages]
        sizes = [len(g[0]) for g in got]
        intact = nums == list(range(len(nums))) and all(s == page_rows for s in sizes[:-1])
        intact = intact and (not sizes or 0 < sizes[-1] <= page_rows) and not self.damaged
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


def write(txn: lmdb.Transaction, pages_db: object, sid: str, d: RowDelta) -> int:
    """A row shard's pages of one cut; returns the bytes written."""
    prefix = row_prefix(sid)
    if d.full:  # replaced whole: no page of an earlier state may survive
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
    txn: lmdb.Transaction, pages_db: object, wanted: Callable[[str], bool]
) -> dict[str, SavedRows]:
    """Row shard id -> its verified records, of the shards `wanted` says (their table is
    defined); a record that fails its checksum is left out (logged; ``verify`` has kept its
    bucket from being offered, and the shard then loads as replaced whole)."""
    out: dict[str, SavedRows] = {}
    for k, v in txn.cursor(db=pages_db):
        key = bytes(k)
        sid = sid_of_key(key)
        if not wanted(sid):
            continue
        try:
            payload = bytes(unseal(v))
        except CorruptRecord as exc:
            log.error("rowpages record %r does not verify (%s): not loaded", key, exc)
            out.setdefault(sid, SavedRows()).damaged = True
            continue
        out.setdefault(sid, SavedRows()).pages.append((int.from_bytes(key[-4:], "big"), payload))
    return out
