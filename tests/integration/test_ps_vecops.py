"""Sandblaster's vector operations on one parameter server, in-process (adamps/server/api/vecops.py):
numerics against numpy, colocation of a tensor's vectors, and bad requests refused whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from adamps.client.rpc import RpcError
from adamps.layout import placement_key, stable_bucket
from tests.integration.test_ps_app import start

SHAPE = [30, 40]  # max_shard_elems=1000 in start(): 2 shards of 25 and 5 rows


@pytest.fixture
async def ps(tmp_path: Path):
    server, runner, client = await start(tmp_path)
    try:
        yield server, client
    finally:
        await client.close()
        await runner.cleanup()


async def make(c, name: str, seed: int | None) -> np.ndarray:
    init = (
        {"kind": "uniform", "low": -1.0, "high": 1.0, "seed": seed}
        if seed is not None
        else {"kind": "zeros"}
    )
    await c.call("create", name=name, shape=SHAPE, init=init, optimizer={"kind": "sgd", "lr": -1.0})
    return (await c.call("pull", tensors=[name]))["tensors"][name].copy()


def test_vectors_go_with_their_tensor() -> None:
    assert placement_key("w@g/7") == "w/7"
    assert placement_key("a.b@x-1/12") == "a.b/12"
    for i in range(50):
        assert stable_bucket(f"w@acc/{i}", 64) == stable_bucket(f"w/{i}", 64)
        assert stable_bucket(f"w@acc/{i}", 3) == stable_bucket(f"w/{i}", 3)  # owner threads


async def test_ops_match_numpy(ps) -> None:
    server, c = ps
    w = await make(c, "w", 1)
    x = await make(c, "w@x", 2)
    y = await make(c, "w@y", 3)
    shards = ["w/0", "w/1"]
    dots = (await c.call("vec_dot", shards=shards, x="x", y="y"))["dots"]
    assert set(dots) == set(shards)
    assert sum(dots.values()) == pytest.approx(
        float(x.astype(np.float64).ravel() @ y.ravel()), rel=1e-12
    )
    want = y.copy()
    await c.call("vec", kind="axpy", shards=shards, y="y", x="x", alpha=0.5)
    want += np.float32(0.5) * x
    await c.call("vec", kind="scale", shards=shards, y="y", alpha=-2.0)
    want *= np.float32(-2.0)
    await c.call("vec", kind="mul", shards=shards, y="y", x="")  # "" is the tensor itself
    want *= w
    got = (await c.call("pull", tensors=["w@y"]))["tensors"]["w@y"]
    np.testing.assert_array_equal(got, want)
    await c.call("vec", kind="copy", shards=["w/1"], y="", x="y")  # only shard 1 of w
    got_w = (await c.call("pull", tensors=["w"]))["tensors"]["w"]
    np.testing.assert_array_equal(got_w[25:], want[25:])
    np.testing.assert_array_equal(got_w[:25], w[:25])
    self_dot = (await c.call("vec_dot", shards=shards, x="", y=""))["dots"]
    assert sum(self_dot.values()) == pytest.approx(float((got_w.astype(np.float64) ** 2).sum()))


@pytest.mark.parametrize(
    "fields, code",
    [
        ({"kind": "nope", "y": "y"}, "bad_request"),
        ({"kind": "axpy", "y": "y", "x": "x"}, "bad_request"),  # no alpha
        ({"kind": "axpy", "y": "y", "x": "x", "alpha": float("nan")}, "bad_request"),
        ({"kind": "scale", "y": "y", "alpha": 1e30}, "bad_request"),
        ({"kind": "copy", "y": "nothere", "x": "x"}, "unknown_tensor"),
        ({"kind": "copy", "y": "y@z", "x": "x"}, "bad_request"),
        ({"kind": "copy", "y": "y", "x": "x", "shards": ["w@x/0"]}, "bad_request"),
        ({"kind": "copy", "y": "y", "x": "x", "shards": ["w/9"]}, "unknown_shard"),
        ({"kind": "copy", "y": "y", "x": "x", "shards": []}, "bad_request"),
        ({"kind": "set", "y": "y", "values": np.ones(10, np.float32), "offset": 995}, "bad_shape"),
        ({"kind": "set", "y": "y", "values": np.ones(3, np.float64)}, "bad_dtype"),
        ({"kind": "set", "y": "y", "values": np.full(3, np.inf, np.float32)}, "non_finite"),
    ],
)
async def test_bad_requests_change_nothing(ps, fields, code) -> None:
    _, c = ps
    await make(c, "w", 1)
    await make(c, "w@x", 2)
    before = await make(c, "w@y", 3)
    with pytest.raises(RpcError) as err:
        await c.call("vec", **{"shards": ["w/0", "w/1"], **fields})
    assert err.value.code == code, err.value
    after = (await c.call("pull", tensors=["w@y"]))["tensors"]["w@y"]
    np.testing.assert_array_equal(after, before)
    assert (await c.call("list"))["tensors"]  # still serving


async def test_a_vector_of_another_shape_is_refused(ps) -> None:
    _, c = ps
    await make(c, "w", 1)
    await c.call("create", name="w@odd", shape=[10, 10])
    with pytest.raises(RpcError) as err:
        await c.call("vec", kind="copy", shards=["w/0"], y="odd", x="")
    assert err.value.code in ("bad_shape", "unknown_shard")


async def test_set_writes_a_slice(ps) -> None:
    _, c = ps
    await make(c, "w", 1)
    y = await make(c, "w@y", 3)
    v = np.arange(7, dtype=np.float32)
    await c.call("vec", kind="set", shards=["w/0"], y="y", values=v, offset=10)
    y.reshape(-1)[10:17] = v
    np.testing.assert_array_equal((await c.call("pull", tensors=["w@y"]))["tensors"]["w@y"], y)
