"""Issue 12 against one in-process parameter server on loopback: /rpc and the data port.

Each test replays one attack of the issue (named by its item): the server answers a 4xx (or a
clean refusal frame on the data port) naming the problem, its state is unchanged (pulled values
and versions compared), and it keeps serving.
"""

from __future__ import annotations

import asyncio
import io
import resource
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import numpy as np
import pytest

from adamps.client.dataplane import DataPlaneClient, DataPlaneError
from adamps.client.rpc import AsyncRpc, RpcError
from adamps.server.api.app import ParameterServer
from adamps.server.config import PsConfig
from adamps.up.procs import free_port
from adamps.wire import protocol
from adamps.wire import web as aweb

TOKEN = "ps-hardening-token"


class Ps:
    def __init__(self, ps: ParameterServer, runner: Any, port: int) -> None:
        self.ps = ps
        self.runner = runner
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.rpc = AsyncRpc(self.url, TOKEN)

    async def raw(
        self, body: bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
        hdrs = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/msgpack"}
        hdrs.update(headers or {})
        async with (
            aiohttp.ClientSession() as s,
            s.post(self.url + "/rpc", data=io.BytesIO(body), headers=hdrs) as resp,
        ):
            data = await resp.read()
            if resp.status == 200:
                return 200, protocol.decode(data)
            assert resp.content_type == "application/json", data[:200]
            import json

            return resp.status, json.loads(data)

    async def state(self) -> Any:
        if not self.ps.store.tensors:
            return {}
        names = sorted(self.ps.store.tensors)
        r = await self.rpc.call("pull", tensors=names)
        return {n: (r["tensors"][n].tobytes(), r["versions"][n]) for n in names}

    async def close(self) -> None:
        await self.rpc.close()
        await self.runner.cleanup()


async def start_ps(tmp_path: Path, **overrides: Any) -> Ps:
    port = free_port()
    cfg = PsConfig(
        port=port,
        token=TOKEN,
        data_dir=str(tmp_path / f"ps-{port}"),
        owner_threads=1,
        flush_interval=3600,
        max_shard_elems=1000,
        lmdb_sync=False,
        **overrides,
    )
    ps = ParameterServer(cfg)
    runner = await aweb.serve(ps.make_app(), "127.0.0.1", port)
    return Ps(ps, runner, port)


@pytest.fixture
async def srv(tmp_path: Path) -> AsyncIterator[Ps]:
    s = await start_ps(tmp_path)
    await s.rpc.call(
        "create", name="w", shape=[40, 50], optimizer={"kind": "sgd", "lr": -1.0},
        init={"kind": "uniform", "seed": 1},
    )  # fmt: skip
    try:
        yield s
    finally:
        await s.close()


async def refused(s: Ps, op: str, code: str | tuple[str, ...], **fields: Any) -> dict:
    before = await s.state()
    with pytest.raises(RpcError) as err:
        await s.rpc.call(op, **fields)
    codes = (code,) if isinstance(code, str) else code
    assert err.value.code in codes, (err.value.code, err.value)
    assert await s.state() == before
    assert (await s.rpc.call("list"))["tensors"]  # still serving
    return err.value.extra


# -- 3. allocation bounds ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, optimizer",
    [([1 << 27], "sgd"), ([1 << 32], "adagrad"), ([1 << 16, 1 << 16], "sgd"), ([1 << 62], "sgd")],
)
async def test_create_beyond_the_tensor_limit_allocates_nothing(srv: Ps, shape, optimizer) -> None:
    t0 = time.monotonic()
    await refused(
        srv,
        "create",
        "too_large",
        name="big",
        shape=shape,
        optimizer={"kind": optimizer, "lr": 0.1},
    )
    assert time.monotonic() - t0 < 5.0
    assert "big" not in srv.ps.store.tensors


async def test_create_beyond_the_server_limit_is_refused(tmp_path: Path) -> None:
    s = await start_ps(tmp_path, max_server_elems=5000, max_tensor_elems=4000)
    try:
        await s.rpc.call("create", name="a", shape=[4000])
        with pytest.raises(RpcError) as err:
            await s.rpc.call("create", name="b", shape=[2000])
        assert err.value.code == "too_large"
        assert sorted(s.ps.store.tensors) == ["a"]
        await s.rpc.call("create", name="a", shape=[4000])  # idempotent repeat still fine
    finally:
        await s.close()


async def test_pull_of_one_shard_named_many_times_builds_one_copy(srv: Ps) -> None:
    """Issue 12: a 6 KB pull naming one shard N times took 1.5 GiB (N copies)."""
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = await srv.rpc.call("pull", shards=["w/0"] * 200_000)  # 200,000 x 4 KB before: 800 MB
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    assert grown < 200 << 10, f"peak memory grew {grown >> 10} MiB"
    assert list(r["shards"]) == ["w/0"]
    r = await srv.rpc.call("pull", tensors=["w"] * 50_000)
    assert list(r["tensors"]) == ["w"]


async def test_pull_of_too_many_distinct_shards_is_refused(tmp_path: Path) -> None:
    s = await start_ps(tmp_path, max_shards_per_request=4)
    try:
        await s.rpc.call("create", name="v", shape=[10_000])  # 10 shards of 1000
        with pytest.raises(RpcError) as err:
            await s.rpc.call("pull", shards=[f"v/{i}" for i in range(5)])
        assert err.value.code == "too_large"
        r = await s.rpc.call("pull", shards=[f"v/{i}" for i in range(4)])
        assert len(r["shards"]) == 4
    finally:
        await s.close()


async def test_a_body_of_many_empty_maps_is_refused_fast(srv: Ps) -> None:
    """Issue 12: 16 MB of empty msgpack maps blocked the loop 6.4 s and took 1.27 GiB."""
    n = 16 << 20
    # An array of 2^16 arrays, each of up to 2^16 - 1 empty maps (0x80 each).
    per = (1 << 16) - 1
    inner = b"\xdc" + per.to_bytes(2, "big") + b"\x80" * per
    outer_n = n // len(inner)
    body = (
        b"\x83\xa2op\xa4pull\xa1v\x01\xa6shards"
        + b"\xdd"
        + outer_n.to_bytes(4, "big")
        + inner * outer_n
    )
    before = await srv.state()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, high-water mark
    t0 = time.monotonic()
    status, reply = await srv.raw(body)
    assert time.monotonic() - t0 < 5.0  # was 6.4 s of a blocked event loop
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    assert grown < 300 << 10, f"peak memory grew {grown >> 10} MiB (was 1.27 GiB)"
    assert status in (400, 413) and reply["error"]["code"] in ("too_large", "malformed"), reply
    assert await srv.state() == before


@pytest.mark.parametrize(
    "body",
    [
        b"\xdd\xff\xff\xff\xff",  # an array announcing 2^32 - 1 elements
        b"\xdf\xff\xff\xff\xff",  # a map announcing 2^32 - 1 entries
        b"\xdb\x7f\xff\xff\xff",  # a 2 GiB string
    ],
)
async def test_msgpack_lengths_are_bounded(srv: Ps, body: bytes) -> None:
    status, reply = await srv.raw(body)
    assert status == 400 and reply["error"]["code"] == "malformed", reply


# -- 7. finite stays finite ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "init, optimizer",
    [
        ({"kind": "normal", "std": 1e300}, {"kind": "sgd", "lr": 0.1}),
        ({"kind": "constant", "value": 1e39}, {"kind": "sgd", "lr": 0.1}),
        ({"kind": "uniform", "low": -1e30, "high": 0.0}, {"kind": "sgd", "lr": 0.1}),
        ({"kind": "xavier", "gain": 1e30}, {"kind": "sgd", "lr": 0.1}),
        ({"kind": "zeros"}, {"kind": "sgd", "lr": 1e30}),
        ({"kind": "zeros"}, {"kind": "adagrad", "lr": 1e13}),
        ({"kind": "zeros"}, {"kind": "adagrad", "lr": 0.1, "initial_accumulator": 1e30}),
    ],
)
async def test_inits_and_optimizers_that_could_overflow_are_refused(srv: Ps, init, optimizer):
    await refused(
        srv, "create", "bad_request", name="x", shape=[10], init=init, optimizer=optimizer
    )


async def test_init_values_that_could_overflow_are_refused(srv: Ps) -> None:
    values = np.full(10, 3e38, np.float32)
    await refused(
        srv,
        "create",
        "bad_request",
        name="x",
        shape=[10],
        init={"kind": "values", "values": values},
    )


async def test_two_pushes_of_3e38_store_no_infinity(srv: Ps) -> None:
    delta = np.full((40, 50), 3e38, np.float32)
    await refused(srv, "push_dense", "bad_request", tensor="w", delta=delta)
    await refused(srv, "push_dense", "bad_request", shards={"w/0": delta[:20]})
    pulled = await srv.rpc.call("pull", tensors=["w"])
    assert np.isfinite(pulled["tensors"]["w"]).all()


async def test_fc_pushes_are_bounded_by_k_max_a_max_e(tmp_path: Path) -> None:
    s = await start_ps(tmp_path)
    try:
        await s.rpc.call("create", name="fc", shape=[4, 3], optimizer={"kind": "adagrad", "lr": 1})
        a = np.full((2, 3), 1e7, np.float32)
        e = np.full((2, 4), 1e7, np.float32)  # 2 * 1e7 * 1e7 = 2e14 > 1e12
        await refused(s, "push_fc", "bad_request", tensor="fc", a=a, e=e)
        ok = await s.rpc.call("push_fc", tensor="fc", a=a / 1e4, e=e / 1e4)
        assert ok["versions"]
        a[0, 0] = np.nan
        await refused(s, "push_fc", "non_finite", tensor="fc", a=a, e=e)
    finally:
        await s.close()


async def test_many_maximal_pushes_stay_finite(srv: Ps) -> None:
    """The bound's argument on a small scale: 1e12-sized steps with lr -1 stay finite."""
    delta = np.full((40, 50), 1e12, np.float32)
    for _ in range(20):
        await srv.rpc.call("push_dense", tensor="w", delta=delta)
    pulled = await srv.rpc.call("pull", tensors=["w"])
    assert np.isfinite(pulled["tensors"]["w"]).all()


# -- 8. strict envelope, 4xx never 500 ----------------------------------------------------------


@pytest.mark.parametrize("v", [True, 1.0, "1", None, 2])
async def test_the_version_must_be_the_int_1(srv: Ps, v: Any) -> None:
    body = msgpack.packb({"op": "list", "v": v, "rid": "x"})
    status, reply = await srv.raw(body)
    assert status == 400 and reply["error"]["code"] == "unsupported_version", reply


async def test_a_non_ascii_authorization_header_is_401(srv: Ps) -> None:
    def send() -> bytes:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(
                b"POST /rpc HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                b"Authorization: Bearer \xe2\x82\xac\xff\r\nConnection: close\r\n\r\n"
            )
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            return data

    reply = await asyncio.to_thread(send)
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]


async def test_the_old_public_token_is_not_accepted(srv: Ps) -> None:
    status, reply = await srv.raw(
        msgpack.packb({"op": "list", "v": 1, "rid": "x"}),
        headers={"Authorization": "Bearer adamps-dev-token"},
    )
    assert status == 401


# -- 4. the data port of a replicated server writes only through the write path ------------------


async def test_data_port_of_a_replicated_server_checks_the_primary_role(tmp_path: Path) -> None:
    dp = free_port()
    # Controllers that do not answer: the server is replicated (it has a replicator) but leads
    # nothing; a data-plane push or pull of a shard is refused as on /rpc (not_primary), before
    # any tensor lookup: the update never reaches a copy outside the two-phase commit.
    s = await start_ps(tmp_path, controllers=["127.0.0.1:1"], data_port=dp, server_id="ps-x")
    try:

        def attempts() -> list[str]:
            codes = []
            for op in ("push", "pull"):
                with DataPlaneClient("127.0.0.1", dp, TOKEN, timeout=5) as c:
                    with pytest.raises(DataPlaneError) as err:
                        if op == "push":
                            c.send_push_shards(
                                ["w/0"], [np.zeros(10, np.float32)], client="c", seq=1
                            )
                            c.read_push_reply()
                        else:
                            c.send_pull_shards(["w/0"])
                            c.read_pull_reply([np.zeros(10, np.float32)])
                    codes.append(err.value.code)
            return codes

        assert await asyncio.to_thread(attempts) == ["not_primary", "not_primary"]
    finally:
        await s.close()


async def test_data_port_of_a_standalone_server_bounds_pushes(tmp_path: Path) -> None:
    dp = free_port()
    s = await start_ps(tmp_path, data_port=dp)
    try:
        await s.rpc.call("create", name="v", shape=[100], optimizer={"kind": "sgd", "lr": -1})

        def pushes() -> tuple[str, dict]:
            with DataPlaneClient("127.0.0.1", dp, TOKEN, timeout=5) as c:
                with pytest.raises(DataPlaneError) as err:
                    c.push_dense("v", np.full(100, 3e38, np.float32))
                versions = c.push_dense("v", np.ones(100, np.float32))  # connection still usable
                return err.value.code, versions

        code, versions = await asyncio.to_thread(pushes)
        assert code == "bad_request" and versions
    finally:
        await s.close()


async def test_data_port_pushes_and_pulls_shards_like_rpc(tmp_path: Path) -> None:
    """The shard form of the data plane: the same update and the same checks as push_dense by
    shard on /rpc; an error after the payload leaves the connection usable; pushes and pulls of
    one connection in the order sent (a pipelined pull sees the push before it)."""
    dp = free_port()
    s = await start_ps(tmp_path, data_port=dp)
    try:
        await s.rpc.call("create", name="v", shape=[3000], optimizer={"kind": "sgd", "lr": -1})

        def exchange() -> tuple[list[str], list[int], np.ndarray, np.ndarray]:
            codes = []
            ones = [np.ones(1000, np.float32), np.full(1000, 2.0, np.float32)]
            with DataPlaneClient("127.0.0.1", dp, TOKEN, timeout=5) as c:
                c.send_push_shards(["v/2", "v/0"], ones, client="c1", seq=1)
                c.send_pull_shards(["v/0", "v/1", "v/2"])  # pipelined behind the push
                assert c.read_push_reply()
                outs = [np.empty(1000, np.float32) for _ in range(3)]
                versions = c.read_pull_reply(outs)
                bad = [np.full(1000, np.nan, np.float32), np.ones(1000, np.float32)]
                with pytest.raises(DataPlaneError) as err:  # after the payload: not fatal
                    c.send_push_shards(["v/0", "v/1"], bad)
                    c.read_push_reply()
                codes.append(err.value.code)
                c.send_pull_shards(["v/1"])
                after = [np.empty(1000, np.float32)]
                c.read_pull_reply(after)  # nothing of the refused push was applied
            for ids, n in ((["v/0", "v/0"], 2000), (["v/0"], 400), (["nope/0"], 0)):
                with DataPlaneClient("127.0.0.1", dp, TOKEN, timeout=5) as c:
                    with pytest.raises(DataPlaneError) as err:  # header errors: fatal
                        c.send_push_shards(ids, [np.zeros(n, np.float32)])
                        c.read_push_reply()
                    codes.append(err.value.code)
            return codes, versions, np.concatenate(outs), after[0]

        codes, versions, got, after = await asyncio.to_thread(exchange)
        assert codes == ["non_finite", "bad_request", "bad_length", "unknown_shard"]
        assert versions == [1, 0, 1]
        assert np.array_equal(
            got, np.concatenate([np.full(1000, 2.0), np.zeros(1000), np.ones(1000)])
        )
        assert not after.any()
        http = await s.rpc.call("pull", tensors=["v"])
        assert np.array_equal(http["tensors"]["v"], got) and s.ps.writes.clients == {"c1": 1}
    finally:
        await s.close()
