"""put_rows (a bulk load's values, ``adamps table load``) on one parameter server in-process on
loopback: the rows take the values exactly (over /rpc and the data plane), their optimizer state
starts afresh, they survive a restart from LMDB; bad input is a 4xx naming it and changes
nothing; a batch refused as not durable is sent again until it applies, once."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from adamps.checkpoint import table_load as table_cmd
from adamps.client import PSClient, StaticRouting
from adamps.client.rpc import RpcError
from adamps.layout import Layout
from adamps.tables import initial_rows, normalize_row_init

from .test_tables import INIT, TOKEN, start

DIM = 4
ROWWISE = {"kind": "rowwise_adagrad", "lr": 0.1}


def client_of(url: str, retry_for: float = 20.0) -> PSClient:
    pc = PSClient(StaticRouting([url], 8), Layout([], 8), TOKEN, retry_for=retry_for)
    pc.tables["emb"] = DIM
    return pc


async def test_put_rows_sets_values_resets_state_and_reloads(tmp_path: Path) -> None:
    ps, runner, c, url = await start(tmp_path)
    rng = np.random.default_rng(1)
    ids = rng.choice(1 << 40, 500, replace=False).astype(np.int64) - (1 << 39)
    vals = rng.normal(size=(500, DIM)).astype(np.float32)
    g = rng.normal(size=(500, DIM)).astype(np.float32)
    try:
        await c.call("create_table", name="emb", dim=DIM, init=INIT, optimizer=ROWWISE)
        # rows with an accumulator already: the load resets it
        await c.call("push_rows", table="emb", ids=ids[:100], grads=g[:100])
        await c.call("put_rows", table="emb", ids=ids[:250], values=vals[:250])

        def dp_put() -> tuple[int, int]:
            with client_of(url) as pc:
                pc.put_rows("emb", ids[250:], vals[250:])
                return pc.dp_requests, pc.http_requests

        dp, http = await asyncio.to_thread(dp_put)
        assert dp >= 1 and http == 0  # the data plane carries put_rows
        got = (await c.call("pull_rows", table="emb", ids=ids))["rows"]
        assert got.tobytes() == vals.tobytes()
        # one step after the load is a fresh row-wise Adagrad step from the loaded value
        await c.call("push_rows", table="emb", ids=ids, grads=g)
        acc = np.mean(g.astype(np.float64) ** 2, axis=1, keepdims=True)
        want = vals - 0.1 * g / (np.sqrt(acc) + 1e-8)
        after = (await c.call("pull_rows", table="emb", ids=ids))["rows"]
        np.testing.assert_allclose(after, want, rtol=1e-6, atol=1e-6)
        await c.call("flush")
    finally:
        await c.close()
        await runner.cleanup()
    ps, runner, c, url = await start(tmp_path)
    try:
        again = (await c.call("pull_rows", table="emb", ids=ids))["rows"]
        assert again.tobytes() == after.tobytes()
    finally:
        await c.close()
        await runner.cleanup()


@pytest.mark.parametrize(
    ("fields", "code", "words"),
    [
        ({"ids": np.array([1, 2, 1]), "values": np.zeros((3, DIM), np.float32)},
         "bad_request", "put_rows names id 1 more than once"),
        ({"ids": np.array([1, 2]), "values": np.zeros((2, DIM + 1), np.float32)},
         "bad_shape", "values"),
        ({"ids": np.array([1, 2]), "values": np.array([[np.nan] * DIM] * 2, np.float32)},
         "non_finite", "values"),
        ({"ids": np.array([1, 2])}, "bad_request", "values"),
        ({"ids": np.array([], np.int64)}, "bad_request", "put_rows needs at least one id"),
    ],
)  # fmt: skip
async def test_bad_put_rows_is_a_4xx_naming_it_and_changes_nothing(
    tmp_path: Path, fields: dict, code: str, words: str
) -> None:
    ps, runner, c, url = await start(tmp_path)
    try:
        await c.call("create_table", name="emb", dim=DIM, init=INIT, optimizer=ROWWISE)
        with pytest.raises(RpcError) as e:
            await c.call("put_rows", table="emb", **fields)
        assert e.value.code == code and words in e.value.message, e.value
        got = (await c.call("pull_rows", table="emb", ids=np.array([1, 2])))["rows"]
        want = initial_rows(normalize_row_init(INIT), np.array([1, 2]), DIM)
        assert got.tobytes() == want.tobytes()
        assert (await c.call("list_tables"))["tables"][0]["rows_held"] == 0
    finally:
        await c.close()
        await runner.cleanup()


async def test_a_batch_refused_as_not_durable_is_sent_again_and_applies_once(
    tmp_path: Path,
) -> None:
    """The server answers not_durable for 1.5 s (its durability check says a flush stalled):
    the client's retries (0.3 s) give up, `adamps table load`'s batch loop waits and sends the
    batch again with its seq, and it applies once the server is durable again."""
    ps, runner, c, url = await start(tmp_path)
    real = ps.writes.not_durable
    try:
        await c.call("create_table", name="emb", dim=DIM, init=INIT, optimizer=ROWWISE)
        ps.writes.not_durable = lambda: "flushes stalled (test)"
        threading.Timer(1.5, lambda: setattr(ps.writes, "not_durable", real)).start()
        ids = np.arange(1000, dtype=np.int64)
        vals = np.random.default_rng(2).normal(size=(1000, DIM)).astype(np.float32)

        def load() -> int:
            with client_of(url, retry_for=0.3) as pc:
                return table_cmd._put(pc, "emb", ids, vals, wait=0.5)

        t0 = time.monotonic()
        resent = await asyncio.to_thread(load)
        assert resent >= 1 and time.monotonic() - t0 >= 1.4
        got = (await c.call("pull_rows", table="emb", ids=ids))["rows"]
        assert got.tobytes() == vals.tobytes()
    finally:
        ps.writes.not_durable = real
        await c.close()
        await runner.cleanup()
