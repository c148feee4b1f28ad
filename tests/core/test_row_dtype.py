"""Rows stored in 16 bits by choice (issue 38): a table's ``dtype`` "float16" or "bfloat16"
keeps its values in 16 bits (the optimizer's state in float32), computes each step in float32
and rounds back as torch does; state transfers and checkpoints carry float32 that narrows back to
the same bits; LMDB pages hold the 16-bit values. Pure parts: the conversions against torch's,
one bucket's block against a float32 one, its byte accounting, its page records."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adamps import rowdtype
from adamps.server.store.checksum import unseal
from adamps.server.store.tables.rowblock import ApplyStats, RowBlock, RowPush
from adamps.server.store.tables.rowdelta import parse_page
from adamps.server.store.tables.rowpages import SavedRows
from adamps.server.updates.optim import Optimizer
from adamps.tables import Admission, TableError, TableSpec, initial_rows, normalize_row_init

NORMAL = normalize_row_init({"kind": "normal", "std": 0.1, "seed": 7})
TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def block(dtype: str, dim: int = 8, opt: dict | None = None) -> RowBlock:
    o = Optimizer.from_dict(opt or {"kind": "adagrad", "lr": 0.05})
    return RowBlock(dim, NORMAL, o, Admission(), None, dtype=dtype)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_the_conversions_round_as_torch_does(name: str) -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate(
        [rng.normal(0, 3, 50_000), rng.normal(0, 1e-6, 1000), [0.0, -0.0, 1e30, -1e30, np.inf]]
    ).astype(np.float32)
    want = torch.from_numpy(x).to(TORCH[name]).to(torch.float32).numpy()
    stored = rowdtype.encode(x, name)
    assert stored.dtype == rowdtype.storage(name) and stored.itemsize == 2
    got = rowdtype.decode(stored, name)
    assert got.dtype == np.float32 and got.tobytes() == want.tobytes()
    # a stored value widens to float32 exactly and narrows back to the same bits
    assert rowdtype.encode(got, name).tobytes() == stored.tobytes()
    assert np.isnan(rowdtype.decode(rowdtype.encode(np.float32([np.nan]), name), name)).all()


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_a_16_bit_block_trains_as_float32_rounded_each_step(name: str) -> None:
    """Each push: widen the stored rows, the float32 step, round back: the same as a torch
    reference doing that, and within the type's precision of a float32 table."""
    b16, b32 = block(name), block("float32")
    rng = np.random.default_rng(2)
    ids = np.arange(0, 400, 3, dtype=np.int64)
    ref: dict[int, np.ndarray] = {}
    acc: dict[int, np.ndarray] = {}
    for step in range(5):
        g = rng.normal(size=(len(ids), 8)).astype(np.float32)
        for b in (b16, b32):
            b.apply(RowPush(ids, g, float(step)), ApplyStats())
        for i, row in zip(ids.tolist(), g, strict=True):
            if i not in ref:
                w0 = initial_rows(NORMAL, np.array([i]), 8)[0]
                ref[i] = rowdtype.decode(rowdtype.encode(w0, name), name)
                acc[i] = np.zeros(8, np.float32)
            acc[i] = acc[i] + row * row
            upd = ref[i] - np.float32(0.05) * row / (np.sqrt(acc[i]) + np.float32(1e-10))
            ref[i] = torch.from_numpy(upd).to(TORCH[name]).to(torch.float32).numpy()
    got = np.empty((len(ids), 8), np.float32)
    b16.gather(ids, got)
    want = np.stack([ref[i] for i in ids.tolist()])
    assert np.allclose(got, want, rtol=0, atol=1e-2 if name == "bfloat16" else 2e-3)
    exact = np.empty_like(got)
    b32.gather(ids, exact)
    tol = 2.0**-7 if name == "bfloat16" else 2.0**-10
    assert np.allclose(got, exact, rtol=4 * tol, atol=1e-3), np.abs(got - exact).max()
    assert not np.array_equal(got, exact)  # really stored in 16 bits
    assert b16.values is not None and b16.values.itemsize == 2
    assert b16.accum is not None and b16.accum.dtype == np.float32


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_state_bytes_and_pages_round_trip_bit_exact(name: str) -> None:
    b = block(name)
    ids = np.arange(1000, dtype=np.int64) * 5
    b.apply(RowPush(ids, np.ones((1000, 8), np.float32), 1.0), ApplyStats())
    assert b.values is not None
    stored = b.values[: b.n].copy()
    # state transfers and checkpoints: float32 bytes, narrowed back to the same bits
    again = block(name)
    again.load_bytes(b.tobytes())
    assert again.values is not None and again.values[: again.n].tobytes() == stored.tobytes()
    assert again.digest() == b.digest()
    # LMDB pages: the 16-bit values, half a float32 page's value bytes
    delta = b.take_delta()
    recs = delta.records("t#rows/0")
    saved = SavedRows(pages=[(i, bytes(unseal(r[1]))) for i, r in enumerate(recs)])
    ids2, _, values, accum, intact = saved.parse(8, b.acc_width, b.page_rows, name)
    assert intact and values.dtype == rowdtype.storage(name)
    assert values.tobytes() == stored.tobytes() and np.array_equal(ids2, ids)
    b32 = block("float32")
    b32.apply(RowPush(ids, np.ones((1000, 8), np.float32), 1.0), ApplyStats())
    assert b.page_rows > b32.page_rows  # more rows fit a page of 16-bit values
    # a page read for a table of another type converts (a float32 page into a float16 table)
    p32 = bytes(unseal(b32.take_delta().records("t#rows/0")[0][1]))
    _, _, v, _ = parse_page(p32, 8, b32.acc_width, name)
    assert v.dtype == rowdtype.storage(name)


def test_a_16_bit_table_holds_half_the_value_bytes() -> None:
    """The store's own byte accounting: values take half; a row's whole cost (values, id, index;
    SGD: no optimizer state) is within 10% of half at dim 64 (the id and the index, 20 bytes a
    row, are what keeps a narrow row above half)."""
    n = 20_000
    ids = np.arange(n, dtype=np.int64)
    held = {}
    for name in ("float32", "float16", "bfloat16"):
        b = block(name, 64, {"kind": "sgd", "lr": 0.1})
        b.apply(RowPush(ids, np.ones((n, 64), np.float32), 0.0), ApplyStats())
        assert b.values is not None
        assert b.values[: b.n].nbytes == n * 64 * rowdtype.itemsize(name)
        held[name] = b.nbytes
    for name in ("float16", "bfloat16"):
        assert 0.5 <= held[name] / held["float32"] <= 0.55, held


def test_a_table_dtype_is_checked_and_part_of_its_definition() -> None:
    spec = TableSpec("t", 4, dtype="float16")
    assert spec.to_dict()["dtype"] == "float16"
    assert TableSpec.from_dict(spec.to_dict()) == spec
    assert TableSpec.from_dict({"name": "t", "dim": 4}).dtype == "float32"  # older definitions
    assert TableSpec("t", 4) != spec
    with pytest.raises(TableError, match=r"dtype must be one of \['float32', 'float16', 'bfl"):
        TableSpec("t", 4, dtype="int8")


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_a_row_not_created_reads_as_the_16_bit_value_it_will_have(name: str) -> None:
    b = block(name, 8, {"kind": "sgd", "lr": 0.1})
    ids = np.arange(50, dtype=np.int64)
    before = np.empty((50, 8), np.float32)
    b.gather(ids, before)
    b.apply(RowPush(ids, np.zeros((50, 8), np.float32), 0.0), ApplyStats())
    after = np.empty_like(before)
    b.gather(ids, after)
    assert before.tobytes() == after.tobytes()
