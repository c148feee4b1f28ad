"""Checksummed records: every value this server persists or transfers carries a 64-bit xxh3 of
its bytes, so a bit flipped on disk, in the page cache or on the wire is caught where it enters,
instead of becoming the cluster's truth (issue 29).

A sealed record is ``MAGIC`` (8 bytes) + xxh3_64 of the payload (8 bytes, little-endian) + the
payload. The magic cannot start a record of the previous format (a shard record began with its
version as a little-endian uint64, far below 2^56; JSON and msgpack records begin with ``[``,
``{`` or a msgpack map byte), so ``unseal`` tells a sealed record from a legacy one; whether a
legacy record is acceptable at all is the environment's decision (its format stamp, see
``adamps.server.storage.persist``), never the record's: a flipped magic byte must not turn a sealed
record into an unverified one.

Pure: no IO, no clock.
"""

from __future__ import annotations

import xxhash

MAGIC = b"\xffADAMPS\x01"
_HEAD = len(MAGIC) + 8


class CorruptRecord(ValueError):
    """A record whose checksum does not match its bytes (or that is too short to hold one)."""


def hasher() -> xxhash.xxh3_64:
    """An incremental ``digest``: update() it with the parts in order, then intdigest()."""
    return xxhash.xxh3_64()


def digest(*parts: bytes | memoryview) -> int:
    """xxh3_64 of the concatenation of `parts` (no copy of them is made)."""
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


def seal(*parts: bytes | memoryview) -> bytes:
    """The sealed record of the concatenated `parts`."""
    return b"".join((MAGIC, digest(*parts).to_bytes(8, "little"), *parts))


def is_sealed(rec: bytes | memoryview) -> bool:
    return bytes(rec[: len(MAGIC)]) == MAGIC


def unseal(rec: bytes | memoryview) -> memoryview:
    """The payload of a sealed record, verified; raises CorruptRecord when it does not verify
    (a record without the magic included)."""
    view = memoryview(rec)
    if not is_sealed(view):
        raise CorruptRecord("record has no checksum header (damaged, or not written by adamps)")
    if len(view) < _HEAD:
        raise CorruptRecord("record shorter than its checksum header")
    want = int.from_bytes(view[len(MAGIC) : _HEAD], "little")
    payload = view[_HEAD:]
    got = digest(payload)
    if got != want:
        raise CorruptRecord(f"checksum mismatch: stored {want:016x}, computed {got:016x}")
    return payload
