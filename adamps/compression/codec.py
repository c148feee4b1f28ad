"""Strom's compressed updates (Interspeech 2015, 2.4-2.5): pure numpy, no IO, no state.

A compressed update of one shard is a threshold ``tau > 0`` and a set of elements each moved by
``+tau`` or ``-tau``. It travels in one of two encodings (docs/protocol-ps.md, ``push_compressed``):

- **words**: one uint32 per sent element, ``word = index << 1 | negative`` (a 31-bit index and the
  sign in the low bit), sorted by index. Sorted words are strictly increasing exactly when the
  indices are unique, which the server checks and relies on (a scatter-add by fancy indexing).
- **rice**: Golomb-Rice coding of the gaps between sorted indices (Strom 2.5: "10-11 bits per
  update"). With ``gap_i = index_i - index_(i-1) - 1`` (``index_(-1) = -1``) and parameter ``k``,
  each gap is a quotient ``gap >> k`` in unary (that many 1 bits, then a 0) and a remainder of
  ``k`` bits. The streams are laid out one after another instead of interleaved (the same bits,
  but every stream decodes with whole-array numpy operations): all n unary codes, then the n
  k-bit remainders (most significant bit first), then n sign bits (1 = negative), packed into
  bytes most significant bit first (``np.packbits``), zero-padded to a whole byte.

Nothing here loops over elements in Python.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: largest index a word can carry (31 bits)
MAX_INDEX = (1 << 31) - 1
#: largest Rice parameter (remainders of up to 31 bits)
MAX_RICE_K = 31


class CodecError(ValueError):
    """A compressed update that does not decode to unique indices below the shard's size."""


# -- threshold and quantize (the trainer side) ----------------------------------------------------


#: quantize() works through larger residuals in pieces of this many elements (kept in cache)
CHUNK = 1 << 16


def true_indices(mask: np.ndarray) -> np.ndarray:
    """``np.flatnonzero`` of a 1-D bool array, faster when few are set: the mask is scanned as
    uint64 words (8 flags each), and only the words with a flag set are expanded."""
    n8 = mask.size - mask.size % 8
    if n8 == 0:
        return np.flatnonzero(mask)
    words = mask[:n8].view(np.uint64)
    hit = np.flatnonzero(words != 0)
    flags = np.flatnonzero(words[hit].view(np.bool_))
    idx = hit[flags >> 3] * 8 + (flags & 7)
    if n8 < mask.size:
        idx = np.concatenate([idx, np.flatnonzero(mask[n8:]) + n8])
    return idx


def quantize(
    residual: np.ndarray, tau: float, scratch: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Strom 2.6 steps 6-7, vectorized: every element with ``|r| >= tau`` is sent as ``sign(r) *
    tau`` and ``tau`` is taken out of it *in place* (error feedback: the rest stays).

    ``residual`` is a flat float32 array; ``scratch`` an optional float32 buffer of at least
    ``min(size, CHUNK)`` elements. Returns (sorted int64 indices, bool array: negative)."""
    r = residual.reshape(-1)
    n = r.size
    t = np.float32(tau)
    m = min(n, CHUNK)
    mag = scratch[:m] if scratch is not None and scratch.size >= m else np.empty(m, np.float32)
    mask = np.empty(m, bool)
    found = []
    # Piece by piece, so |r| and the mask stay in cache: one pass over the residual in memory.
    for lo in range(0, n, CHUNK):
        piece = r[lo : lo + CHUNK]
        k = piece.size
        np.abs(piece, out=mag[:k])
        np.greater_equal(mag[:k], t, out=mask[:k])
        i = true_indices(mask[:k])
        if i.size:
            found.append(i + lo if lo else i)
    idx = np.concatenate(found) if len(found) > 1 else found[0] if found else np.zeros(0, np.intp)
    vals = r[idx]
    neg = vals < 0
    # r[idx] -= sign * tau, as one gather and one scatter of the sent elements only
    np.subtract(vals, np.where(neg, -t, t), out=vals)
    r[idx] = vals
    return idx.astype(np.int64, copy=False), neg


#: above this many elements, adaptive_tau estimates the quantile on a strided sample
EXACT_QUANTILE_MAX = 1 << 17


def adaptive_tau(residual: np.ndarray, fraction: float, scratch: np.ndarray | None = None) -> float:
    """The threshold that sends ``ceil(fraction * size)`` elements of the residual: the magnitude
    of its k-th largest element (``np.partition``, linear time). A residual of more than
    ``EXACT_QUANTILE_MAX`` elements is sampled (every step-th element, at least 65,536 of them),
    so the fraction sent is then close to, not exactly, the target. 0.0 for an all-zero residual
    (then nothing is sent: ``tau`` must be > 0)."""
    r = residual.reshape(-1)
    if r.size > EXACT_QUANTILE_MAX:
        r = r[:: r.size // 65_536]
        scratch = None
    n = r.size
    if n == 0:
        return 0.0
    k = min(n, max(1, math.ceil(fraction * n)))
    mag = np.abs(r, out=scratch) if scratch is not None else np.abs(r)
    return float(np.partition(mag, n - k)[n - k])


# -- words ------------------------------------------------------------------------------------------


def pack_words(idx: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """Sorted unique indices and signs as uint32 words ``index << 1 | negative``."""
    if idx.size and int(idx[-1]) > MAX_INDEX:
        raise CodecError(f"index {int(idx[-1])} does not fit in 31 bits")
    words = idx.astype(np.uint32)
    words <<= np.uint32(1)
    words |= neg.astype(np.uint32)
    return words


def unpack_words(words: np.ndarray, size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(int64 indices, bool negative) of words; with ``size``, checks that the indices are
    strictly increasing (unique) and below ``size`` (CodecError otherwise)."""
    w = np.asarray(words, dtype=np.uint32).reshape(-1)
    if size is not None and w.size > size:  # before expanding the words to int64 indices
        raise CodecError(f"{w.size} elements for a shard of {size}")
    idx = (w >> np.uint32(1)).astype(np.int64)
    neg = (w & np.uint32(1)).astype(bool)
    if size is not None:
        check_indices(idx, size)
    return idx, neg


def check_indices(idx: np.ndarray, size: int) -> None:
    if idx.size == 0:
        return
    if idx.size > size:
        raise CodecError(f"{idx.size} elements for a shard of {size}")
    if int(idx[0]) < 0 or int(idx[-1]) >= size:
        raise CodecError(f"index out of range for a shard of {size} elements")
    if idx.size > 1 and not bool(np.all(idx[1:] > idx[:-1])):
        raise CodecError("indices are not strictly increasing (sorted and unique)")


def decode_dense(words: np.ndarray, tau: float, size: int) -> np.ndarray:
    """The dense float32 delta a compressed update stands for (zeros where nothing was sent)."""
    idx, neg = unpack_words(words, size)
    out = np.zeros(size, np.float32)
    t = np.float32(tau)
    out[idx] = np.where(neg, -t, t)
    return out


# -- Golomb-Rice ------------------------------------------------------------------------------------


def rice_parameter(n: int, size: int) -> int:
    """A near-optimal Rice parameter for n indices spread over ``size`` positions: the gaps are
    roughly geometric with mean m = size / n - 1, for which k = max(0, ceil(log2(m * ln 2)))
    (Gallager and van Voorhis) is optimal."""
    if n == 0:
        return 0
    mean_gap = max(size / n - 1.0, 0.0)
    if mean_gap * math.log(2) <= 1.0:
        return 0
    return min(MAX_RICE_K, math.ceil(math.log2(mean_gap * math.log(2))))


def rice_bits(idx: np.ndarray, k: int) -> int:
    """Bits of the Rice coding of these sorted indices with parameter k (signs included)."""
    if idx.size == 0:
        return 0
    gaps = np.diff(idx, prepend=-1) - 1
    return int((gaps >> k).sum()) + idx.size * (k + 2)


def rice_encode(
    idx: np.ndarray, neg: np.ndarray, k: int | None = None, size: int = 0
) -> tuple[bytes, int]:
    """(packed bytes, k) of sorted unique indices and their signs. Without ``k``, the parameter
    comes from :func:`rice_parameter` (``size``: the shard's element count; default: the last
    index + 1)."""
    n = idx.size
    if k is None:
        k = rice_parameter(n, size or (int(idx[-1]) + 1 if n else 0))
    if not 0 <= k <= MAX_RICE_K:
        raise CodecError(f"Rice parameter must be in 0..{MAX_RICE_K}, got {k}")
    if n == 0:
        return b"", k
    gaps = np.diff(idx.astype(np.int64), prepend=-1) - 1
    if int(gaps.min()) < 0:
        raise CodecError("indices are not strictly increasing (sorted and unique)")
    q = gaps >> k
    n_unary = int(q.sum()) + n
    total = n_unary + n * k + n
    bits = np.empty(total, np.uint8)
    # unary: every bit 1 except the zero ending each code (code i ends at sum(q[:i+1] + 1) - 1)
    bits[:n_unary] = 1
    bits[np.cumsum(q + 1) - 1] = 0
    if k:
        bits[n_unary : n_unary + n * k] = _low_bits(gaps & ((1 << k) - 1), k).reshape(-1)
    bits[n_unary + n * k :] = neg
    return np.packbits(bits).tobytes(), k


def _low_bits(values: np.ndarray, k: int) -> np.ndarray:
    """The k low bits of each value (0 <= value < 2^k, k <= 31) as an (n, k) uint8 matrix, most
    significant first: big-endian bytes unpacked (np.unpackbits), not shifts per bit."""
    width = 8 if k <= 8 else 16 if k <= 16 else 32
    be = values.astype(f">u{width // 8}")
    return np.unpackbits(be.view(np.uint8).reshape(-1, width // 8), axis=1)[:, width - k :]


def _from_bits(bits: np.ndarray, k: int) -> np.ndarray:
    """Inverse of _low_bits: an (n, k) 0/1 uint8 matrix as int64 values."""
    width = 8 if k <= 8 else 16 if k <= 16 else 32
    padded = np.zeros((bits.shape[0], width), np.uint8)
    padded[:, width - k :] = bits
    return np.packbits(padded, axis=1).view(f">u{width // 8}").reshape(-1).astype(np.int64)


def rice_decode(
    data: bytes | np.ndarray, n: int, k: int, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(int64 indices, bool negative) of n Rice-coded updates with parameter k; CodecError if the
    bytes do not hold n codes or an index falls outside a shard of ``size`` elements."""
    if n < 0 or n > size:
        raise CodecError(f"{n} elements for a shard of {size}")
    if not 0 <= k <= MAX_RICE_K:
        raise CodecError(f"Rice parameter must be in 0..{MAX_RICE_K}, got {k}")
    buf = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
    if n == 0:
        if buf.size:
            raise CodecError("bytes given for 0 elements")
        return np.zeros(0, np.int64), np.zeros(0, bool)
    # Bounded before anything expands (issue 28: a 16 MiB body of zero bytes with n = 1 was
    # unpacked to 128 M bits and their zero positions, 1.3 GB, on the event loop). n codes whose
    # indices stay below `size` have gaps summing to at most size - n, so their unary quotients
    # sum to at most (size - n) >> k: a longer stream cannot be valid, and is refused unread.
    max_unary = ((size - n) >> k) + n
    max_bytes = (max_unary + n * k + n + 7) // 8
    if buf.size > max_bytes:
        raise CodecError(
            f"Rice stream of {buf.size} bytes is longer than {n} codes with k={k} in a shard "
            f"of {size} elements can be ({max_bytes} bytes at most)"
        )
    if buf.size * 8 < n * (k + 2):
        raise CodecError(f"Rice stream of {buf.size} bytes does not hold {n} codes with k={k}")
    bits = np.unpackbits(buf)
    # The first n zero bits end the n unary codes (the unary stream comes first, and is at
    # most max_unary bits long).
    zeros = np.flatnonzero(bits[:max_unary] == 0)[:n]
    if zeros.size < n:
        raise CodecError("truncated Rice stream (fewer unary codes than elements)")
    n_unary = int(zeros[-1]) + 1
    end = n_unary + n * k + n
    if end > bits.size or (bits.size - end) >= 8:
        raise CodecError(f"Rice stream of {buf.size} bytes does not hold {n} codes with k={k}")
    q = np.diff(zeros, prepend=-1) - 1
    if int(q.max()) >= size:  # a gap of at least size: out of range (and no int64 overflow below)
        raise CodecError(f"index out of range for a shard of {size} elements")
    gaps = q.astype(np.int64) << k
    if k:
        gaps |= _from_bits(bits[n_unary : n_unary + n * k].reshape(n, k), k)
    if int(gaps.max()) >= size:
        raise CodecError(f"index out of range for a shard of {size} elements")
    idx = np.cumsum(gaps + 1) - 1
    neg = bits[n_unary + n * k : end].astype(bool)
    if int(idx[-1]) >= size:
        raise CodecError(f"index out of range for a shard of {size} elements")
    return idx, neg


def words_size(n: int) -> int:
    """Bytes of n updates as words, plus the shard's tau as a float32."""
    return 4 * n + 4


def rice_size(idx: np.ndarray, k: int) -> int:
    """Bytes of the Rice coding, plus tau (float32) and the count and k (a uint32 and a byte)."""
    return (rice_bits(idx, k) + 7) // 8 + 4 + 4 + 1


def parse_taus(entries: Sequence[str]) -> tuple[float | None, dict[str, float]]:
    """``--compress-tau`` entries: ``TAU`` (every tensor) or ``TENSOR=TAU``; (default, per tensor).
    ValueError on a malformed entry or a tau that is not a finite number > 0."""
    default: float | None = None
    per: dict[str, float] = {}
    for entry in entries:
        name, sep, value = entry.rpartition("=")
        try:
            tau = float(value)
        except ValueError:
            raise ValueError(f"compress_tau entry {entry!r}: {value!r} is not a number") from None
        if not np.isfinite(tau) or tau <= 0:
            raise ValueError(f"compress_tau entry {entry!r}: tau must be a finite number > 0")
        if sep:
            per[name] = tau
        else:
            default = tau
    return default, per
