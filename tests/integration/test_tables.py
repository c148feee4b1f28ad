"""Embedding tables on one parameter server in-process on loopback: create_table, pull_rows and
push_rows over /rpc and the data plane (PSClient), per-row Adagrad against numpy, duplicate ids,
admission, every bad input (a 4xx naming it, nothing changed), and rows reloaded from LMDB."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

from adamps.client import PSClient, StaticRouting
from adamps.client.rpc import AsyncRpc, RpcError
from adamps.layout import Layout
from adamps.server.api.app import ParameterServer
from adamps.server.config import PsConfig
from adamps.tables import initial_rows, normalize_row_init
from adamps.up.procs import free_port
from adamps.wire import web as aweb
from adamps.wire.protocol import ProtocolError

TOKEN = "tables-test-token"
INIT = {"kind": "normal", "std": 0.1, "seed": 3}
ADAGRAD = {"kind": "adagrad", "lr": 0.1, "initial_accumulator": 0.1}


async def start(tmp_path: Path, data_dir: str = "ps", **overrides):
    port, dport = free_port(), free_port()
    cfg = PsConfig(
        port=port,
        data_port=dport,
        token=TOKEN,
        data_dir=str(tmp_path / data_dir),
        owner_threads=2,
        flush_interval=3600,
        n_buckets=8,
        **overrides,
    )
    ps = ParameterServer(cfg)
    runner = await aweb.serve(ps.make_app(), "127.0.0.1", port)
    return ps, runner, AsyncRpc(f"http://127.0.0.1:{port}", TOKEN), f"http://127.0.0.1:{port}"


def reference(pushes, dim):
    """numpy: one Adagrad step per push on each distinct id's summed gradient."""
    init = normalize_row_init(INIT)
    w, acc = {}, {}
    for ids, g in pushes:
        summed = {}
        for i, row in zip(ids.tolist(), g, strict=True):
            summed[i] = summed.get(i, 0) + row
        for i, row in summed.items():
            if i not in w:
                w[i] = initial_rows(init, np.array([i]), dim)[0]
                acc[i] = np.full(dim, 0.1, np.float32)
            acc[i] = acc[i] + row * row
            w[i] = w[i] - np.float32(0.1) * row / np.sqrt(acc[i] + np.float32(1e-8))
    return w


async def test_rows_over_rpc_and_data_plane_match_numpy_and_reload(tmp_path: Path) -> None:
    ps, runner, c, url = await start(tmp_path)
    try:
        r = await c.call("create_table", name="emb", dim=8, init=INIT, optimizer=ADAGRAD)
        assert r["created"] is True
        again = await c.call("create_table", name="emb", dim=8, init=INIT, optimizer=ADAGRAD)
        assert again["created"] is False
        with pytest.raises(RpcError) as e:
            await c.call("create_table", name="emb", dim=4)
        assert e.value.code == "exists"

        rng = np.random.default_rng(0)
        pushes = []
        # Half over /rpc, half through PSClient over the data plane (message frames).
        for k in range(6):
            ids = (rng.zipf(1.2, 300) % 5000).astype(np.int64)
            g = rng.normal(size=(300, 8)).astype(np.float32)
            pushes.append((ids, g))
            if k % 2 == 0:
                await c.call("push_rows", table="emb", ids=ids, grads=g, client="a", seq=k)

            else:

                def push(ids=ids, g=g) -> tuple[int, int]:
                    with PSClient(StaticRouting([url], 8), Layout([], 8), TOKEN) as pc:
                        pc.create_table("emb", 8, init=INIT, optimizer=ADAGRAD)
                        pc.push_rows("emb", ids, g)
                        return pc.dp_requests, pc.http_requests

                dp, http = await asyncio.to_thread(push)
                assert dp >= 1 and http == 0
        w = reference(pushes, 8)
        ids = np.array(sorted(w) + [10**15, -7], np.int64)  # two never pushed: their init
        want = np.stack(
            [*(w[i] for i in sorted(w)), *initial_rows(normalize_row_init(INIT), ids[-2:], 8)]
        )
        got = (await c.call("pull_rows", table="emb", ids=ids))["rows"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)

        def pull() -> np.ndarray:
            with PSClient(StaticRouting([url], 8), Layout([], 8), TOKEN) as pc:
                return pc.pull_rows("emb", ids)

        assert np.array_equal(await asyncio.to_thread(pull), got)
        listed = (await c.call("list_tables"))["tables"]
        assert listed[0]["rows_held"] == len(w)  # the pulls created nothing
        await c.call("flush")
    finally:
        await c.close()
        await runner.cleanup()
    # A restart from the same LMDB: every row, accumulator and version back.
    ps, runner, c, url = await start(tmp_path)
    try:
        got2 = (await c.call("pull_rows", table="emb", ids=ids))["rows"]
        assert np.array_equal(got2, got)
        ids2, g2 = pushes[0]
        await c.call("push_rows", table="emb", ids=ids2, grads=g2)
        w2 = reference([*pushes, (ids2, g2)], 8)
        got3 = (await c.call("pull_rows", table="emb", ids=ids2))["rows"]
        np.testing.assert_allclose(
            got3, np.stack([w2[i] for i in ids2.tolist()]), rtol=1e-5, atol=1e-7
        )
    finally:
        await c.close()
        await runner.cleanup()


async def test_bad_input_is_a_4xx_naming_it_and_changes_nothing(tmp_path: Path) -> None:
    ps, runner, c, url = await start(tmp_path)
    try:
        await c.call(
            "create_table",
            name="t",
            dim=4,
            init=INIT,
            admission={"max_rows": 64, "on_full": "reject"},
        )
        ids = np.arange(8, dtype=np.int64)
        await c.call("push_rows", table="t", ids=ids, grads=np.ones((8, 4), np.float32))
        before = (await c.call("pull_rows", table="t", ids=np.arange(64)))["rows"]
        g = np.ones((8, 4), np.float32)
        nan = g.copy()
        nan[3, 1] = np.nan
        cases = [
            ({"ids": ids.astype(np.float32), "grads": g}, "bad_dtype", "ids"),
            ({"ids": ids.astype(np.int32), "grads": g}, "bad_dtype", "int64"),
            ({"ids": ids.reshape(2, 4), "grads": g}, "bad_shape", "ids"),
            ({"ids": ids, "grads": np.ones((8, 5), np.float32)}, "bad_shape", "grads"),
            ({"ids": ids, "grads": np.ones((7, 4), np.float32)}, "bad_shape", "grads"),
            ({"ids": ids, "grads": g, "dim": 5}, "bad_shape", "dim 4"),
            ({"ids": ids, "grads": nan}, "non_finite", "grads"),
            ({"ids": ids, "grads": g * np.float32(1e30)}, "bad_request", "grads"),
            ({"ids": ids, "grads": g * np.float32(np.inf)}, "non_finite", "grads"),
            ({"ids": ids, "grads": g.astype(np.float64)}, "bad_dtype", "grads"),
            (
                {"ids": np.arange(100, 164), "grads": np.ones((64, 4), np.float32)},
                "table_full",
                "rows",
            ),
            ({"table": "nope", "ids": ids, "grads": g}, "unknown_table", "nope"),
        ]
        for fields, code, word in cases:
            with pytest.raises(RpcError) as e:
                await c.call("push_rows", **{"table": "t", **fields})
            assert e.value.code == code, (fields.keys(), e.value)
            assert 400 <= e.value.status < 500
            assert word in e.value.message, e.value.message

        # An empty push (the wire encoder of this client cannot send empty arrays; the handler):
        with pytest.raises(ProtocolError, match="at least one id"):
            await ps.rows.op_push_rows(
                {"table": "t", "ids": np.empty(0, np.int64), "grads": np.empty((0, 4), np.float32)}
            )

        # More ids than the request limit, over the data plane (PSClient: one server, one frame).
        def too_many(op: str) -> None:
            with PSClient(StaticRouting([url], 8), Layout([], 8), TOKEN, retry_for=0) as pc:
                pc.create_table("t", 4, init=INIT, admission={"max_rows": 64, "on_full": "reject"})
                if op == "pull":
                    pc.pull_rows("t", np.arange(300_000))
                else:
                    pc.push_rows("t", np.arange(300_000), np.ones((300_000, 4), np.float32))

        for op in ("pull", "push"):
            with pytest.raises(RpcError) as e:
                await asyncio.to_thread(too_many, op)
            assert e.value.code == "too_large" and "262144" in e.value.message
        for bad in (
            {"dim": 0},
            {"dim": 4, "init": {"kind": "xavier"}},
            {"dim": 4, "admission": {"max_rows": -1}},
        ):
            with pytest.raises(RpcError) as e:
                await c.call("create_table", name="u", **bad)
            assert e.value.code == "bad_request"
        after = (await c.call("pull_rows", table="t", ids=np.arange(64)))["rows"]
        assert np.array_equal(before, after)
        assert (await c.call("list_tables"))["tables"][0]["rows_held"] == 8
        out = generate_latest(ps.registry).decode()
        assert 'adamps_table_pushes_rejected_total{table="t"} 1.0' in out
    finally:
        await c.close()
        await runner.cleanup()


async def test_row_limit_drop_and_frequency_filter_are_counted(tmp_path: Path) -> None:
    ps, runner, c, url = await start(tmp_path)
    try:
        await c.call(
            "create_table", name="d", dim=2, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": 1.0},
            admission={"max_rows": 8, "on_full": "drop", "admit_after": 2},
        )  # fmt: skip
        one = np.ones((200, 2), np.float32)
        await c.call("push_rows", table="d", ids=np.arange(200), grads=one)  # first sighting
        assert (await c.call("list_tables"))["tables"][0]["rows_held"] == 0
        await c.call(
            "push_rows", table="d", ids=np.arange(200), grads=one
        )  # admitted, to the limit
        held = (await c.call("list_tables"))["tables"][0]["rows_held"]
        assert 0 < held <= 8  # each of the 8 buckets holds at most ceil(8 / 8) = 1 row
        rows = (await c.call("pull_rows", table="d", ids=np.arange(200)))["rows"]
        assert int((rows != 0).any(axis=1).sum()) == held and np.all(rows[rows != 0] == -1)
        out = generate_latest(ps.registry).decode()
        assert 'adamps_table_rows_dropped_total{table="d",why="filtered"} 200.0' in out
        assert f'adamps_table_rows_dropped_total{{table="d",why="full"}} {200.0 - held}' in out
        assert f'adamps_table_rows_created_total{{table="d"}} {float(held)}' in out
    finally:
        await c.close()
        await runner.cleanup()


async def test_numpy_embedding_bag_pulls_distinct_ids_and_pushes_summed_row_gradients(
    tmp_path: Path,
) -> None:
    """trainer/embedding.py against a real server: forward is the pooled rows, backward applies
    one SGD step per distinct id with the summed gradient (lr 1: w -= g)."""
    from trainer.embedding import EmbeddingBag

    ps, runner, c, url = await start(tmp_path)
    try:

        def run() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            with PSClient(StaticRouting([url], 8), Layout([], 8), TOKEN) as pc:
                pc.create_table("bag", 4, init=INIT, optimizer={"kind": "sgd", "lr": 1.0})
                bag = EmbeddingBag(pc, "bag", 4, mode="mean")
                ids = np.array([[1, 2, 2], [3, 1, 7]], np.int64)
                out = bag.forward(ids)
                grad = np.arange(8, dtype=np.float32).reshape(2, 4)
                bag.backward(grad)
                return ids, out, pc.pull_rows("bag", np.array([1, 2, 3, 7]))

        ids, out, after = await asyncio.to_thread(run)
        init = initial_rows(normalize_row_init(INIT), np.array([1, 2, 3, 7]), 4)
        rows = dict(zip([1, 2, 3, 7], init, strict=True))
        want = np.stack([np.mean([rows[i] for i in r], axis=0) for r in ids.tolist()])
        np.testing.assert_allclose(out, want, rtol=1e-6)
        g = np.arange(8, dtype=np.float32).reshape(2, 4) / 3
        summed = {1: g[0] + g[1], 2: 2 * g[0], 3: g[1], 7: g[1]}
        np.testing.assert_allclose(
            after, np.stack([rows[i] - summed[i] for i in (1, 2, 3, 7)]), rtol=1e-5, atol=1e-6
        )
    finally:
        await c.close()
        await runner.cleanup()


async def test_rows_unseen_for_expire_after_are_removed_and_counted(tmp_path: Path) -> None:
    """Expiry on a server: the push's time is the server's clock; a row not pushed for
    expire_after seconds is gone at a later push (pulls do not keep it), and comes back from
    its initial value when pushed again."""
    ps, runner, c, url = await start(tmp_path)
    try:
        await c.call(
            "create_table", name="e", dim=2, init=INIT, optimizer={"kind": "sgd", "lr": 1.0},
            admission={"expire_after": 0.4},
        )  # fmt: skip
        one = np.ones((20, 2), np.float32)
        await c.call("push_rows", table="e", ids=np.arange(20), grads=one)
        listed = (await c.call("list_tables"))["tables"][0]
        assert listed["rows_held"] == 20 == sum(listed["bucket_rows"].values())
        assert sorted(map(int, listed["bucket_rows"])) == listed["buckets_held"]
        await asyncio.sleep(0.3)
        await c.call("pull_rows", table="e", ids=np.arange(20))  # a read is not a sighting
        await asyncio.sleep(0.3)
        # Every bucket that holds a row gets a push 0.6 s later: its sweep removes the old rows.
        await c.call(
            "push_rows", table="e", ids=np.arange(100, 400), grads=np.ones((300, 2), np.float32)
        )
        assert (await c.call("list_tables"))["tables"][0]["rows_held"] == 300
        out = generate_latest(ps.registry).decode()
        assert 'adamps_table_rows_expired_total{table="e"} 20.0' in out
        back = (await c.call("pull_rows", table="e", ids=np.arange(20)))["rows"]
        init = initial_rows(normalize_row_init(INIT), np.arange(20), 2)
        assert np.array_equal(back, init)  # the pushed values (init - 1) are gone
    finally:
        await c.close()
        await runner.cleanup()


async def test_an_empty_push_rows_is_a_value_error_in_the_client_and_a_400_from_the_server(
    tmp_path: Path,
) -> None:
    """Issue 39 #16: PSClient.push_rows with no id returned as if it had pushed. It now raises
    a ValueError naming the table, before sending anything; the server answers an empty
    push_rows that reaches it (a hand-made request) with 400 bad_request, nothing applied."""
    import aiohttp

    from adamps.wire import protocol

    ps, runner, c, url = await start(tmp_path)
    try:
        await c.call("create_table", name="t", dim=4, init=INIT)

        def client_push() -> None:
            with PSClient(StaticRouting([url], 8), Layout([], 8), TOKEN, retry_for=0) as pc:
                with pytest.raises(ValueError, match="'t' needs at least one id"):
                    pc.push_rows("t", np.empty(0, np.int64), np.empty((0, 4), np.float32))
                with pytest.raises(ValueError, match="at least one id"):
                    pc.push_rows("t", [], np.empty((0, 4), np.float32))

        await asyncio.to_thread(client_push)
        # The same request by hand (the arrays' wire maps written out: empty data)
        body = protocol.encode(
            {"op": "push_rows", "v": 1, "rid": 1, "table": "t",
             "ids": {"dtype": "int64", "shape": [0], "data": b""},
             "grads": {"dtype": "float32", "shape": [0, 4], "data": b""}}
        )  # fmt: skip
        hdrs = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/msgpack"}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/rpc", data=body, headers=hdrs) as resp:
                assert resp.status == 400
                err = (await resp.json())["error"]
        assert err["code"] == "bad_request" and "at least one id" in err["message"], err
        assert ps.store.tables.table("t").rows() == 0
        assert (await c.call("list_tables"))["tables"][0]["rows_held"] == 0  # still serving
    finally:
        await c.close()
        await runner.cleanup()


async def test_filters_are_made_at_first_sight_and_admitted_against_the_servers_memory(
    tmp_path: Path,
) -> None:
    """Issue 39, finding 2: a table's frequency filters (16 x filter_width bytes per bucket)
    were allocated at create_table, on the event loop, for every held bucket, at widths up to
    2^24, counted nowhere. Now the widest is 2^20, a bucket's sketch is made at the first push
    naming an id without a row, and the filters count in max_server_elems (4-byte cells) beside
    the tensors' elements: past it, create_table and create are 413 too_large."""
    ps, runner, c, _url = await start(tmp_path, max_server_elems=1 << 20)
    try:
        with pytest.raises(RpcError) as err:
            await c.call("create_table", name="x", dim=4,
                         admission={"admit_after": 2, "filter_width": (1 << 20) + 1})  # fmt: skip
        assert err.value.code == "bad_request" and "2^20" in err.value.message
        wide = {"admit_after": 2, "filter_width": 1 << 16}  # 4 x 2^16 x 8 buckets = 2^21 cells
        with pytest.raises(RpcError) as err:
            await c.call("create_table", name="wide", dim=4, admission=wide)
        assert err.value.code == "too_large" and err.value.http_status == 413
        assert (await c.call("list_tables"))["tables"] == []
        ok = {"admit_after": 2, "filter_width": 1 << 14}  # 2^19 cells
        await c.call("create_table", name="ok", dim=4, admission=ok)
        blocks = {b: st.value for b, st in ps.store.tables.tables["ok"].shards.items()}
        assert len(blocks) == 8 and all(blk.sketch is None for blk in blocks.values())
        with pytest.raises(RpcError) as err:  # 2^19 + 2^19 + 1 > 2^20
            await c.call("create", name="t", shape=[(1 << 19) + 1])
        assert err.value.code == "too_large"
        await c.call("create", name="t", shape=[1 << 18])
        ids = np.array([3], np.int64)
        await c.call("push_rows", table="ok", ids=ids, grads=np.ones((1, 4), np.float32))
        made = [b for b, blk in blocks.items() if blk.sketch is not None]
        assert made == [stable_bucket_of(ids, 8)]
    finally:
        await c.close()
        await runner.cleanup()


def stable_bucket_of(ids: np.ndarray, n_buckets: int) -> int:
    from adamps.tables import split_by_bucket

    (b,) = split_by_bucket(ids, n_buckets)
    return int(b)
