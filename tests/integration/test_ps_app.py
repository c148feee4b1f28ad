"""The parameter server's HTTP app in-process on a loopback socket: ops, numerics, status, metrics."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from adamps.client.rpc import AsyncRpc, RpcError
from adamps.config import ConfigError
from adamps.server.api.app import ParameterServer
from adamps.server.config import PsConfig
from adamps.server.updates.optim import Optimizer, reference_apply
from adamps.up.procs import free_port
from adamps.wire import web as aweb
from adamps.wire.protocol import ProtocolError

TOKEN = "ps-test-token"


async def start(
    tmp_path: Path, **overrides
) -> tuple[ParameterServer, aweb.web.AppRunner, AsyncRpc]:
    port = free_port()
    cfg = PsConfig(
        port=port,
        token=TOKEN,
        data_dir=str(tmp_path / "ps"),
        owner_threads=2,
        flush_interval=3600,
        max_shard_elems=1000,
        **overrides,
    )
    ps = ParameterServer(cfg)
    runner = await aweb.serve(ps.make_app(), "127.0.0.1", port)
    return ps, runner, AsyncRpc(f"http://127.0.0.1:{port}", TOKEN)


@pytest.fixture
async def ps(tmp_path: Path) -> AsyncIterator[tuple[ParameterServer, AsyncRpc]]:
    server, runner, client = await start(tmp_path)
    try:
        yield server, client
    finally:
        await client.close()
        await runner.cleanup()


async def test_create_is_idempotent_and_refuses_a_different_definition(ps) -> None:
    _, c = ps
    spec = {
        "name": "w",
        "shape": [30, 40],
        "init": {"kind": "xavier", "seed": 7},
        "optimizer": {"kind": "sgd", "lr": 0.1},
    }
    first = await c.call("create", **spec)
    assert first["created"] is True and [s["id"] for s in first["tensor"]["shards"]] == [
        "w/0",
        "w/1",
    ]
    again = await c.call("create", **spec)
    assert again["created"] is False and again["tensor"]["init"] == {
        "kind": "xavier",
        "gain": 1.0,
        "seed": 7,
    }
    with pytest.raises(RpcError) as err:
        await c.call("create", **{**spec, "optimizer": {"kind": "adagrad", "lr": 0.1}})
    assert err.value.code == "exists" and err.value.extra["existing"]["optimizer"]["kind"] == "sgd"
    listed = await c.call("list")
    assert [t["name"] for t in listed["tensors"]] == ["w"]
    described = await c.call("describe", name="w")
    assert described["shards"][1]["rows"] == [25, 30] and described["shards"][0]["held"] is True


async def test_push_and_pull_by_tensor_and_by_shard(ps) -> None:
    _, c = ps
    values = np.arange(2500, dtype=np.float32).reshape(50, 50)
    await c.call(
        "create",
        name="m",
        shape=[50, 50],
        init={"kind": "values", "values": values},
        optimizer={"kind": "sgd", "lr": -1},
    )
    r = await c.call(
        "push_dense", tensor="m", delta=np.ones((50, 50), np.float32), client="t1", seq=1
    )
    assert r["versions"] == {"m/0": 1, "m/1": 1, "m/2": 1}
    r = await c.call("push_dense", shards={"m/1": np.full((20, 50), 2.0, np.float32)})
    assert r["versions"] == {"m/1": 2}
    pulled = await c.call("pull", tensors=["m"])
    expected = values + 1
    expected[20:40] += 2
    assert np.array_equal(pulled["tensors"]["m"], expected) and pulled["versions"] == {
        "m": [1, 2, 1]
    }
    by_shard = await c.call("pull", shards=["m/2", "m/0"])
    assert np.array_equal(by_shard["shards"]["m/2"], expected[40:]) and by_shard["versions"] == {
        "m/2": 1,
        "m/0": 1,
    }


async def test_fc_push_over_http_matches_numpy(ps) -> None:
    _, c = ps
    await c.call(
        "create",
        name="fc",
        shape=[64, 48],
        init={"kind": "normal", "std": 0.1, "seed": 1},
        optimizer={"kind": "sgd", "lr": 0.05},
    )
    w0 = (await c.call("pull", tensors=["fc"]))["tensors"]["fc"]
    g = np.random.default_rng(3)
    a, e = (
        g.standard_normal((16, 48)).astype(np.float32),
        g.standard_normal((16, 64)).astype(np.float32),
    )
    r = await c.call("push_fc", tensor="fc", a=a, e=e)
    assert r["versions"] == {"fc/0": 1, "fc/1": 1, "fc/2": 1, "fc/3": 1}  # 20 rows per shard
    w1 = (await c.call("pull", tensors=["fc"]))["tensors"]["fc"]
    np.testing.assert_allclose(w1, w0 - 0.05 * (e.T.astype(np.float64) @ a), rtol=1e-5, atol=1e-5)
    # Only some row blocks, as a client of a partitioned layout sends them:
    await c.call("push_fc", tensor="fc", a=a, e=e, shards=["fc/3"])
    w2 = (await c.call("pull", tensors=["fc"]))["tensors"]["fc"]
    assert np.array_equal(w2[:60], w1[:60]) and not np.array_equal(w2[60:], w1[60:])


async def test_adagrad_over_http_matches_reference(ps) -> None:
    _, c = ps
    opt = {"kind": "adagrad", "lr": 0.1, "eps": 1e-6, "initial_accumulator": 0.01}
    await c.call(
        "create", name="ada", shape=[1500], init={"kind": "constant", "value": 0.5}, optimizer=opt
    )
    w_ref, acc_ref = np.full(1500, 0.5, np.float32), np.full(1500, 0.01, np.float32)
    g = np.random.default_rng(5)
    for _ in range(4):
        d = g.standard_normal(1500).astype(np.float32)
        await c.call("push_dense", tensor="ada", delta=d)
        reference_apply(Optimizer.from_dict(opt), w_ref, acc_ref, d)
    w = (await c.call("pull", tensors=["ada"]))["tensors"]["ada"]
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)


async def test_a_whole_round_in_one_push_fc_equals_its_separate_pushes(ps) -> None:
    """push_fc with `layers` and `dense` (PSClient.push_round, issue 27): the same Adagrad steps,
    bit for bit, as one push_fc per layer and a push_dense, each shard stepped once."""
    _, c = ps
    opt = {"kind": "adagrad", "lr": 0.05, "initial_accumulator": 0.1}
    shapes = {"f1": [40, 30], "f2": [12, 40], "c": [700], "b": [40]}  # f1: 2 row blocks
    for run in ("r", "s"):  # r: one request per round; s: the separate pushes
        for name, shape in shapes.items():
            init = {"kind": "normal", "std": 0.1, "seed": len(name)}
            await c.call("create", name=f"{run}{name}", shape=shape, init=init, optimizer=opt)
    g = np.random.default_rng(9)
    for step in range(3):
        a1, e1 = g.standard_normal((8, 30), np.float32), g.standard_normal((8, 40), np.float32)
        a2, e2 = g.standard_normal((8, 40), np.float32), g.standard_normal((8, 12), np.float32)
        dc, db = g.standard_normal(700, np.float32), g.standard_normal(40, np.float32)
        r = await c.call(
            "push_fc",
            layers={"rf1": {"a": a1, "e": e1}, "rf2": {"a": a2, "e": e2, "shards": ["rf2/0"]}},
            dense_shards=["rc/0", "rb/0"],
            dense=np.concatenate([dc, db]),
            client="t",
            seq=step + 1,
        )
        assert r["versions"] == dict.fromkeys(["rf1/0", "rf1/1", "rf2/0", "rc/0", "rb/0"], step + 1)
        await c.call("push_fc", tensor="sf1", a=a1, e=e1)
        await c.call("push_fc", tensor="sf2", a=a2, e=e2)
        await c.call("push_dense", shards={"sc/0": dc, "sb/0": db})
    for name in shapes:
        got = await c.call("pull", tensors=[f"r{name}", f"s{name}"])
        assert np.array_equal(got["tensors"][f"r{name}"], got["tensors"][f"s{name}"]), name
    before = (await c.call("pull", tensors=["rf1", "rc"]))["tensors"]
    one = np.ones((8, 30), np.float32)
    for bad in (
        {"layers": {"rf1": {"a": one, "e": np.ones((8, 40), np.float32)}},
         "dense_shards": ["rf1/1"], "dense": np.ones(210, np.float32)},  # a shard twice
        {"layers": {}},  # nothing
        {"layers": {"rf1": {"a": one, "e": np.ones((8, 40), np.float32)}},
         "dense_shards": ["rc/0"], "dense": np.ones(699, np.float32)},  # too few values
        {"layers": {"rf1": {"a": one, "e": np.ones((8, 40), np.float32)}},
         "dense_shards": ["rc/0"], "dense": np.full(700, np.nan, np.float32)},  # not finite
    ):  # fmt: skip
        with pytest.raises(RpcError) as err:
            await c.call("push_fc", **bad)
        assert err.value.code in ("bad_request", "bad_shape", "non_finite"), err.value
    after = (await c.call("pull", tensors=["rf1", "rc"]))["tensors"]
    assert all(np.array_equal(before[n], after[n]) for n in before)


async def test_status_metrics_and_loss_window(ps) -> None:
    server, c = ps
    await c.call("create", name="s", shape=[10])
    await c.call("push_dense", tensor="s", delta=np.ones(10, np.float32))
    status = await c.get_json("/status")
    assert (
        status["role"] == "ps"
        and status["buckets"] == "all"
        and status["shards"]["s/0"]["version"] == 1
    )
    assert status["dirty_shards"] == 1 and status["loss_window_seconds"] > 0
    assert status["config"]["token"] == "***" and len(status["queue_depths"]) == 2
    async with aiohttp.ClientSession() as s, s.get(c.base_url + "/metrics") as r:
        text = await r.text()
    for name in (
        'adamps_ps_updates_applied_total{kind="dense"} 1.0',
        "adamps_ps_dirty_shards 1.0",
        "adamps_ps_bytes_in_total",
        'adamps_ps_request_latency_seconds_count{op="push_dense"} 1.0',
        "adamps_ps_loss_window_seconds",
        "adamps_ps_queue_depth",
    ):
        assert name in text, name
    # a body that is not JSON (docs: empty or {}) is 400 malformed and flushes nothing
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s:
        for body in (b"xx", b"[1]", b'{"a": NaN}'):
            async with s.post(c.base_url + "/flush", data=body, headers=auth) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "malformed"
    assert server.flusher.loss_window() > 0.0
    flushed = await c.post_json("/flush")
    assert flushed["shards"] == 1 and server.flusher.loss_window() == 0.0
    status = await c.get_json("/status")
    assert status["last_flush"]["shards"] == 1
    # every thread by kernel id, as /proc/PID/task names them (benchmarks/idle.py --threads)
    assert {"MainThread", "adamps-flusher"} <= set(status["threads"].values())
    assert str(threading.get_native_id()) in status["threads"]


async def test_a_server_holding_some_buckets(tmp_path: Path) -> None:
    server, runner, c = await start(tmp_path, n_buckets=4, buckets=[0, 1])
    try:
        await c.call("create", name="p", shape=[8000])  # 8 shards of 1000
        held = sorted(server.store.shards)
        assert 0 < len(held) < 8
        with pytest.raises(RpcError) as err:
            await c.call("pull", tensors=["p"])
        assert err.value.code == "unknown_shard" and set(err.value.extra["missing"]).isdisjoint(
            held
        )
        r = await c.call("push_dense", shards={held[0]: np.ones(1000, np.float32)})
        assert r["versions"] == {held[0]: 1}
        pulled = await c.call("pull", shards=held)
        assert set(pulled["shards"]) == set(held)
    finally:
        await c.close()
        await runner.cleanup()


def test_a_changed_shard_size_under_existing_data_is_refused(tmp_path: Path) -> None:
    cfg = PsConfig(
        token=TOKEN, data_dir=str(tmp_path / "ps"), max_shard_elems=1000, flush_interval=3600
    )
    ps = ParameterServer(cfg)
    try:
        asyncio.run(ps.catalog.op_create({"name": "q", "shape": [3000]}))
    finally:
        ps.close()
    with pytest.raises(ConfigError, match="max_shard_elems=1000"):
        ParameterServer(PsConfig(token=TOKEN, data_dir=str(tmp_path / "ps"), max_shard_elems=2000))
    again = ParameterServer(cfg)  # the original layout still loads
    try:
        assert sorted(again.store.shards) == ["q/0", "q/1", "q/2"]
    finally:
        again.close()


async def test_tensor_definition_and_ensure_tensor_for_peers(ps) -> None:
    server, c = ps
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    await c.call(
        "create",
        name="d",
        shape=[3, 4],
        init={"kind": "values", "values": values},
        optimizer={"kind": "adagrad", "lr": 0.1},
    )
    d = server.catalog.definition("d")
    assert d["init"]["kind"] == "values" and "sha256" in d["init"]
    assert server.catalog.ensure(d) is False  # identical: nothing to do
    with pytest.raises(ProtocolError) as err:
        server.catalog.ensure({**d, "shape": [4, 3]})
    assert err.value.code == "exists"
    assert server.catalog.ensure({**d, "name": "d2"}) is True  # a copy starts at zeros
    pulled = await c.call("pull", tensors=["d2"])
    assert not pulled["tensors"]["d2"].any()
