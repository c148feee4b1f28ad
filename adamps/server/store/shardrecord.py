"""A shard's LMDB record, built in one allocation (issue 30).

A record is a sealed (``adamps.server.store.checksum``) ``<QQQ`` header (version, value bytes,
accumulator bytes) + values + accumulator. ``pack`` copies the shard's arrays once, straight into
the final record, on the shard's owner thread (that copy is the flush's consistent snapshot), and
seals it in place: no ``tobytes`` copy, no ``bytes.join`` copy. A flush therefore holds one copy of
what it writes, not three; LMDB's ``put`` takes the record's buffer as it is.

The record is a numpy uint8 array, not a ``bytearray``: ``bytearray(n)`` zero-fills its n bytes
(and takes their page faults) holding the GIL, and the copy into it then writes them again.
``np.empty`` touches nothing, and numpy's copy, which takes the page faults, and xxh3 run
without the GIL: a flush of 16 MiB row-block headers on the owner threads held the event
loop's thread off the GIL for tens of milliseconds per record on a loaded machine (issue 39).

Pure: no IO, no clock.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from adamps.server.store.checksum import MAGIC, digest

HEADER = struct.Struct("<QQQ")
_SEAL = len(MAGIC) + 8


def _nbytes(x: Any) -> int:
    n = x.nbytes
    return int(n() if callable(n) else n)


def record_bytes(value: Any, accum: np.ndarray | None) -> int:
    """The size of the record of a shard with these arrays (about, for a row block)."""
    return _SEAL + HEADER.size + _nbytes(value) + (0 if accum is None else accum.nbytes)


def pack(version: int, value: Any, accum: np.ndarray | None) -> np.ndarray:
    """The sealed record of (version, value, accum): one allocation, one copy of the arrays.
    A value that is not an array (an embedding table's row block) is serialized by its own
    ``tobytes`` first."""
    if not isinstance(value, np.ndarray):
        value = np.frombuffer(value.tobytes(), np.uint8)
    nv = value.nbytes
    na = 0 if accum is None else accum.nbytes
    rec = np.empty(_SEAL + HEADER.size + nv + na, np.uint8)
    HEADER.pack_into(rec, _SEAL, version, nv, na)
    off = _SEAL + HEADER.size
    rec[off : off + nv] = value.view(np.uint8).reshape(-1)
    if accum is not None:
        rec[off + nv :] = accum.view(np.uint8).reshape(-1)
    rec[: len(MAGIC)] = np.frombuffer(MAGIC, np.uint8)
    rec[len(MAGIC) : _SEAL] = np.frombuffer(digest(rec[_SEAL:]).to_bytes(8, "little"), np.uint8)
    return rec


def pack_bytes(
    version: int, value: bytes | memoryview | np.ndarray, accum: bytes | None
) -> np.ndarray:
    """`pack` of raw bytes (a tensor's initial state, a migration, a row block's header)."""
    v = np.frombuffer(value, np.uint8)
    a = None if not accum else np.frombuffer(accum, np.uint8)
    return pack(version, v, a)
