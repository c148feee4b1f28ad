"""A table whose rows are stored in 16 bits (issue 38), on one parameter server in-process on
loopback with its real LMDB: create_table with ``dtype``, pushes and pulls in float32 within
the type's precision of a float32 table trained alike, the server's own byte accounting
(``list_tables``' ``bytes_held``) and its flushes about half, the rows bit-identical after a
restart from LMDB; a bad dtype is a 4xx naming it, and another dtype under the same name is
``exists``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from adamps.client.rpc import RpcError
from tests.integration.test_tables import INIT, start

SGD = {"kind": "sgd", "lr": 0.5}
DIM = 64
N = 20_000


async def _flush_bytes(c) -> int:
    return int((await c.call("flush"))["bytes"])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_a_16_bit_table_trains_holds_half_and_reloads_exactly(
    tmp_path: Path, dtype: str
) -> None:
    ids = np.arange(N, dtype=np.int64) * 11 + 1
    rng = np.random.default_rng(4)
    ps, runner, c, _ = await start(tmp_path)
    try:
        await c.call("create_table", name="t32", dim=DIM, init=INIT, optimizer=SGD)
        first = await _flush_bytes(c)
        await c.call("create_table", name="t16", dim=DIM, init=INIT, optimizer=SGD, dtype=dtype)
        for _ in range(3):
            g = rng.normal(0, 0.01, (N, DIM)).astype(np.float32)
            await c.call("push_rows", table="t32", ids=ids, grads=g)
        b32 = await _flush_bytes(c) - first
        rng = np.random.default_rng(4)
        for _ in range(3):
            g = rng.normal(0, 0.01, (N, DIM)).astype(np.float32)
            await c.call("push_rows", table="t16", ids=ids, grads=g)
        b16 = await _flush_bytes(c)
        exact = (await c.call("pull_rows", table="t32", ids=ids))["rows"]
        got = (await c.call("pull_rows", table="t16", ids=ids))["rows"]
        assert got.dtype == np.float32  # float32 on the wire
        eps = 2.0**-8 if dtype == "bfloat16" else 2.0**-11  # half the type's spacing at 1
        assert np.abs(got - exact).max() <= 4 * eps * np.abs(exact).max(), dtype
        assert not np.array_equal(got, exact)
        tables = {t["name"]: t for t in (await c.call("list_tables"))["tables"]}
        assert tables["t16"]["dtype"] == dtype and tables["t32"]["dtype"] == "float32"
        assert tables["t16"]["rows_held"] == tables["t32"]["rows_held"] == N
        # the store's own accounting: values halve; with the id and index (20 bytes a row)
        # a dim-64 SGD row is within 10% of half; LMDB's pages the same
        ratio = tables["t16"]["bytes_held"] / tables["t32"]["bytes_held"]
        assert 0.5 <= ratio <= 0.56, (ratio, tables)
        assert 0.5 <= b16 / b32 <= 0.56, (b16, b32)
    finally:
        await c.close()
        await runner.cleanup()
    ps, runner, c, _ = await start(tmp_path)  # reloaded from LMDB's 16-bit pages
    try:
        again = (await c.call("pull_rows", table="t16", ids=ids))["rows"]
        assert again.tobytes() == got.tobytes()
        # trains on from the reloaded rows
        await c.call("push_rows", table="t16", ids=ids[:10], grads=np.ones((10, DIM), "f4"))
        moved = (await c.call("pull_rows", table="t16", ids=ids[:10]))["rows"]
        assert np.abs(moved - (got[:10] - 0.5)).max() <= 0.01
    finally:
        await c.close()
        await runner.cleanup()


async def test_a_bad_dtype_is_refused_and_another_is_exists(tmp_path: Path) -> None:
    ps, runner, c, _ = await start(tmp_path)
    try:
        for bad, words in (("int8", "dtype must be one of"), (16, "'dtype' must be")):
            with pytest.raises(RpcError) as e:
                await c.call("create_table", name="t", dim=4, optimizer=SGD, dtype=bad)
            assert e.value.code == "bad_request" and words in str(e.value), e.value
        assert (await c.call("list_tables"))["tables"] == []  # nothing created
        await c.call("create_table", name="t", dim=4, optimizer=SGD, dtype="float16")
        await c.call("create_table", name="t", dim=4, optimizer=SGD, dtype="float16")  # again
        with pytest.raises(RpcError) as e:
            await c.call("create_table", name="t", dim=4, optimizer=SGD)
        assert e.value.code == "exists"
        assert (await c.call("pull_rows", table="t", ids=np.arange(3)))["rows"].shape == (3, 4)
    finally:
        await c.close()
        await runner.cleanup()
