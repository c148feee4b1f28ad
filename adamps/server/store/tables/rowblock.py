"""One bucket's rows of one embedding table, and the per-row optimizer: pure numpy, no IO, no
clock (a push's time comes in the update, stamped by the primary, so every copy decides the same).

Rows live in growable arrays (values, the optimizer's state, last push time, id) with an index
id -> slot (rowindex.py); expiry compacts the arrays, so they stay dense. The arrays grow by an
eighth (not double), and nothing is kept per row in Python objects: a row costs its bytes, the
index's 12 and ~1/16 of spare room (issue 38). A flush writes the pages of `page_rows` slots
that hold a touched row (rowdelta.py): `dirty` is one flag per page, not per row. Every step is a deterministic function of (state, ordered updates): copies of a bucket
that apply the same batches end bit-identical, and `to_bytes` / `from_bytes` carry the whole
state (LMDB flushes, state transfer).

A push (`RowPush`) is applied in this order, by every copy alike:

1. duplicate ids are summed (the push is one gradient per distinct id);
2. expiry: when the table has ``expire_after`` and the push's time has passed the next sweep,
   rows last pushed more than ``expire_after`` seconds before it are removed;
3. admission: an id without a row is counted (frequency filter); at its ``admit_after``-th push
   it gets a row, if the bucket's share of ``max_rows`` has room (new ids in increasing id order
   take the room left; the others' gradients are dropped, counted);
4. new rows start from `initial_rows(init, id)` (and the optimizer's initial accumulator);
5. the table's optimizer per row (torchoptim.row_step: SGD, torch's Adagrad per element, the
   row-wise Adagrad with one accumulator per row, or the legacy Adagrad), in float32, one step
   per push (as for shards: adamps/server/updates/optim.py); a 16-bit table (``dtype``, rowdtype.py) widens its rows
   to float32 for the step and rounds them back after it;
6. the rows' last push time becomes the push's time.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

import numpy as np

from adamps import rowdtype
from adamps.server.store.tables.freqsketch import DEPTH, FrequencySketch
from adamps.server.store.tables.rowdelta import RowDelta, page_rows
from adamps.server.store.tables.rowindex import RowIndex
from adamps.server.updates import torchoptim
from adamps.server.updates.optim import Optimizer
from adamps.tables import Admission, initial_rows

#: magic, version, rows, dim, has accumulator, filter counters (version 1: pending (id, count)
#: pairs), next sweep
_HEAD = struct.Struct("<4sIQIIQd")
_MAGIC = b"ROWS"
#: the flushed form: the block's own state without its rows (they are records of their own)
_HEADER_MAGIC = b"ROWH"


@dataclass(frozen=True, slots=True)
class RowPush:
    """The gradient rows of one push to one bucket: ids int64 [n], grads float32 [n, dim], and
    the primary's wall-clock time of the push (expiry)."""

    ids: np.ndarray
    grads: np.ndarray
    time: float
    #: put_rows (a bulk load): `grads` are the rows' values themselves, the ids distinct
    assign: bool = False


@dataclass
class ApplyStats:
    """What applying pushes did (for /metrics)."""

    created: int = 0
    #: gradients of new ids dropped because the bucket's share of max_rows was full
    dropped_full: int = 0
    #: gradients of ids not yet admitted by the frequency filter
    filtered: int = 0
    expired: int = 0


def sum_duplicates(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct ids, the sum of each id's gradient rows). One sort (np.unique's and an
    argsort were two: a tenth of a bulk load's server CPU, issue 38); duplicates are summed by
    np.add.at in push order, as before."""
    order = np.argsort(ids, kind="stable")
    srt = ids[order]
    first = np.empty(len(srt), bool)
    first[:1] = True
    np.not_equal(srt[1:], srt[:-1], out=first[1:])
    if first.all():
        return srt, grads[order]
    inv = np.empty(len(ids), np.intp)
    inv[order] = np.cumsum(first) - 1
    out = np.zeros((int(first.sum()), grads.shape[1]), np.float32)
    np.add.at(out, inv, grads)
    return srt[first], out


@dataclass(eq=False)
class RowBlock:
    """Rows of one table in one bucket. Mutated only by its shard's owner thread."""

    dim: int
    init: dict
    optimizer: Optimizer
    admission: Admission
    #: the bucket's share of the table's max_rows (None: no limit)
    limit: int | None
    n: int = 0
    ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    values: np.ndarray | None = None
    accum: np.ndarray | None = None
    #: wall-clock time (the primary's) of each row's last push: kept only for a table with
    #: expire_after, the one reader (else empty: 8 bytes a row saved)
    seen: np.ndarray = field(default_factory=lambda: np.empty(0, np.float64))
    index: RowIndex = field(default_factory=RowIndex)
    #: sightings of ids without a row (the frequency filter, when admit_after > 1): bounded
    #: memory (freqsketch.py), made at the first sighting (None before: no counts)
    sketch: FrequencySketch | None = None
    #: time of the next expiry sweep
    next_sweep: float = 0.0
    #: per page of `page_rows` slots: a row of it pushed (or moved) since the last flush's cut
    dirty: np.ndarray = field(default_factory=lambda: np.empty(0, bool))
    #: the next flush writes every row (the state was replaced whole, or never flushed)
    full: bool = True
    #: how `values` are stored (rowdtype.py): 16-bit tables round each update back to 16 bits;
    #: `tobytes` / `load_bytes` (state transfers, checkpoints) carry them as float32
    dtype: str = "float32"

    def __post_init__(self) -> None:
        self.vtype = rowdtype.storage(self.dtype)
        if self.values is None:
            self.values = np.empty((0, self.dim), self.vtype)
        #: the optimizer's state per row (Adagrad: dim; row-wise Adagrad: 1; SGD: 0)
        self.acc_width = self.optimizer.row_state_width(self.dim)
        if self.accum is None and self.acc_width:
            self.accum = np.empty((0, self.acc_width), np.float32)
        #: rows per page of the flushed form (last push times only where expiry reads them)
        self.has_seen = self.admission.expire_after is not None
        self.page_rows = page_rows(self.dim, self.acc_width, self.has_seen, self.vtype.itemsize)
        self._size_dirty()
        # The frequency sketch is made at the first sighting (`_admit`, the owner thread): a
        # create allocates nothing per bucket on the event loop (issue 39).

    # -- reads -----------------------------------------------------------------------------------

    def slots(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where it has no row."""
        return self.index.lookup(ids)

    def gather(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Rows of `ids` into `out` [len(ids), dim]; an id without a row reads as the value it
        would be created with (a pull creates nothing: reads never change state)."""
        s = self.slots(ids)
        have = s >= 0
        assert self.values is not None
        if have.all():
            if self.dtype == "float32":
                np.take(self.values, s, axis=0, out=out)
            else:
                out[:] = rowdtype.decode(np.take(self.values, s, axis=0), self.dtype)
            return
        out[have] = rowdtype.decode(self.values[s[have]], self.dtype)
        # as it would be created: a 16-bit table's initial value is rounded to 16 bits
        fresh = initial_rows(self.init, ids[~have], self.dim)
        out[~have] = rowdtype.decode(rowdtype.encode(fresh, self.dtype), self.dtype)

    def missing(self, ids: np.ndarray) -> int:
        """How many distinct `ids` have no row (a racy read from the event loop is fine: the
        answer only decides an early table_full; the owner thread decides for real)."""
        return len(np.unique(ids[self.index.lookup(ids) < 0]))

    # -- writes ----------------------------------------------------------------------------------

    def _grow(self, need: int) -> None:
        assert self.values is not None
        cap = len(self.values)
        if need <= cap:
            return
        # by an eighth: amortised O(1) per row still (each row copied ~8 times as the block
        # grows), with ~1/16 spare room on average, where doubling kept up to 1/2 (and a
        # reloaded block's first new row doubled it)
        self._resize(max(need, cap + cap // 8, 64))

    def _resize(self, new: int) -> None:
        """The arrays at capacity `new` (>= n): the rows copied, the old arrays freed."""

        def moved(a: np.ndarray) -> np.ndarray:
            b = np.empty((new, *a.shape[1:]), a.dtype)
            b[: self.n] = a[: self.n]
            return b

        assert self.values is not None
        self.values = moved(self.values)
        if self.accum is not None:
            self.accum = moved(self.accum)
        self.ids = moved(self.ids)
        if self.has_seen:
            self.seen = moved(self.seen)
        self._size_dirty()

    def _size_dirty(self) -> None:
        """One dirty flag per page of the capacity (and one more); a shrink keeps the flags."""
        assert self.values is not None
        pages = -(-len(self.values) // self.page_rows) + 1
        if len(self.dirty) < pages:
            d = np.zeros(pages, bool)
            d[: len(self.dirty)] = self.dirty
            self.dirty = d

    def expire(self, now: float) -> int:
        """Removes rows last pushed more than expire_after before `now`; returns how many. The
        rows kept move down in slot order (the same on every copy), and the index is rebuilt."""
        ttl = self.admission.expire_after
        if ttl is None or not self.n:
            return 0
        keep = self.seen[: self.n] >= now - ttl
        k = int(keep.sum())
        if k == self.n:
            return 0
        assert self.values is not None
        gone = self.n - k
        # every page from the first removed row on holds moved rows: rewritten
        self.dirty[int(np.argmin(keep)) // self.page_rows :] = True
        self.ids[:k] = self.ids[: self.n][keep]
        self.seen[:k] = self.seen[: self.n][keep]
        self.values[:k] = self.values[: self.n][keep]
        if self.accum is not None:
            self.accum[:k] = self.accum[: self.n][keep]
        self.n = k
        self.index.rebuild(self.ids[:k])
        if len(self.values) > 64 and k < len(self.values) // 4:
            # expired rows give their memory back (a quarter used: half the capacity stays
            # free for growth, so a bucket hovering at a size does not resize each sweep)
            self._resize(max(2 * k, 64))
        return gone

    def assign(self, push: RowPush, stats: ApplyStats) -> None:
        """put_rows: the rows of `push.ids` (distinct) take the pushed values, their optimizer
        state its initial value (a loaded row starts its optimizer afresh) and the push's time.
        Rows are created without the frequency filter (a load is not a sighting), within the
        bucket's share of max_rows (the ids past it are dropped, counted as a push's are)."""
        ids, v = push.ids, push.grads
        s = self.slots(ids)
        held = s >= 0
        new = np.flatnonzero(~held)
        if self.limit is not None and self.n + len(new) > self.limit:
            room = max(0, self.limit - self.n)
            stats.dropped_full += len(new) - room
            new = new[:room]
        if len(new):
            # created with their values and the push's time: no initial draw that the values
            # would overwrite, no second write (they were half of a put_rows' apply, issue 38)
            self._create(ids[new], s, new, v[new], push.time)
            stats.created += len(new)
        if held.any():
            s, v = s[held], v[held]
            assert self.values is not None
            self.values[s] = rowdtype.encode(v, self.dtype)
            if self.accum is not None:
                self.accum[s] = self.optimizer.initial_state
            self._touch(s, push.time)

    def apply(self, push: RowPush, stats: ApplyStats) -> None:
        """One push (module docstring, steps 1-6); a put_rows' values: `assign`."""
        if push.assign:
            self.assign(push, stats)
            return
        ids, g = sum_duplicates(push.ids, push.grads)
        ttl = self.admission.expire_after
        if ttl is not None and push.time >= self.next_sweep:
            stats.expired += self.expire(push.time)
            # A sweep costs a pass over the rows: at most one per quarter of the lifetime.
            self.next_sweep = push.time + ttl / 4
        s = self.slots(ids)
        new = np.flatnonzero(s < 0)
        if len(new):
            new = self._admit(ids, new, stats)
            if len(new):
                self._create(ids[new], s, new)
                stats.created += len(new)
        keep = s >= 0
        if not keep.all():
            s, g = s[keep], g[keep]
        if len(s):
            self._step(s, g)
            self._touch(s, push.time)

    def _admit(self, ids: np.ndarray, new: np.ndarray, stats: ApplyStats) -> np.ndarray:
        """The positions in `new` (ids without a row, increasing) that get a row now."""
        after = self.admission.admit_after
        if after > 1:
            if self.sketch is None:
                self.sketch = FrequencySketch(self.admission.filter_width)
            ok = self.sketch.see(ids[new]) >= after
            stats.filtered += len(new) - int(ok.sum())
            new = new[ok]
        if self.limit is not None and self.n + len(new) > self.limit:
            room = max(0, self.limit - self.n)
            stats.dropped_full += len(new) - room
            new = new[:room]
        return new

    def _create(
        self,
        ids: np.ndarray,
        s: np.ndarray,
        new: np.ndarray,
        values: np.ndarray | None = None,
        time: float = 0.0,
    ) -> None:
        """Rows for `ids` in the next slots (`s[new]` gets them): `values` (float32), or the
        table's initial values, written at `time`. The slots are one run: written as slices."""
        assert self.values is not None
        k = len(ids)
        self._grow(self.n + k)
        slots = np.arange(self.n, self.n + k)
        run = slice(self.n, self.n + k)
        if values is None:
            values = initial_rows(self.init, ids, self.dim)
        self.values[run] = rowdtype.encode(values, self.dtype)
        if self.accum is not None:
            self.accum[run] = self.optimizer.initial_state
        self.ids[run] = ids
        self._touch(slots, time)
        self.index.add(ids, slots)
        self.n += k
        s[new] = slots

    def _touch(self, s: np.ndarray, time: float) -> None:
        """Slots `s` were written at `time`: their last push time (where expiry reads it) and
        their pages' dirty flags."""
        if self.has_seen:
            self.seen[s] = time
        self.dirty[s // self.page_rows] = True

    def _step(self, s: np.ndarray, g: np.ndarray) -> None:
        assert self.values is not None
        # a 16-bit table's rows widen to float32 for the step and round back once after it
        w = rowdtype.decode(self.values[s], self.dtype)
        acc = None if self.accum is None else self.accum[s]
        torchoptim.row_step(self.optimizer, w, acc, g)
        if acc is not None:
            self.accum[s] = acc
        self.values[s] = rowdtype.encode(w, self.dtype)

    # -- state -----------------------------------------------------------------------------------

    def tobytes(self) -> bytes:
        """The whole state (a multiple of 4 bytes: LMDB flushes store it as a shard's value)."""
        assert self.values is not None
        n = self.n
        sk = b"" if self.sketch is None else self.sketch.tobytes()
        parts = [
            _HEAD.pack(
                _MAGIC, 2, n, self.dim, self.accum is not None, len(sk) // 4, self.next_sweep
            ),
            self.ids[:n].astype("<i8").tobytes(),
            self.seen[:n].astype("<f8").tobytes() if self.has_seen else bytes(8 * n),
            self.values_f32(0, n).astype("<f4").tobytes(),
            b"" if self.accum is None else self.accum[:n].astype("<f4").tobytes(),
            sk,
        ]
        return b"".join(parts)

    def _parse_filter(
        self, ver: int, data: bytes, off: int, count: int
    ) -> tuple[FrequencySketch | None, int]:
        """The frequency filter's state at `off` of `data`, and the offset after it. Version 1
        held exact (id, count) pairs: they become the sketch's counts."""
        width = self.admission.filter_width
        filtered = self.admission.admit_after > 1
        sketch = None  # none yet: made at the first sighting
        if ver == 1:
            pend = np.frombuffer(data, "<i8", 2 * count, off).reshape(-1, 2)
            if filtered and len(pend):
                sketch = FrequencySketch(width)
                sketch.raise_to(pend[:, 0].copy(), pend[:, 1])
            return sketch, off + pend.nbytes
        if count:
            if count != DEPTH * width:
                raise ValueError(f"a filter of {count} counters, expected {DEPTH * width}")
            got = FrequencySketch.from_bytes(width, memoryview(data)[off : off + 4 * count])
            sketch = got if filtered else None
        return sketch, off + 4 * count

    def take_delta(self) -> RowDelta:
        """Owner thread, a flush's cut: copies of the pages holding a row pushed (or moved)
        since the previous cut (every page after a whole replacement); the next cut starts
        empty."""
        assert self.values is not None
        n, per = self.n, self.page_rows
        n_pages = -(-n // per)
        pages = np.arange(n_pages) if self.full else np.flatnonzero(self.dirty[:n_pages])
        lo = pages * per
        hi = np.minimum(lo + per, n)
        starts = np.concatenate([[0], np.cumsum(hi - lo)]).astype(np.int64)
        # the slots of those pages, in order: each page's run lo .. hi - 1
        s = np.arange(int(starts[-1]), dtype=np.int64) + np.repeat(lo - starts[:-1], hi - lo)
        delta = RowDelta(
            self.full,
            per,
            n_pages,
            pages.astype(np.int64),
            starts,
            self.ids[s],
            self.seen[s] if self.has_seen else None,
            self.values[s],
            None if self.accum is None else self.accum[s],
        )
        self.dirty[:] = False
        self.full = False
        return delta

    def header_bytes(self) -> np.ndarray:
        """The block's state but its rows (a flush's ``shards`` record; rows: `take_delta`), as
        uint8. Built in one allocation and filled by numpy's copy, which releases the GIL: a
        sketch of the widest filter is 16 MiB per bucket, and ``tobytes`` + ``bytes`` joins of
        it on the owner threads kept the event loop's thread off the GIL (issue 39)."""
        counts = None if self.sketch is None else self.sketch.counts.reshape(-1)
        n_counts = 0 if counts is None else counts.size
        head = _HEAD.pack(
            _HEADER_MAGIC, 2, 0, self.dim, self.accum is not None, n_counts, self.next_sweep
        )
        out = np.empty(len(head) + 4 * n_counts, np.uint8)
        out[: len(head)] = np.frombuffer(head, np.uint8)
        if counts is not None:
            out[len(head) :].view("<u4")[:] = counts
        return out

    def load_flushed(
        self,
        header: bytes,
        rows: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, bool] | None,
    ) -> None:
        """The state a flush left: `header_bytes` and the rows' (ids, seen, values, accum,
        intact: rowpages.SavedRows.parse); or an older format's whole block (`tobytes`). The
        next flush rewrites every page unless the pages read were intact."""
        magic = bytes(header[:4])
        if magic == _MAGIC:
            self.load_bytes(header)
            return
        _, ver, _, dim, has_acc, n_pend, next_sweep = _HEAD.unpack_from(header)
        if magic != _HEADER_MAGIC or ver != 2 or dim != self.dim:
            raise ValueError(f"not a row block header of dim {self.dim} (magic {magic!r})")
        sketch, end = self._parse_filter(2, header, _HEAD.size, n_pend)
        if end != len(header):
            raise ValueError(f"row block header of {len(header)} bytes")
        ids, seen, values, accum, intact = rows or (
            np.empty(0, np.int64),
            np.empty(0),
            np.empty((0, dim), self.vtype),
            None,
            True,
        )
        n = len(ids)
        self.n = n
        self.ids, self.values = ids, values.astype(self.vtype, copy=False)
        self.seen = seen if self.has_seen else np.empty(0, np.float64)
        if self.acc_width:
            self.accum = accum if accum is not None else np.zeros((n, self.acc_width), np.float32)
        self.dirty = np.zeros(0, bool)
        self._size_dirty()
        self.full = not intact
        self.index = RowIndex()
        self.index.rebuild(ids)
        self.sketch = sketch
        self.next_sweep = next_sweep

    @property
    def flush_nbytes(self) -> int:
        """About what the next flush writes of this block (a racy read: the chunk plan)."""
        per = 16 + self.dim * self.vtype.itemsize + self.acc_width * 4
        rows = self.n if self.full else int(np.count_nonzero(self.dirty)) * self.page_rows
        return rows * per + (0 if self.sketch is None else self.sketch.nbytes) + 64

    @staticmethod
    def state_of(data: bytes, acc_width: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The (values, optimizer state or None) of `to_bytes` output, as views, without a table
        (a checkpoint's restore checks them before it sends any). `acc_width`: the table's
        optimizer's state per row (Optimizer.row_state_width). ValueError on a bad record."""
        _m, _v, n, dim, has_acc, _p, _s = _HEAD.unpack_from(data)
        aw = acc_width if has_acc else 0
        off = _HEAD.size + 16 * n  # past ids (int64) and last seen (float64)
        if off + 4 * n * (dim + aw) > len(data):
            raise ValueError(f"row block of {len(data)} bytes is too short for {n} rows")
        values = np.frombuffer(data, "<f4", n * dim, off)
        accum = np.frombuffer(data, "<f4", n * aw, off + 4 * n * dim) if aw else None
        return values, accum

    def load_bytes(self, data: bytes) -> None:
        """Replaces the whole state by `to_bytes` output (raises ValueError on a bad record)."""
        magic, ver, n, dim, has_acc, n_pend, next_sweep = _HEAD.unpack_from(data)
        if magic != _MAGIC or ver not in (1, 2) or dim != self.dim:
            raise ValueError(f"not a row block of dim {self.dim} (magic {magic!r}, dim {dim})")
        off = _HEAD.size

        def take(dtype: str, count: int) -> np.ndarray:
            nonlocal off
            a = np.frombuffer(data, dtype, count, off).copy()
            off += a.nbytes
            return a

        ids = take("<i8", n)
        seen = take("<f8", n)
        values = take("<f4", n * dim).reshape(n, dim)
        aw = self.acc_width
        accum = take("<f4", n * aw).reshape(n, aw) if has_acc and aw else None
        sketch, off = self._parse_filter(ver, data, off, n_pend)
        if off != len(data):
            raise ValueError(f"row block of {len(data)} bytes, expected {off}")
        self.n = n
        self.ids, self.values = ids, rowdtype.encode(values, self.dtype)
        self.seen = seen if self.has_seen else np.empty(0, np.float64)
        if self.acc_width:
            self.accum = accum if accum is not None else np.zeros((n, self.acc_width), np.float32)
        self.index = RowIndex()
        self.index.rebuild(ids)
        self.sketch = sketch
        self.next_sweep = next_sweep
        # replaced whole: the next flush rewrites every row (and deletes the others on disk)
        self.dirty = np.zeros(0, bool)
        self._size_dirty()
        self.full = True

    def digest(self) -> bytes:
        """SHA-256 of the rows in id order (values, accumulators): equal on agreeing copies."""
        assert self.values is not None
        order = np.argsort(self.ids[: self.n], kind="stable")
        h = hashlib.sha256()
        h.update(self.ids[: self.n][order].tobytes())
        h.update(np.ascontiguousarray(self.values[: self.n][order]).tobytes())
        if self.accum is not None:
            h.update(np.ascontiguousarray(self.accum[: self.n][order]).tobytes())
        return h.digest()

    @property
    def nbytes(self) -> int:
        per = self.dim * self.vtype.itemsize + self.acc_width * 4 + 16
        return self.n * per

    def values_f32(self, lo: int, hi: int) -> np.ndarray:
        """Rows `lo` .. `hi` - 1's values as float32 (a view for a float32 table)."""
        assert self.values is not None
        return rowdtype.decode(self.values[lo:hi], self.dtype)

    @property
    def held_bytes(self) -> int:
        """What the block's arrays and index take (their spare room included)."""
        arrays = (self.values, self.accum, self.ids, self.seen, self.dirty)
        return sum(a.nbytes for a in arrays if a is not None) + self.index.nbytes
