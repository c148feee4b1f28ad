"""What a flush writes of a row shard (issue 23): the rows touched since the previous flush and
the ids removed since (expiry), or every row when the shard's state was replaced whole (a state
transfer, a checkpoint's restore, a block loaded from an older format). So a flush after k rows
were pushed writes O(k) bytes, not the bucket's whole row block.

In LMDB (adamps/server/persist.py) a row is one record of the ``rows`` database, keyed
``<row shard id>/<id: 8 bytes big-endian>``, sealed with a checksum like every record:
``seen`` (float64, the primary's time of its last push) + values (float32 x dim) + the Adagrad
accumulator (float32 x dim, when the optimizer has one). The block's own small state (the
frequency counts, the next expiry sweep) stays the row shard's record in ``shards``, in the
same transaction.

Pure: no IO, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from adamps.server.checksum import MAGIC


@dataclass
class RowDelta:
    """The rows a flush writes of one row shard (copies, taken on its owner thread)."""

    #: every row of the shard is here: the flush deletes the shard's other row records
    full: bool
    ids: np.ndarray  #: int64 [k]
    seen: np.ndarray  #: float64 [k]
    values: np.ndarray  #: float32 [k, dim]
    accum: np.ndarray | None  #: float32 [k, dim] or None
    #: ids whose rows were removed (expired) and not created again since
    removed: np.ndarray

    def after(self, older: RowDelta) -> RowDelta:
        """This delta applied on top of an `older` one not written yet (a failed flush's): one
        delta with the same effect."""
        if self.full:
            return self
        keep = ~np.isin(older.ids, np.concatenate([self.ids, self.removed]))
        removed = np.union1d(older.removed[~np.isin(older.removed, self.ids)], self.removed)
        return RowDelta(
            older.full,
            np.concatenate([older.ids[keep], self.ids]),
            np.concatenate([older.seen[keep], self.seen]),
            np.concatenate([older.values[keep], self.values]),
            None if self.accum is None else np.concatenate([older.accum[keep], self.accum]),  # type: ignore[index]
            removed.astype(np.int64),
        )

    def payloads(self) -> np.ndarray:
        """[k, row record payload bytes] uint8: seen, values, accumulator of each row."""
        k = len(self.ids)
        row = self.values.shape[1] * 4
        parts = [
            np.ascontiguousarray(self.seen, "<f8").view(np.uint8).reshape(k, 8),
            np.ascontiguousarray(self.values, "<f4").view(np.uint8).reshape(k, row),
        ]
        if self.accum is not None:
            aw = self.accum.shape[1] * 4  # the optimizer's state per row (1 for row-wise Adagrad)
            parts.append(np.ascontiguousarray(self.accum, "<f4").view(np.uint8).reshape(k, aw))
        return np.concatenate(parts, axis=1)

    def records(self, sid: str) -> list[tuple[memoryview, memoryview]]:
        """(key, sealed record) of every row, in key order within the shard: views into two
        buffers built in a few vectorised passes (a row's only Python-level work is its
        checksum), so a flush of k rows costs about a microsecond per row."""
        k = len(self.ids)
        if not k:
            return []
        prefix = row_prefix(sid)
        kw = len(prefix) + 8
        keys = np.empty((k, kw), np.uint8)
        keys[:, : len(prefix)] = np.frombuffer(prefix, np.uint8)
        keys[:, len(prefix) :] = (
            np.ascontiguousarray(self.ids, np.int64).astype(">i8").view(np.uint8).reshape(k, 8)
        )
        pay = self.payloads()
        w = pay.shape[1]
        recs = np.empty((k, SEAL_BYTES + w), np.uint8)
        recs[:, : len(MAGIC)] = np.frombuffer(MAGIC, np.uint8)
        recs[:, SEAL_BYTES:] = pay
        pv = memoryview(recs).cast("B")
        h = xxhash.xxh3_64_intdigest
        sums = np.fromiter(
            (
                h(pv[i * (SEAL_BYTES + w) + SEAL_BYTES : (i + 1) * (SEAL_BYTES + w)])
                for i in range(k)
            ),
            np.uint64,
            k,
        )
        recs[:, len(MAGIC) : SEAL_BYTES] = sums.astype("<u8").view(np.uint8).reshape(k, 8)
        kv = memoryview(keys).cast("B")
        rw = SEAL_BYTES + w
        return [(kv[i * kw : (i + 1) * kw], pv[i * rw : (i + 1) * rw]) for i in range(k)]

    @property
    def nbytes(self) -> int:
        """About what writing it costs (the flush's chunk plan)."""
        per = (
            8
            + 16
            + 40
            + (self.values.shape[1] + (0 if self.accum is None else self.accum.shape[1])) * 4
        )
        return len(self.ids) * per + len(self.removed) * 48


#: a sealed record's head: MAGIC and the xxh3-64 of the payload (adamps.server.checksum)
SEAL_BYTES = len(MAGIC) + 8


def row_prefix(sid: str) -> bytes:
    """The key prefix of a row shard's row records."""
    return sid.encode() + b"/"


def id_keys(ids: np.ndarray) -> list[bytes]:
    """The 8-byte key suffix of each id."""
    raw = np.ascontiguousarray(ids, np.int64).astype(">i8").tobytes()
    return [raw[i : i + 8] for i in range(0, len(raw), 8)]


def id_of_key(key: bytes) -> int:
    return int.from_bytes(key[-8:], "big", signed=True)


def sid_of_key(key: bytes) -> str:
    """The row shard id of a row record's key (its id may hold any byte: cut by length)."""
    return key[:-9].decode(errors="replace")


def parse_rows(
    ids: list[int], payloads: list[bytes | memoryview], dim: int, acc_width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(ids, seen, values, accum) of row records' payloads (raises ValueError on a bad size);
    `acc_width` is the optimizer's state per row (adamps.optspec.Optimizer.row_state_width), 0: none."""
    width = 8 + (dim + acc_width) * 4
    k = len(ids)
    raw = np.frombuffer(b"".join(payloads), np.uint8)
    if raw.size != k * width:
        raise ValueError(f"{k} row records of {raw.size} bytes, expected {width} bytes each")
    raw = raw.reshape(k, width)
    seen = raw[:, :8].copy().view("<f8").reshape(k).astype(np.float64)
    values = raw[:, 8 : 8 + dim * 4].copy().view("<f4").reshape(k, dim).astype(np.float32)
    accum = None
    if acc_width:
        accum = raw[:, 8 + dim * 4 :].copy().view("<f4").reshape(k, acc_width).astype(np.float32)
    return np.array(ids, np.int64), seen, values, accum
