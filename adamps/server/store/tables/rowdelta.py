"""What a flush writes of a row shard (issues 23, 38): its rows in pages, one LMDB record per
page of ``page_rows`` consecutive slots, and only the pages holding a row touched since the
previous flush; every page when the shard's state was replaced whole (a state transfer, a
checkpoint's restore, a block loaded from an older format).

In LMDB (adamps/server/storage/persist.py) a page is one record of the ``rowpages`` database, keyed
``<row shard id>/<page number: 4 bytes big-endian>``, sealed with one checksum like every record
(the scrub verifies it): a `_PAGE` header, then the page's ids (int64), their last push times
(float64, only for a table with ``expire_after``: nothing else reads them), values (float32 x
dim, or 16 bits for a float16 / bfloat16 table: a flag says which) and optimizer state (float32 x the optimizer's width). ``page_rows`` is chosen so that a
record fills its run of LMDB overflow pages: on disk a row costs its bytes and ~1% more, where
the older format's record per row (``rows``: key, checksum and B-tree node per row) cost ~3.4x
its values (docs/benchmarks.md, issue 38). The block's own small state (the frequency counts,
the next expiry sweep) stays the row shard's record in ``shards``, in the same transaction.

Slots move only at expiry (the block compacts): every page from the first removed slot on is
then rewritten, and the records of pages past the shard's last are deleted.

Pure: no IO, no clock.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from adamps import rowdtype
from adamps.server.store.checksum import MAGIC, seal

#: magic, rows, dim, optimizer state width, flags (1: last push times present)
_PAGE = struct.Struct("<4sIIII")
_PAGE_MAGIC = b"RPG1"
_HAS_SEEN = 1
#: flags of the values' type (none: float32)
_DTYPE_FLAGS = {"float32": 0, "float16": 2, "bfloat16": 4}
_DTYPE_MASK = 6
#: LMDB's page size, and the header of a run of overflow pages (a value > ~2 KiB is one run)
LMDB_PAGE = 4096
_OVERFLOW_HEAD = 16
#: a sealed record's head: MAGIC and the xxh3-64 of the payload (adamps.server.store.checksum)
SEAL_BYTES = len(MAGIC) + 8


def row_bytes(dim: int, acc_width: int, seen: bool, vbytes: int = 4) -> int:
    """A row's bytes in a page: id, last push time, values (`vbytes` each), optimizer state."""
    return 8 + (8 if seen else 0) + vbytes * dim + 4 * acc_width


def page_rows(dim: int, acc_width: int, seen: bool, vbytes: int = 4) -> int:
    """Rows per page record: the count that best fills a run of 4 to 16 LMDB pages (within 2%
    of full at the smallest such run), so few bytes of the disk are padding, and a flush
    rewrites at most ~16 KiB around a touched row."""
    row = row_bytes(dim, acc_width, seen, vbytes)
    head = SEAL_BYTES + _PAGE.size + _OVERFLOW_HEAD
    best: tuple[float, int] | None = None
    for k in range(4, 17):
        p = (k * LMDB_PAGE - head) // row
        if p < 1:
            continue
        waste = (k * LMDB_PAGE - head - p * row) / (k * LMDB_PAGE)
        if best is None or waste < best[0]:
            best = (waste, p)
        if waste < 0.02:
            break
    return 1 if best is None else best[1]


@dataclass
class RowDelta:
    """The pages a flush writes of one row shard (copies, taken on its owner thread)."""

    #: every page of the shard is here: the flush deletes its other pages
    full: bool
    page_rows: int
    #: the shard's pages now: records of later pages are deleted
    n_pages: int
    pages: np.ndarray  #: int64 [m], increasing
    #: row offsets of each page in the arrays below: page pages[i] is rows starts[i]:starts[i+1]
    starts: np.ndarray  #: int64 [m + 1]
    ids: np.ndarray  #: int64 [k]
    seen: np.ndarray | None  #: float64 [k] (tables with expire_after) or None
    values: np.ndarray  #: [k, dim] as the table stores them (rowdtype.storage)
    accum: np.ndarray | None  #: float32 [k, width] or None

    def after(self, older: RowDelta) -> RowDelta:
        """This delta applied on top of an `older` one not written yet (a failed flush's): one
        delta with the same effect (a page holds its rows whole: the newer copy of a page wins,
        and pages past the newer end are gone)."""
        if self.full:
            return self
        mine = set(self.pages.tolist())
        parts = [(int(p), older, i) for i, p in enumerate(older.pages.tolist())
                 if p not in mine and p < self.n_pages]  # fmt: skip
        parts += [(int(p), self, i) for i, p in enumerate(self.pages.tolist())]
        parts.sort(key=lambda x: x[0])
        sl = [slice(int(d.starts[i]), int(d.starts[i + 1])) for _, d, i in parts]
        lens = [s.stop - s.start for s in sl]

        def cat(get: str) -> np.ndarray | None:
            arrs = [getattr(d, get) for _, d, _ in parts]
            if not parts or arrs[0] is None:
                return getattr(self, get)[:0] if getattr(self, get) is not None else None
            return np.concatenate([a[s] for a, s in zip(arrs, sl, strict=True)])

        return RowDelta(
            older.full,
            self.page_rows,
            self.n_pages,
            np.array([p for p, _, _ in parts], np.int64),
            np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int64),
            cat("ids"),  # type: ignore[arg-type]
            cat("seen"),
            cat("values"),  # type: ignore[arg-type]
            cat("accum"),
        )

    def records(self, sid: str) -> list[tuple[bytes, bytes]]:
        """(key, sealed record) of every page, in key order: one checksum per page."""
        prefix = row_prefix(sid)
        dim = self.values.shape[1]
        aw = 0 if self.accum is None else self.accum.shape[1]
        flags = (_HAS_SEEN if self.seen is not None else 0) | _flag_of(self.values.dtype)
        out = []
        for i, p in enumerate(self.pages.tolist()):
            a, b = int(self.starts[i]), int(self.starts[i + 1])
            parts = [
                _PAGE.pack(_PAGE_MAGIC, b - a, dim, aw, flags),
                np.ascontiguousarray(self.ids[a:b], "<i8").tobytes(),
            ]
            if self.seen is not None:
                parts.append(np.ascontiguousarray(self.seen[a:b], "<f8").tobytes())
            parts.append(np.ascontiguousarray(self.values[a:b]).tobytes())
            if self.accum is not None:
                parts.append(np.ascontiguousarray(self.accum[a:b], "<f4").tobytes())
            out.append((prefix + page_key(p), seal(*parts)))
        return out

    @property
    def nbytes(self) -> int:
        """About what writing it costs (the flush's chunk plan)."""
        aw = 0 if self.accum is None else self.accum.shape[1]
        per = row_bytes(self.values.shape[1], aw, self.seen is not None, self.values.itemsize)
        return len(self.ids) * per + len(self.pages) * 64


def page_key(page: int) -> bytes:
    return struct.pack(">I", page)


def _flag_of(dt: np.dtype) -> int:
    """The page flag of values stored as `dt` (float16; uint16 is bfloat16's storage)."""
    if dt == np.float16:
        return _DTYPE_FLAGS["float16"]
    return _DTYPE_FLAGS["bfloat16"] if dt == np.uint16 else 0


def parse_page(
    payload: bytes | memoryview, dim: int, acc_width: int, dtype: str = "float32"
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
    """(ids, seen or None, values, accum or None) of a page record's payload (views), the values
    as a table of value type `dtype` stores them (converted if the page holds another type);
    raises ValueError on a record that does not fit the table."""
    magic, k, d, aw, flags = _PAGE.unpack_from(payload)
    if magic != _PAGE_MAGIC or d != dim or aw != acc_width:
        raise ValueError(
            f"row page {magic!r} of dim {d}, state width {aw}: the table has {dim}, {acc_width}"
        )
    seen = bool(flags & _HAS_SEEN)
    stored = {v: n for n, v in _DTYPE_FLAGS.items()}.get(flags & _DTYPE_MASK)
    if stored is None:
        raise ValueError(f"row page with flags {flags:#x}: no such value type")
    vt = rowdtype.storage(stored)
    off = _PAGE.size
    if off + k * row_bytes(dim, aw, seen, vt.itemsize) != len(payload):
        raise ValueError(f"row page of {len(payload)} bytes does not hold {k} rows")
    ids = np.frombuffer(payload, "<i8", k, off)
    off += 8 * k
    s = None
    if seen:
        s = np.frombuffer(payload, "<f8", k, off)
        off += 8 * k
    values = np.frombuffer(payload, vt.newbyteorder("<"), k * dim, off).reshape(k, dim)
    off += vt.itemsize * k * dim
    if stored != dtype:
        values = rowdtype.encode(rowdtype.decode(values, stored).astype(np.float32), dtype)
    accum = np.frombuffer(payload, "<f4", k * aw, off).reshape(k, aw) if aw else None
    return ids, s, values, accum


# -- keys of both formats (the older one: one record per row, in the ``rows`` database) ---------


def row_prefix(sid: str) -> bytes:
    """The key prefix of a row shard's pages."""
    return sid.encode() + b"/"


def sid_of_key(key: bytes) -> str:
    """The row shard id of a page's key (``rowpages``; its suffix may hold any byte: cut by
    length)."""
    return key[:-5].decode(errors="replace")
