"""push_compressed on an in-process parameter server (standalone, loopback): words and
Golomb-Rice forms give the dense result of the decoded delta; bad input changes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from adamps.client.rpc import AsyncRpc, RpcError
from adamps.compression import codec
from adamps.server.api.app import ParameterServer
from adamps.server.config import PsConfig
from adamps.up.procs import free_port
from adamps.wire import web as aweb

TOKEN = "ps-test-token"


@pytest.fixture
async def ps(tmp_path: Path) -> AsyncIterator[tuple[ParameterServer, AsyncRpc]]:
    port = free_port()
    cfg = PsConfig(
        port=port,
        token=TOKEN,
        data_dir=str(tmp_path / "ps"),
        owner_threads=2,
        flush_interval=3600,
        max_shard_elems=1000,
    )
    server = ParameterServer(cfg)
    runner = await aweb.serve(server.make_app(), "127.0.0.1", port)
    client = AsyncRpc(f"http://127.0.0.1:{port}", TOKEN)
    try:
        yield server, client
    finally:
        await client.close()
        await runner.cleanup()


def shard_update(
    rng: np.random.Generator, size: int, n: int, rice: bool
) -> tuple[dict, np.ndarray]:
    idx = np.sort(rng.choice(size, n, replace=False))
    neg = rng.random(n) < 0.5
    tau = 0.25
    dense = np.zeros(size, np.float32)
    dense[idx] = np.where(neg, -tau, tau)
    if rice:
        data, k = codec.rice_encode(idx, neg, size=size)
        return {"tau": tau, "n": n, "k": k, "rice": np.frombuffer(data, np.uint8)}, dense
    return {"tau": tau, "words": codec.pack_words(idx, neg)}, dense


@pytest.mark.parametrize("optimizer", [{"kind": "sgd", "lr": 0.5}, {"kind": "adagrad", "lr": 0.1}])
async def test_compressed_push_equals_dense_push_of_the_decoded_delta(ps, optimizer) -> None:
    _, c = ps
    for name in ("x", "y"):
        await c.call("create", name=name, shape=[30, 50], init={"kind": "uniform", "seed": 3},
                     optimizer=optimizer)  # fmt: skip
    rng = np.random.default_rng(0)
    for step in range(3):
        comp, dense = {}, {}
        for i, size in enumerate((1000, 500)):  # shard x/0 has 20 rows, x/1 10 rows
            upd, d = shard_update(rng, size, 50 + step, rice=bool((i + step) % 2))
            comp[f"x/{i}"] = upd
            dense[f"y/{i}"] = d.reshape(-1, 50)
        await c.call("push_compressed", shards=comp, client="t", seq=step + 1)
        await c.call("push_dense", shards=dense)
    got = await c.call("pull", tensors=["x", "y"])
    np.testing.assert_allclose(got["tensors"]["x"], got["tensors"]["y"], rtol=1e-6, atol=1e-7)
    assert got["versions"]["x"] == [3, 3]


async def test_bad_compressed_pushes_change_nothing(ps) -> None:
    server, c = ps
    await c.call("create", name="x", shape=[1500], optimizer={"kind": "sgd", "lr": -1.0})
    ok = {"tau": 1.0, "words": np.array([2], np.uint32)}
    bad = [
        ({"x/0": ok, "x/1": {"tau": 1.0, "words": np.array([6, 4], np.uint32)}}, "bad_request"),
        ({"x/0": ok, "x/1": {"tau": 1.0, "words": np.array([2000], np.uint32)}}, "bad_request"),
        ({"x/0": ok, "x/1": {"tau": -1.0, "words": np.array([2], np.uint32)}}, "bad_request"),
        ({"x/0": ok, "x/1": {"tau": 1.0, "words": np.array([2.0], np.float32)}}, "bad_dtype"),
        ({"x/0": ok, "x/9": ok}, "unknown_shard"),
        ({}, "bad_request"),
        # both encodings in one update: one would be dropped silently (doc client, session 19)
        ({"x/0": {**ok, "n": 1, "k": 0, "rice": np.array([0x40], np.uint8)}}, "bad_request"),
    ]
    for shards, code in bad:
        with pytest.raises(RpcError) as err:
            await c.call("push_compressed", shards=shards)
        assert err.value.code == code, shards
    got = await c.call("pull", tensors=["x"])
    assert not got["tensors"]["x"].any() and got["versions"]["x"] == [0, 0]
    await c.call("push_compressed", shards={"x/1": ok})
    got = await c.call("pull", tensors=["x"])
    assert got["tensors"]["x"][1001] == 1.0 and got["tensors"]["x"].sum() == 1.0
    assert server.store.applied["compressed"] == 1
    from prometheus_client import generate_latest

    text = generate_latest(server.registry).decode()
    assert 'adamps_ps_updates_applied_total{kind="compressed"} 1.0' in text
