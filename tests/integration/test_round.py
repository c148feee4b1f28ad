"""The ``round`` op and its client (issue 36 item 2) on two parameter servers in-process on
loopback, each holding half of the buckets: a replica's round (fc vectors, dense deltas, row
gradients of two tables, and the rows it fetches next) is one request per server, over the data
plane and over HTTP; its values equal those of the separate pushes and pulls, bit for bit; its
fetch reads this round's own writes; a round refused by one server is sent again to that server
only, under the same (client, seq); a bad round changes nothing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from adamps.client import PSClient, StaticRouting
from adamps.client.prefetch import RowPipeline
from adamps.client.rpc import AsyncRpc, RpcError
from adamps.layout import Layout, TensorSpec
from adamps.server.api.app import ParameterServer
from adamps.server.config import PsConfig
from adamps.tables import buckets_of
from adamps.up.procs import free_port
from adamps.wire import web as aweb

TOKEN = "round-test-token"
N_BUCKETS = 8
ADAGRAD = {"kind": "adagrad", "lr": 0.05, "initial_accumulator": 0.1}
INIT = {"kind": "normal", "std": 0.1, "seed": 3}
#: twin tensors: "r." pushed by rounds, "s." by separate pushes; 50,000 elements per shard
TENSORS = [TensorSpec("fc.w", (600, 500)), TensorSpec("fc.b", (600,)), TensorSpec("c.w", (40, 25))]


async def start_two(
    tmp_path: Path, **overrides: object
) -> tuple[list[ParameterServer], list, list[str]]:
    servers, runners, urls = [], [], []
    halves = [list(range(0, N_BUCKETS // 2)), list(range(N_BUCKETS // 2, N_BUCKETS))]
    for i, buckets in enumerate(halves):
        port = free_port()
        cfg = PsConfig(
            port=port, data_port=free_port(), token=TOKEN, data_dir=str(tmp_path / f"ps{i}"),
            owner_threads=2, flush_interval=3600, n_buckets=N_BUCKETS, buckets=buckets,
            max_shard_elems=50_000, **overrides,
        )  # fmt: skip
        ps = ParameterServer(cfg)
        runners.append(await aweb.serve(ps.make_app(), "127.0.0.1", port))
        servers.append(ps)
        urls.append(f"http://127.0.0.1:{port}")
    return servers, runners, urls


async def stop(servers, runners) -> None:
    for r in runners:
        await r.cleanup()


def twins() -> Layout:
    specs = [TensorSpec(f"{p}{t.name}", t.shape) for p in ("r.", "s.") for t in TENSORS]
    return Layout(specs, n_buckets=N_BUCKETS, max_shard_elems=50_000)


def define(pc: PSClient) -> None:
    for spec in pc.layout.tensors.values():
        pc.create(spec, init=INIT, optimizer=ADAGRAD)
    for t in ("r.emb", "s.emb", "r.other", "s.other"):
        pc.create_table(t, 4, init=INIT, optimizer=ADAGRAD)


@pytest.mark.parametrize("data_plane", [True, False])
async def test_a_round_is_one_request_per_server_and_equals_separate_ops(
    tmp_path: Path, data_plane: bool
) -> None:
    servers, runners, urls = await start_two(tmp_path)
    try:

        def run() -> None:
            layout = twins()
            assert {b < N_BUCKETS // 2 for b in layout.bucket_of.values()} == {
                True,
                False,
            }
            with PSClient(
                StaticRouting(urls, N_BUCKETS), layout, TOKEN, data_plane=data_plane
            ) as pc:
                define(pc)
                rng = np.random.default_rng(1)
                for step in range(3):
                    a = rng.standard_normal((8, 500), np.float32)
                    e = rng.standard_normal((8, 600), np.float32)
                    d = {"fc.b": rng.standard_normal(600, np.float32)}
                    d["c.w"] = rng.standard_normal((40, 25), np.float32)
                    ids = rng.integers(0, 1000, 64)  # both servers' buckets, duplicates
                    g = rng.standard_normal((64, 4), np.float32)
                    ids2 = rng.integers(0, 1000, 16)
                    g2 = rng.standard_normal((16, 4), np.float32)
                    nxt = rng.integers(0, 1000, 32)
                    assert len(set(buckets_of(ids, N_BUCKETS) < N_BUCKETS // 2)) == 2
                    before = pc.dp_requests + pc.http_requests
                    got = pc.round(
                        {"r.fc.w": (a, e)},
                        {f"r.{n}": v for n, v in d.items()},
                        rows={"r.emb": (ids, g), "r.other": (ids2, g2)},
                        fetch_rows={"r.emb": nxt, "r.other": ids2},
                    )
                    # one request per server: the two servers, whatever the round carries
                    assert pc.dp_requests + pc.http_requests - before == 2, step
                    assert (pc.dp_requests > 0) == data_plane
                    pc.push_fc("s.fc.w", a, e)
                    pc.push_dense_many({f"s.{n}": v for n, v in d.items()})
                    pc.push_rows("s.emb", ids, g)
                    pc.push_rows("s.other", ids2, g2)
                    # the fetch reads the round's own writes: the separate pulls after the pushes
                    np.testing.assert_array_equal(got["r.emb"], pc.pull_rows("s.emb", nxt))
                    np.testing.assert_array_equal(got["r.other"], pc.pull_rows("s.other", ids2))
                vals, _ = pc.pull([s.name for s in layout.tensors.values()])
                for t in TENSORS:
                    np.testing.assert_array_equal(vals[f"r.{t.name}"], vals[f"s.{t.name}"])
                every = np.arange(1000)
                np.testing.assert_array_equal(
                    pc.pull_rows("r.emb", every), pc.pull_rows("s.emb", every)
                )

        await asyncio.to_thread(run)
    finally:
        await stop(servers, runners)


async def test_a_round_refused_by_one_server_is_resent_there_alone_under_its_pair(
    tmp_path: Path,
) -> None:
    """Server 1 holds its writes (a consistent checkpoint's cut: 503 held, retryable) for a
    moment: server 0 applies its part at the first attempt and is not sent it again; server 1
    gets its part again, under the same (client, seq), and applies it once."""
    servers, runners, urls = await start_two(tmp_path)
    try:
        layout = twins()
        pc = PSClient(StaticRouting(urls, N_BUCKETS), layout, TOKEN)
        await asyncio.to_thread(define, pc)
        ids = np.arange(64)
        g = np.ones((64, 4), np.float32)
        d = {"r.fc.b": np.ones(600, np.float32), "r.c.w": np.ones((40, 25), np.float32)}
        servers[1].writes.hold.hold("cut-1", time.monotonic(), 0.5)
        before = pc.dp_requests
        seq = pc.next_seq() + 100
        await asyncio.to_thread(lambda: pc.round(dense=d, rows={"r.emb": (ids, g)}, seq=seq))
        assert pc.retries >= 1
        # 2 requests at the first attempt, then one per retry, to server 1 alone
        assert pc.dp_requests - before == 2 + pc.retries
        for ps in servers:
            assert ps.writes.clients[pc.client_id] == seq
        # applied exactly once on both: the values of one push of each kind
        ref = PSClient(StaticRouting(urls, N_BUCKETS), layout, TOKEN)
        await asyncio.to_thread(
            lambda: ref.push_dense_many({"s." + k[2:]: v for k, v in d.items()})
        )
        await asyncio.to_thread(lambda: ref.push_rows("s.emb", ids, g))
        vals, vers = await asyncio.to_thread(
            lambda: ref.pull(["r.fc.b", "s.fc.b", "r.c.w", "s.c.w"])
        )
        np.testing.assert_array_equal(vals["r.fc.b"], vals["s.fc.b"])
        np.testing.assert_array_equal(vals["r.c.w"], vals["s.c.w"])
        assert vers["r.fc.b"] == vers["s.fc.b"] == [1] * len(vers["r.fc.b"])
        r, s = await asyncio.to_thread(
            lambda: (ref.pull_rows("r.emb", ids), ref.pull_rows("s.emb", ids))
        )
        np.testing.assert_array_equal(r, s)
        pc.close()
        ref.close()
    finally:
        await stop(servers, runners)


@pytest.mark.parametrize("data_plane", [True, False])
async def test_a_rounds_dense_fetch_rides_its_requests_and_reads_its_writes(
    tmp_path: Path, data_plane: bool
) -> None:
    """A synchronous Downpour step's push and fetch (issue 36): the round's ``fetch`` of whole
    tensors is answered in its one request per server, with the values a pull after it reads;
    retried (server 1 holds its writes for a moment), it is still applied once and answered."""
    servers, runners, urls = await start_two(tmp_path)
    try:

        def run() -> None:
            layout = twins()
            with PSClient(
                StaticRouting(urls, N_BUCKETS), layout, TOKEN, data_plane=data_plane
            ) as pc:
                define(pc)
                rng = np.random.default_rng(4)
                names = [f"r.{t.name}" for t in TENSORS]
                for step in range(3):
                    a = rng.standard_normal((8, 500), np.float32)
                    e = rng.standard_normal((8, 600), np.float32)
                    d = {"r.fc.b": rng.standard_normal(600, np.float32)}
                    out = {n: np.empty(layout.tensors[n].shape, np.float32) for n in names}
                    if step == 2:
                        servers[1].writes.hold.hold("cut-2", time.monotonic(), 0.5)
                    before = pc.dp_requests + pc.http_requests
                    pc.round({"r.fc.w": (a, e)}, d, fetch=out)
                    sent = pc.dp_requests + pc.http_requests - before
                    assert sent == 2 + pc.retries, (step, sent)  # a round and no pull
                    vals, _ = pc.pull(names)
                    for n in names:
                        np.testing.assert_array_equal(out[n], vals[n])
                assert pc.retries >= 1
                # applied exactly once: the versions count one update per round
                _, vers = pc.pull(["r.fc.b"])
                assert vers["r.fc.b"] == [3] * len(vers["r.fc.b"])

        await asyncio.to_thread(run)
    finally:
        await stop(servers, runners)


async def test_a_bad_round_is_refused_whole_and_changes_nothing(tmp_path: Path) -> None:
    servers, runners, urls = await start_two(tmp_path)
    try:
        layout = twins()
        pc = PSClient(StaticRouting(urls, N_BUCKETS), layout, TOKEN)
        await asyncio.to_thread(define, pc)
        ids = np.arange(0, 1000, 7)  # of both servers' buckets
        before = await asyncio.to_thread(pc.pull_rows, "r.emb", ids)
        c = AsyncRpc(urls[0], TOKEN)
        mine = ids[buckets_of(ids, N_BUCKETS) < N_BUCKETS // 2]
        good = {"table": "r.emb", "ids": mine, "grads": np.ones((len(mine), 4), np.float32)}
        fc_b = [s.id for s in layout.shards_of["r.fc.b"] if layout.bucket_of[s.id] < 4]
        cases = [
            ({"rows": [good], "fetch_rows": [{"table": "nope", "ids": mine}]}, "unknown_table"),
            ({"rows": [good, good]}, "bad_request"),
            ({"rows": [{**good, "grads": np.full((len(mine), 4), np.nan, np.float32)}]}, None),
            ({"rows": [{**good, "grads": np.ones((len(mine), 3), np.float32)}]}, "bad_shape"),
            ({"rows": "x"}, "bad_request"),
            ({}, "bad_request"),
            ({"rows": [good], "dense_shards": fc_b, "dense": np.ones(5, np.float32)}, "bad_shape"),
            ({"rows": [good], "fetch_shards": ["nope"]}, None),
            ({"rows": [good], "fetch_shards": "x"}, "bad_request"),
        ]
        for fields, code in cases:
            with pytest.raises(RpcError) as info:
                await c.call("round", client="c", seq=1, **fields)
            assert info.value.status // 100 == 4, (fields.keys(), info.value)
            if code is not None:
                assert info.value.code == code, (fields.keys(), info.value)
        after = await asyncio.to_thread(pc.pull_rows, "r.emb", ids)
        np.testing.assert_array_equal(before, after)
        # and the server keeps serving: a good round, with a fetch of its own rows
        # (a fetch_rows entry takes table and ids only: `grads` there is refused, opfields.py)
        fetch = {"table": good["table"], "ids": good["ids"]}
        got = await c.call("round", client="c", seq=2, rows=[good], fetch_rows=[fetch])
        assert got["rows"] == len(mine) and got["fetched"][0].shape == (len(mine), 4)
        assert not np.array_equal(got["fetched"][0], before[buckets_of(ids, N_BUCKETS) < 4])
        await c.close()
        pc.close()
    finally:
        await stop(servers, runners)


@pytest.mark.parametrize("depth", [0, 1])
async def test_pipelined_rows_are_never_older_than_the_bound(tmp_path: Path, depth: int) -> None:
    """RowPipeline (adamps/client/prefetch.py; docs/training.md, "Pipelined rows"): each round
    adds +1 (SGD, lr -1) to the rows of the same 64 ids on both servers and fetches them for the
    batch depth + 1 ahead. The rows batch t computes with then count the rounds they saw: at
    least t - depth (they lack at most `depth` of this replica's own rounds), at most t; with
    depth 0, exactly t (ZPushPull: round t - 1's answer includes its own writes)."""
    servers, runners, urls = await start_two(tmp_path)
    try:

        def run() -> list[tuple[int, float, int]]:

            pc = PSClient(StaticRouting(urls, N_BUCKETS), Layout([], N_BUCKETS), TOKEN)
            sgd = {"kind": "sgd", "lr": -1.0}
            pc.create_table("t", 1, init={"kind": "zeros"}, optimizer=sgd)
            ids = np.arange(64)
            ones = np.ones((64, 1), np.float32)
            seen = []
            with RowPipeline(pc, depth) as pipe:
                for _ in range(depth + 1):
                    pipe.prime({"t": ids})
                for t in range(12):
                    missing = pipe.staleness()
                    rows = pipe.next()["t"]
                    assert (rows == rows[0]).all()  # one read of every bucket after a round
                    seen.append((t, float(rows[0, 0]), missing))
                    time.sleep(0.01)  # the batch's compute, while the round is in flight
                    pipe.round(rows={"t": (ids, ones)}, fetch_rows={"t": ids})
                pipe.flush()
                assert pipe.staleness() == 0
            final = pc.pull_rows("t", ids)
            assert (final == 12).all()  # every round applied exactly once
            pc.close()
            return seen

        seen = await asyncio.to_thread(run)
        for t, value, missing in seen:
            assert t - depth <= value <= t, (t, value)
            assert value == t - missing, (t, value, missing)  # the pipeline's own account
            if depth == 0:
                assert value == t
            elif t >= 1:
                assert value == t - 1  # the fetch rode round t - 2: it lacks round t - 1 alone
    finally:
        await stop(servers, runners)


async def test_the_pipeline_refuses_a_depth_beyond_its_bound(tmp_path: Path) -> None:

    with pytest.raises(ValueError, match="depth must be 0 or 1"):
        RowPipeline(object(), depth=2)


async def test_a_round_over_the_servers_limits_goes_in_parts_with_the_same_result(
    tmp_path: Path,
) -> None:
    """max_body 256 KiB: a round of a 1.2 MB dense delta is sent as push_fc parts, push_rows
    and pull_rows (more than one request per server), with the separate pushes' values."""
    servers, runners, urls = await start_two(tmp_path, max_body=256 << 10)
    try:

        def run() -> None:
            layout = twins()
            with PSClient(StaticRouting(urls, N_BUCKETS), layout, TOKEN) as pc:
                define(pc)
                rng = np.random.default_rng(2)
                w = rng.standard_normal((600, 500), np.float32)
                ids = rng.integers(0, 1000, 64)
                g = rng.standard_normal((64, 4), np.float32)
                before = pc.dp_requests + pc.http_requests
                out = {"r.fc.w": np.empty((600, 500), np.float32)}
                got = pc.round(
                    dense={"r.fc.w": w},
                    rows={"r.emb": (ids, g)},
                    fetch_rows={"r.emb": ids},
                    fetch=out,
                )
                assert pc.dp_requests + pc.http_requests - before > 2
                pc.push_dense_many({"s.fc.w": w})
                pc.push_rows("s.emb", ids, g)
                np.testing.assert_array_equal(got["r.emb"], pc.pull_rows("s.emb", ids))
                vals, _ = pc.pull(["r.fc.w", "s.fc.w"])
                np.testing.assert_array_equal(vals["r.fc.w"], vals["s.fc.w"])
                # the dense fetch too, read after the parts (a pull of its own)
                np.testing.assert_array_equal(out["r.fc.w"], vals["r.fc.w"])

        await asyncio.to_thread(run)
    finally:
        await stop(servers, runners)


def test_a_rounds_tables_are_named_to_the_run_check() -> None:
    """A run's token may only name its own tables: a round names them inside `rows` and
    `fetch_rows`, so the tenancy check must see them (else a run could push another's rows)."""
    from adamps.server.api.tenancy import RUN_OPS, _names

    msg = {
        "op": "round",
        "layers": {"a..w": {"shards": ["a..w/0"]}},
        "rows": [{"table": "b..emb", "ids": None}],
        "fetch_rows": [{"table": "c..emb"}],
    }
    assert {"a..w", "a..w/0", "b..emb", "c..emb"} <= set(_names(msg))
    assert "round" in RUN_OPS


async def test_compressed_updates_ride_the_round(tmp_path: Path) -> None:
    """Strom's updates of some shards (``compressed``, as push_compressed's) in the same round
    as dense deltas and rows: one request per server, the separate pushes' values bit for bit;
    a shard named twice (dense and compressed) is refused by the client and by the server."""
    servers, runners, urls = await start_two(tmp_path)
    try:
        layout = twins()
        sgd = {"kind": "sgd", "lr": 0.5}

        def run() -> None:
            with PSClient(StaticRouting(urls, N_BUCKETS), layout, TOKEN) as pc:
                for spec in layout.tensors.values():
                    pc.create(spec, init=INIT, optimizer=sgd)
                pc.create_table("r.emb", 4, init=INIT, optimizer=sgd)
                pc.create_table("s.emb", 4, init=INIT, optimizer=sgd)
                idx = np.array([1, 7, 900, 4_000, 49_999], np.uint32)
                words = (idx << 1) | np.array([0, 1, 0, 1, 1], np.uint32)

                def comp(p: str) -> dict:
                    return {
                        s.id: {"tau": 0.25, "words": words} for s in layout.shards_of[p + "fc.w"]
                    }

                d = {"fc.b": np.ones(600, np.float32)}
                ids = np.arange(0, 100, 3)
                g = np.ones((len(ids), 4), np.float32)
                before = pc.dp_requests + pc.http_requests
                pc.round(
                    dense={"r.fc.b": d["fc.b"]}, compressed=comp("r."), rows={"r.emb": (ids, g)}
                )
                assert pc.dp_requests + pc.http_requests - before == 2
                pc.push_dense_many({"s.fc.b": d["fc.b"]})
                pc.push_compressed(comp("s."))
                pc.push_rows("s.emb", ids, g)
                vals, _ = pc.pull(["r.fc.w", "s.fc.w", "r.fc.b", "s.fc.b"])
                np.testing.assert_array_equal(vals["r.fc.w"], vals["s.fc.w"])
                np.testing.assert_array_equal(vals["r.fc.b"], vals["s.fc.b"])
                np.testing.assert_array_equal(
                    pc.pull_rows("r.emb", ids), pc.pull_rows("s.emb", ids)
                )
                with pytest.raises(ValueError, match="twice"):
                    pc.round(dense={"r.fc.w": vals["r.fc.w"]}, compressed=comp("r."))

        await asyncio.to_thread(run)
        c = AsyncRpc(urls[0], TOKEN)
        sid = next(s.id for s in layout.shards_of["r.c.w"] if layout.bucket_of[s.id] < 4)
        words = np.array([2], np.uint32)
        with pytest.raises(RpcError) as info:
            await c.call(
                "round", client="c", seq=1, dense_shards=[sid],
                dense=np.ones(1000, np.float32), compressed={sid: {"tau": 0.1, "words": words}},
            )  # fmt: skip
        assert info.value.code == "bad_request" and "twice" in str(info.value)
        await c.close()
    finally:
        await stop(servers, runners)
