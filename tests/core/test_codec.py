"""Strom's compressed updates (Interspeech 2015, 2.5): both encodings against a plain reference
decoder written from the specification (docs/protocol-ps.md, push_compressed), edge cases, and
hypothesis round trips."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from adamps.compression import codec

# -- reference decoders: one element at a time, straight from the text of the specification --


def ref_words(words: list[int]) -> list[tuple[int, bool]]:
    return [(w >> 1, bool(w & 1)) for w in words]


def ref_rice(data: bytes, n: int, k: int) -> list[tuple[int, bool]]:
    bits = [(byte >> (7 - j)) & 1 for byte in data for j in range(8)]
    pos = 0
    quotients = []
    for _ in range(n):  # n unary codes: ones, then a zero
        q = 0
        while bits[pos] == 1:
            q += 1
            pos += 1
        pos += 1
        quotients.append(q)
    gaps = []
    for q in quotients:  # n remainders of k bits, most significant first
        r = 0
        for _ in range(k):
            r = (r << 1) | bits[pos]
            pos += 1
        gaps.append((q << k) | r)
    signs = [bool(bits[pos + i]) for i in range(n)]
    assert len(bits) - (pos + n) < 8 and not any(bits[pos + n :]), "padding is zero bits"
    out, prev = [], -1
    for g, s in zip(gaps, signs, strict=True):
        prev = prev + g + 1
        out.append((prev, s))
    return out


def both(idx: np.ndarray, neg: np.ndarray, size: int, k: int | None = None) -> None:
    """Encodes both ways; the reference and the vectorized decoders both give idx, neg back."""
    want = list(zip(idx.tolist(), neg.tolist(), strict=True))
    words = codec.pack_words(idx, neg)
    assert words.dtype == np.uint32
    assert ref_words(words.tolist()) == want
    i2, n2 = codec.unpack_words(words, size)
    assert i2.tolist() == idx.tolist() and n2.tolist() == neg.tolist()
    data, kk = codec.rice_encode(idx, neg, k, size=size)
    assert ref_rice(data, idx.size, kk) == want
    i3, n3 = codec.rice_decode(data, idx.size, kk, size)
    assert i3.tolist() == idx.tolist() and n3.tolist() == neg.tolist()
    assert codec.rice_size(idx, kk) == len(data) + 9


def test_empty_update() -> None:
    idx, neg = np.zeros(0, np.int64), np.zeros(0, bool)
    both(idx, neg, 100)
    assert codec.rice_encode(idx, neg, size=100)[0] == b""
    assert codec.pack_words(idx, neg).size == 0
    assert not codec.decode_dense(np.zeros(0, np.uint32), 0.5, 10).any()


@pytest.mark.parametrize("size", [1, 7, 8, 9, 1000])
def test_every_element(size: int) -> None:
    idx = np.arange(size)
    neg = (idx % 3) == 0
    both(idx, neg, size)
    assert codec.rice_parameter(size, size) == 0  # every gap is 0: one bit of unary each
    data, k = codec.rice_encode(idx, neg, size=size)
    assert len(data) == (2 * size + 7) // 8


@pytest.mark.parametrize("size", [1, 2, 1000, 262_144])
def test_last_index_only(size: int) -> None:
    for k in (None, 0, 5, 31):
        both(np.array([size - 1]), np.array([True]), size, k)


def test_largest_31_bit_index() -> None:
    idx = np.array([0, codec.MAX_INDEX])
    neg = np.array([False, True])
    words = codec.pack_words(idx, neg)
    assert words.tolist() == [0, 0xFFFFFFFF]
    assert codec.unpack_words(words)[0].tolist() == idx.tolist()
    with pytest.raises(codec.CodecError):
        codec.pack_words(np.array([codec.MAX_INDEX + 1]), np.array([False]))


def test_negative_values_quantize_to_minus_tau_and_keep_the_rest() -> None:
    r = np.array([-3.0, -0.5, 0.5, 2.0, -1.0, 1.0, 0.0], np.float32)
    idx, neg = codec.quantize(r, 1.0)
    assert idx.tolist() == [0, 3, 4, 5]
    assert neg.tolist() == [True, False, True, False]
    assert r.tolist() == [-2.0, -0.5, 0.5, 1.0, 0.0, 0.0, 0.0]
    dense = codec.decode_dense(codec.pack_words(idx, neg), 1.0, 7)
    assert dense.tolist() == [-1.0, 0, 0, 1.0, -1.0, 1.0, 0]


def test_adaptive_tau_sends_the_target_fraction() -> None:
    r = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    tau = codec.adaptive_tau(r, 0.01)
    assert np.count_nonzero(np.abs(r) >= tau) == 100
    assert codec.adaptive_tau(np.zeros(10, np.float32), 0.5) == 0.0


@pytest.mark.parametrize(
    "words",
    [[4, 2], [2, 2], [20]],  # decreasing, repeated, beyond the shard (index 10 of 10)
)
def test_bad_words_are_refused(words: list[int]) -> None:
    with pytest.raises(codec.CodecError):
        codec.unpack_words(np.array(words, np.uint32), 10)


def test_bad_rice_streams_are_refused() -> None:
    idx = np.array([1, 5, 9])
    data, k = codec.rice_encode(idx, np.zeros(3, bool), 1)
    with pytest.raises(codec.CodecError):
        codec.rice_decode(data, 3, k, 9)  # index 9 in a shard of 9
    with pytest.raises(codec.CodecError):
        codec.rice_decode(data[:1], 3, k, 100)  # truncated
    with pytest.raises(codec.CodecError):
        codec.rice_decode(data + b"\0", 3, k, 100)  # a whole extra byte
    with pytest.raises(codec.CodecError):
        codec.rice_decode(b"\xff\xff", 3, k, 100)  # no terminating zeros
    with pytest.raises(codec.CodecError):
        codec.rice_decode(data, 3, 32, 100)
    with pytest.raises(codec.CodecError):
        codec.rice_decode(b"", 11, 0, 10)
    # a huge remainder in one code and small later ones: caught per gap, before any overflow
    huge, k = codec.rice_encode(np.array([(1 << 31) - 2, (1 << 31) - 1]), np.zeros(2, bool), 31)
    with pytest.raises(codec.CodecError):
        codec.rice_decode(huge, 2, k, 1000)


def test_rice_at_one_percent_is_about_ten_bits_per_update() -> None:
    """Strom 2.5: Golomb-Rice coding of the gaps, 10-11 bits per update."""
    rng = np.random.default_rng(2)
    size = 262_144
    idx = np.sort(rng.choice(size, size // 100, replace=False))
    data, k = codec.rice_encode(idx, rng.random(idx.size) < 0.5, size=size)
    bits = 8 * len(data) / idx.size
    assert 9.0 < bits < 11.0, bits


@hs.composite
def updates(draw: hs.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    size = draw(hs.integers(1, 5000))
    chosen = draw(hs.sets(hs.integers(0, size - 1), max_size=min(size, 300)))
    idx = np.array(sorted(chosen), np.int64)
    neg = np.array(draw(hs.lists(hs.booleans(), min_size=idx.size, max_size=idx.size)), bool)
    return idx, neg, size


@settings(max_examples=150, deadline=None)
@given(updates(), hs.one_of(hs.none(), hs.integers(0, 14)))
def test_round_trip(u: tuple[np.ndarray, np.ndarray, int], k: int | None) -> None:
    idx, neg, size = u
    both(idx, neg, size, k)


@settings(max_examples=100, deadline=None)
@given(
    hs.lists(hs.floats(-100, 100, width=32), min_size=1, max_size=400),
    hs.floats(0.125, 50, width=32),
)
def test_quantize_keeps_the_sum_and_leaves_small_residuals(vals: list[float], tau: float) -> None:
    """Error feedback: sent + residual == input, exactly (one float32 subtraction per element),
    and a sent element's residual moved by tau towards zero."""
    r = np.array(vals, np.float32)
    before = r.copy()
    idx, neg = codec.quantize(r, tau)
    sent = codec.decode_dense(codec.pack_words(idx, neg), tau, r.size)
    np.testing.assert_array_equal(np.abs(before) >= np.float32(tau), sent != 0)
    np.testing.assert_allclose(sent.astype(np.float64) + r, before, rtol=0, atol=1e-4)
    untouched = sent == 0
    np.testing.assert_array_equal(r[untouched], before[untouched])


def test_adaptive_tau_on_a_large_residual_samples_close_to_the_target() -> None:
    r = np.random.default_rng(3).standard_normal(1 << 20).astype(np.float32)
    tau = codec.adaptive_tau(r, 0.01)
    sent = np.count_nonzero(np.abs(r) >= tau) / r.size
    assert 0.008 < sent < 0.012
