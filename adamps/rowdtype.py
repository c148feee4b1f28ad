"""How a table's row values are stored (issue 38): float32 (the default), or 16 bits by choice,
``float16`` (IEEE half) or ``bfloat16`` (float32's top 16 bits: the same range, 8 bits of
mantissa). Only the values: the optimizer's state stays float32 (or row-wise, one per row), and
every update is computed in float32 on the rows gathered, then rounded back to the table's type.
Pushes and pulls carry float32; so do state transfers and checkpoints (a 16-bit value widens to
float32 exactly, and narrows back to itself), while a server's memory and its LMDB pages hold
the 16-bit values.

numpy has no bfloat16: it is stored as uint16, rounded to nearest even from float32 (NaN kept a
NaN), as torch's ``.to(torch.bfloat16)``.

Pure numpy, no IO.
"""

from __future__ import annotations

import numpy as np

#: the value types a table may store its rows in
ROW_DTYPES = ("float32", "float16", "bfloat16")

_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def check(name: object) -> str:
    """`name` if it is one of ROW_DTYPES, else ValueError naming what is expected."""
    if name not in ROW_DTYPES:
        raise ValueError(f"dtype must be one of {list(ROW_DTYPES)}, got {name!r}")
    return str(name)


def storage(name: str) -> np.dtype:
    """The numpy dtype a table of value type `name` keeps its rows in."""
    return np.dtype(_STORAGE[name])


def itemsize(name: str) -> int:
    return storage(name).itemsize


def encode(values: np.ndarray, name: str) -> np.ndarray:
    """float32 `values` as stored in a table of type `name` (float32: the array itself)."""
    if name == "float32":
        return np.asarray(values, np.float32)
    if name == "float16":
        # past float16's range a value becomes an infinity, as torch's .to(torch.float16)
        with np.errstate(over="ignore"):
            return np.asarray(values, np.float32).astype(np.float16)
    u = np.ascontiguousarray(values, np.float32).view(np.uint32)
    # round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then truncate
    r = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    out = r.astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():  # a NaN's mantissa may round to zero (an infinity): keep it a quiet NaN
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def decode(stored: np.ndarray, name: str) -> np.ndarray:
    """Stored values of a table of type `name` as float32 (a new array, except for float32)."""
    if name == "float32":
        return stored
    if name == "float16":
        return stored.astype(np.float32)
    return (np.ascontiguousarray(stored).astype(np.uint32) << np.uint32(16)).view(np.float32)
