"""A row's initial value is a function of (seed, id) only, and every copy, version and restart
must draw the same bits: adamps/tables.py's in-place draw against the formula written out."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adamps.tables import buckets_of, initial_rows

G, M1, M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MASK = (1 << 64) - 1


def mix(x: int) -> int:
    """SplitMix64's output function, on Python ints."""
    z = (x + G) & MASK
    z = ((z ^ (z >> 30)) * M1) & MASK
    z = ((z ^ (z >> 27)) * M2) & MASK
    return z ^ (z >> 31)


def reference(init: dict, i: int, dim: int) -> np.ndarray:
    key = mix(mix(i & MASK) ^ init["seed"])
    u = [(mix((key + j * G) & MASK) >> 11) * (1.0 / (1 << 53)) for j in range(1, 2 * dim + 1)]
    u = np.array(u, np.float64)
    if init["kind"] == "uniform":
        return (init["low"] + (init["high"] - init["low"]) * u[:dim]).astype(np.float32)
    z = np.sqrt(-2.0 * np.log1p(-u[:dim])) * np.cos(2.0 * math.pi * u[dim:])
    return (init["mean"] + init["std"] * z).astype(np.float32)


@pytest.mark.parametrize("dim", [1, 8, 16])
@pytest.mark.parametrize(
    "init",
    [
        {"kind": "normal", "mean": 0.0, "std": 0.01, "seed": 1},
        {"kind": "uniform", "low": -0.5, "high": 0.5, "seed": 7},
    ],
)
def test_initial_rows_are_the_formulas_bits(dim: int, init: dict) -> None:
    ids = np.array([0, 1, 2, 7, 1_000_099, -5, 2**62 + 3], np.int64)
    got = initial_rows(init, ids, dim)
    want = np.stack([reference(init, int(i), dim) for i in ids])
    assert got.tobytes() == want.tobytes()


def test_buckets_are_the_formulas() -> None:
    ids = np.array([0, 1, 5, 123_456_789, -1], np.int64)
    salt = 0x5BD1E9955BD1E995
    want = [mix((int(i) & MASK) ^ salt) % 64 for i in ids]
    assert buckets_of(ids, 64).tolist() == want
