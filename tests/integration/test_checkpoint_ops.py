"""The servers' checkpoint ops (issue 24) on a standalone server: ckpt_read returns a bucket's
values, accumulators and row blocks; ckpt_install restores them bit-identical through the write
path; bad installs get a 4xx naming the problem and change nothing."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import numpy as np
import pytest

from adamps.client.rpc import AsyncRpc, RpcError, get_text
from adamps.layout import stable_bucket
from adamps.optspec import Optimizer
from adamps.server.api.app import ParameterServer
from adamps.server.config import PsConfig
from adamps.up.procs import free_port
from adamps.wire import web as aweb

TOKEN = "ckpt-test-token"


async def start(tmp: Path, **opts: object) -> tuple[ParameterServer, aweb.web.AppRunner, AsyncRpc]:
    """A standalone server on loopback (every bucket), as test_ps_app.py starts one."""
    port = free_port()
    cfg = PsConfig(port=port, token=TOKEN, data_dir=str(tmp / "ps"), owner_threads=2,
                   flush_interval=3600, max_shard_elems=1000, **opts)  # fmt: skip
    ps = ParameterServer(cfg)
    runner = await aweb.serve(ps.make_app(), "127.0.0.1", port)
    return ps, runner, AsyncRpc(f"http://127.0.0.1:{port}", TOKEN)


ADA = {"name": "w", "shape": [2000], "init": {"kind": "normal", "std": 0.1, "seed": 1},
       "optimizer": {"kind": "adagrad", "lr": 0.1}}  # fmt: skip
TABLE = {"name": "emb", "dim": 3, "optimizer": {"kind": "adagrad", "lr": 0.1}}
#: float32 elements of the optimizer state of w's first shard (1000 values; torch's Adagrad keeps
#: an accumulator per element and a step count)
ACC = Optimizer.from_dict(ADA["optimizer"]).state_size(1000)


async def _filled(tmp: Path, **opts: object):
    server, runner, c = await start(tmp, **opts)
    await c.call("create", **ADA)
    await c.call("create_table", **TABLE)
    g = np.linspace(-1, 1, 2000, dtype=np.float32)
    await c.call("push_dense", tensor="w", delta=g)
    ids = np.arange(50, dtype=np.int64)
    await c.call("push_rows", table="emb", ids=ids, grads=np.ones((50, 3), np.float32))
    return server, runner, c


async def test_read_then_install_onto_an_empty_server_is_bit_identical(tmp_path: Path) -> None:
    _s1, r1, a = await _filled(tmp_path / "a")
    _s2, r2, b = await start(tmp_path / "b")
    try:
        await b.call("create", **{**ADA, "init": {"kind": "zeros"}})
        await b.call("create_table", **TABLE)
        n_buckets = (await a.get_json("/status"))["n_buckets"]
        bucket = stable_bucket("w/0", n_buckets)
        snap = await a.call("ckpt_read", bucket=bucket)
        assert "w/0" in snap["shards"] and snap["shards"]["w/0"]["a"] is not None
        shards = {sid: {"v": r["v"], "a": r["a"]} for sid, r in snap["shards"].items()}
        rows = {sid: {"b": r["b"]} for sid, r in snap["rows"].items()}
        await b.call("ckpt_install", bucket=bucket, shards=shards, rows=rows)
        again = await b.call("ckpt_read", bucket=bucket)
        for sid, rec in snap["shards"].items():
            assert again["shards"][sid]["v"].tobytes() == rec["v"].tobytes()
            assert again["shards"][sid]["a"].tobytes() == rec["a"].tobytes()
        for sid, rec in snap["rows"].items():
            assert again["rows"][sid]["b"] == rec["b"]
        # A second install on shards that took an update is refused unless forced.
        with pytest.raises(RpcError) as err:
            await b.call("ckpt_install", bucket=bucket, shards=shards)
        assert err.value.code == "conflict" and "force" in err.value.message
        await b.call("ckpt_install", bucket=bucket, shards=shards, force=True)
    finally:
        for c, r in ((a, r1), (b, r2)):
            await c.close()
            await r.cleanup()


@pytest.mark.parametrize(
    "bad, code, words",
    [
        ({"shards": {"w/0": {"v": np.zeros(7, np.float32)}}}, "bad_shape", "float32 of"),
        ({"shards": {"w/0": {"v": np.zeros(1000, np.float64)}}}, "bad_shape", "float32"),
        ({"shards": {"nope/0": {"v": np.zeros(1000, np.float32)}}}, "unknown", "nope"),
        # torch's Adagrad keeps its accumulator and a step count (2 float32) per shard
        (
            {"shards": {"w/0": {"v": np.zeros(1000, np.float32), "a": np.zeros(1000, np.float32)}}},
            "bad_shape",
            "accumulator must be float32 of 1002 elements",
        ),
        ({"rows": {"emb#rows/0": {"b": b"garbage!"}}}, "bad_request", "not a row block"),
        ({}, "bad_request", "needs 'shards' or 'rows'"),
        # issue 39 #7: an install's data is checked like a push's (finite, bounded)
        ({"shards": {"w/0": {"v": np.full(1000, np.nan, np.float32)}}}, "non_finite", "w/0"),
        ({"shards": {"w/0": {"v": np.full(1000, 3e38, np.float32)}}}, "bad_request", "w/0"),
        (
            {
                "shards": {
                    "w/0": {"v": np.zeros(1000, np.float32), "a": np.full(ACC, np.inf, np.float32)}
                }
            },
            "non_finite",
            "accum",
        ),
        (
            {
                "shards": {
                    "w/0": {"v": np.zeros(1000, np.float32), "a": np.full(ACC, -1.0, np.float32)}
                }
            },
            "bad_request",
            "negative",
        ),
    ],
)
async def test_a_bad_install_is_a_4xx_and_changes_nothing(
    tmp_path: Path, bad: dict, code: str, words: str
) -> None:
    _s, r, c = await _filled(tmp_path)
    try:
        n_buckets = (await c.get_json("/status"))["n_buckets"]
        b = stable_bucket("w/0", n_buckets)
        if "rows" in bad:
            b = 0
        before = await c.call("ckpt_read", bucket=b)
        with pytest.raises(RpcError) as err:
            await c.call("ckpt_install", bucket=b, force=True, **bad)
        assert 400 <= err.value.http_status < 500 and err.value.code.startswith(code)
        assert words in err.value.message
        after = await c.call("ckpt_read", bucket=b)
        for sid, rec in before["shards"].items():
            assert after["shards"][sid]["v"].tobytes() == rec["v"].tobytes()
        for sid, rec in before["rows"].items():
            assert after["rows"][sid]["b"] == rec["b"]
        assert (await c.call("list")) is not None  # still serving
    finally:
        await c.close()
        await r.cleanup()


async def test_a_row_block_holding_nan_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """Issue 39 #7: a well-formed row block whose values hold a NaN is a 4xx naming the row
    shard; the rows stay as they were."""
    _s, r, c = await _filled(tmp_path)
    try:
        head = struct.Struct("<4sIQIIQd")  # rowblock.py's header: magic, ver, n, dim, ...
        b = 0
        while True:  # a bucket that holds some of the 50 rows
            before = await c.call("ckpt_read", bucket=b)
            sid, rec = next(iter(before["rows"].items()))
            data = bytearray(rec["b"])
            n = head.unpack_from(data)[2]
            if n:
                break
            b += 1
        at = head.size + 16 * n  # the first row's first value, past the ids and last-seen times
        data[at : at + 4] = np.float32(np.nan).tobytes()
        with pytest.raises(RpcError) as err:
            await c.call("ckpt_install", bucket=b, force=True, rows={sid: {"b": bytes(data)}})
        assert err.value.code == "non_finite" and sid in err.value.message, err.value
        after = await c.call("ckpt_read", bucket=b)
        assert after["rows"][sid]["b"] == rec["b"]
    finally:
        await c.close()
        await r.cleanup()


async def test_a_row_block_naming_an_id_twice_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    """Skeptic 17: a row block whose ids repeat one was installed; the index kept one slot
    for it and the other slots stayed behind (flushed under the same key, exported twice)."""
    _s, r, c = await _filled(tmp_path)
    try:
        head = struct.Struct("<4sIQIIQd")
        b = 0
        while True:  # a bucket that holds at least two of the 50 rows
            before = await c.call("ckpt_read", bucket=b)
            sid, rec = next(iter(before["rows"].items()))
            data = bytearray(rec["b"])
            n = head.unpack_from(data)[2]
            if n >= 2:
                break
            b += 1
        ids = np.frombuffer(data, "<i8", n, head.size)
        data[head.size + 8 : head.size + 16] = ids[0].tobytes()  # the second id = the first
        with pytest.raises(RpcError) as err:
            await c.call("ckpt_install", bucket=b, force=True, rows={sid: {"b": bytes(data)}})
        assert err.value.code == "bad_request", err.value
        assert f"id {int(ids[0])} appears more than once" in err.value.message
        after = await c.call("ckpt_read", bucket=b)
        assert after["rows"][sid]["b"] == rec["b"]
    finally:
        await c.close()
        await r.cleanup()


async def test_a_row_block_of_another_bucket_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    """Skeptic 17: a row block installed into a bucket its ids do not hash to was taken: the
    rows were orphans there (pulls and pushes of their ids go to their own bucket), flushed
    and exported beside their own bucket's."""
    _s, r, c = await _filled(tmp_path)
    try:
        head = struct.Struct("<4sIQIIQd")
        b = 0
        while True:  # a bucket that holds some of the 50 rows
            rec = next(iter((await c.call("ckpt_read", bucket=b))["rows"].values()))
            n = head.unpack_from(rec["b"])[2]
            if n:
                break
            b += 1
        first = int(np.frombuffer(rec["b"], "<i8", n, head.size).min())
        other = b + 1  # the first bucket holding rows is one of the first few of 50 rows
        before = await c.call("ckpt_read", bucket=other)
        sid, kept = next(iter(before["rows"].items()))
        with pytest.raises(RpcError) as err:
            await c.call("ckpt_install", bucket=other, force=True, rows={sid: {"b": rec["b"]}})
        assert err.value.code == "bad_request", err.value
        assert f"id {first} belongs to bucket {b}, not {other}" in err.value.message, err.value
        after = await c.call("ckpt_read", bucket=other)
        assert after["rows"][sid]["b"] == kept["b"]
    finally:
        await c.close()
        await r.cleanup()


@pytest.mark.parametrize("bucket", [-1, 2**63, 10**6])
async def test_a_bucket_outside_the_cluster_is_a_400(tmp_path: Path, bucket: int) -> None:
    """Skeptic 17: ckpt_read of bucket -1 or 2^63 was answered 409 not_primary, which tells a
    client to look the primary up again and retry; it is a 400 naming the range."""
    _s, r, c = await _filled(tmp_path)
    try:
        n = (await c.get_json("/status"))["n_buckets"]
        for op, fields in (("ckpt_read", {}), ("ckpt_install", {"shards": {"w/0": {}}})):
            with pytest.raises(RpcError) as err:
                await c.call(op, bucket=bucket, **fields)
            assert err.value.code == "bad_request", err.value
            assert f"'bucket' must be in [0, {n}), got {bucket}" in err.value.message
        await c.call("ckpt_read", bucket=n - 1)
    finally:
        await c.close()
        await r.cleanup()


async def test_checkpoint_ops_need_the_cluster_token(tmp_path: Path) -> None:
    _s, r, c = await _filled(tmp_path)
    anon = AsyncRpc(c.base_url, None)
    try:
        with pytest.raises(RpcError) as err:
            await anon.call("ckpt_read", bucket=0)
        assert err.value.http_status == 401
    finally:
        await anon.close()
        await c.close()
        await r.cleanup()


async def test_an_incremental_read_leaves_out_what_did_not_change(tmp_path: Path) -> None:
    """ckpt_read with `since` (the previous checkpoint's epoch and versions) skips a shard
    whose version is unchanged, and reads it again once a push changed it."""
    _s, runner, a = await _filled(tmp_path / "a")
    try:
        n_buckets = (await a.get_json("/status"))["n_buckets"]
        bucket = stable_bucket("w/0", n_buckets)
        full = await a.call("ckpt_read", bucket=bucket)
        versions = {sid: r["version"] for sid, r in full["shards"].items()}
        versions.update({sid: r["version"] for sid, r in full["rows"].items()})
        since = {"versions": versions}
        same = await a.call("ckpt_read", bucket=bucket, since=since)
        assert same["shards"] == {} and same["rows"] == {}
        assert same["unchanged"] == versions
        older = {sid: v - 1 for sid, v in versions.items()}
        again = await a.call("ckpt_read", bucket=bucket, since={"versions": older})
        assert sorted(again["shards"]) == sorted(full["shards"]) and again["unchanged"] == {}
        await a.call("push_dense", tensor="w", delta=np.ones(2000, np.float32))
        after = await a.call("ckpt_read", bucket=bucket, since=since)
        assert "w/0" in after["shards"] and "w/0" not in after["unchanged"]
        assert after["shards"]["w/0"]["v"].tobytes() != full["shards"]["w/0"]["v"].tobytes()
    finally:
        await a.close()
        await runner.cleanup()


@pytest.mark.parametrize(
    "since",
    [
        "versions",
        [1, 2],
        {"versions": [1, 2]},
        {"versions": {"w/0": "3"}},
        {"versions": {"w/0": True}},
        {"versions": {"w/0": 1.0}},
        {"verisons": {"w/0": 1}},
    ],
)
async def test_a_malformed_since_is_a_400_naming_it(tmp_path: Path, since: object) -> None:
    """Issue 39 #15: a malformed `since` was ignored (the read then saved everything, silently)."""
    _s, runner, a = await _filled(tmp_path / "a")
    try:
        n_buckets = (await a.get_json("/status"))["n_buckets"]
        bucket = stable_bucket("w/0", n_buckets)
        with pytest.raises(RpcError) as bad:
            await a.call("ckpt_read", bucket=bucket, since=since)
        assert bad.value.code == "bad_request" and bad.value.http_status == 400
        assert "since" in str(bad.value)
        await a.call("ckpt_read", bucket=bucket, since={"versions": {}})  # still serving
    finally:
        await a.close()
        await runner.cleanup()


async def test_a_hold_refuses_writes_with_a_retryable_503_until_released_or_expired(
    tmp_path: Path,
) -> None:
    """ckpt_hold: pushes get 503 held (nothing applied) while held, reads and the cut's copy
    go on; the hold ends at release, or by itself at its expiry; a bad hold is a 400."""
    _s, runner, a = await _filled(tmp_path / "a")
    try:
        before = (await a.call("pull", tensors=["w"]))["tensors"]["w"]
        got = await a.call("ckpt_hold", cut="c1", seconds=5.0)
        assert got["positions"] and got["cut"] == "c1"
        with pytest.raises(RpcError) as exc:
            await a.call("push_dense", tensor="w", delta=np.ones(2000, np.float32))
        assert exc.value.http_status == 503 and exc.value.code == "held"
        after = (await a.call("pull", tensors=["w"]))["tensors"]["w"]
        assert after.tobytes() == before.tobytes()
        assert (await a.call("ckpt_release", cut="c1"))["released"] is True
        await a.call("push_dense", tensor="w", delta=np.ones(2000, np.float32))
        # The cut's copy is of the moment of the hold, read after the release.
        n_buckets = (await a.get_json("/status"))["n_buckets"]
        snap = await a.call("ckpt_read", bucket=stable_bucket("w/0", n_buckets), cut="c1")
        assert snap["shards"]["w/0"]["v"].tobytes() == before[:1000].tobytes()
        await a.call("ckpt_hold", cut="c2", seconds=0.2)
        await asyncio.sleep(0.3)  # expired: a save tool that died does not wedge the server
        await a.call("push_dense", tensor="w", delta=np.ones(2000, np.float32))
        for bad in (0.0, 31.0):
            with pytest.raises(RpcError) as exc:
                await a.call("ckpt_hold", cut="c3", seconds=bad)
            assert exc.value.http_status == 400 and "seconds" in str(exc.value)
        await a.call("push_dense", tensor="w", delta=np.ones(2000, np.float32))
    finally:
        await a.close()
        await runner.cleanup()


async def test_a_cut_copies_only_the_shards_written_after_it(tmp_path: Path) -> None:
    """A consistent cut by copy-on-write (issue 38 item 7): the hold only marks the shards; a
    shard written after the cut is copied before that write, the others are read as they are,
    and the cut reads every one of them (dense and rows) as it was at the cut."""
    server, runner, a = await _filled(tmp_path / "a")
    try:
        n_buckets = (await a.get_json("/status"))["n_buckets"]
        before = (await a.call("pull", tensors=["w"]))["tensors"]["w"]
        ids = np.arange(50, dtype=np.int64)
        rows_before = (await a.call("pull_rows", table="emb", ids=ids))["rows"]
        await a.call("ckpt_hold", cut="c", seconds=5.0)
        _at, marks, buckets = server.checkpoints.cuts["c"]
        assert marks.copies == {}  # nothing copied under the hold
        assert stable_bucket("w/0", n_buckets) in buckets
        await a.call("ckpt_release", cut="c")
        await a.call("push_dense", shards={"w/0": np.ones(1000, np.float32)})  # w/0 only
        await a.call("push_rows", table="emb", ids=ids, grads=np.ones((50, 3), np.float32))
        assert "w/0" in marks.copies and "w/1" not in marks.copies
        assert any("#rows/" in sid for sid in marks.copies)
        got_w: dict[str, np.ndarray] = {}
        blocks = {}
        for b in sorted(set(buckets)):
            snap = await a.call("ckpt_read", bucket=b, cut="c")
            got_w.update({sid: r["v"] for sid, r in snap["shards"].items()})
            blocks.update({sid: r["b"] for sid, r in snap["rows"].items()})
        assert got_w["w/0"].tobytes() == before[:1000].tobytes()
        assert got_w["w/1"].tobytes() == before[1000:].tobytes()
        assert (await a.call("pull", tensors=["w"]))["tensors"]["w"][0] != before[0]
        # the rows as they were: install the cut's blocks onto a fresh server and pull them
        _s2, r2, b2 = await start(tmp_path / "b")
        try:
            await b2.call("create_table", **TABLE)
            for sid, block in blocks.items():
                bucket = int(sid.rsplit("/", 1)[1])
                await b2.call("ckpt_install", bucket=bucket, rows={sid: {"b": block}})
            restored = (await b2.call("pull_rows", table="emb", ids=ids))["rows"]
            assert restored.tobytes() == rows_before.tobytes()
        finally:
            await b2.close()
            await r2.cleanup()
        assert "c" not in server.checkpoints.cuts and not marks.copies  # all read: forgotten
    finally:
        await a.close()
        await runner.cleanup()


async def test_install_through_a_static_routing_carries_the_accumulators(tmp_path: Path) -> None:
    """adamps.checkpoint.save_restore.install (what a warm start uses to carry the optimizer's state) on a
    standalone server found through a static routing: values and state bit-identical. The
    state of torch's Adagrad is each shard's accumulator and step count, one shard's after the
    other (adamps.optspec.state_ranges)."""
    from adamps.checkpoint.save_restore import Cluster, install
    from adamps.client import StaticRouting
    from adamps.layout import Layout, TensorSpec
    from adamps.optspec import Optimizer, state_ranges

    server, runner, a = await start(tmp_path / "a")
    try:
        await a.call("create", **{**ADA, "init": {"kind": "zeros"}})
        n_buckets = (await a.get_json("/status"))["n_buckets"]
        url = f"http://127.0.0.1:{server.cfg.port}"
        layout = Layout([TensorSpec("w", (2000,))], n_buckets=n_buckets, max_shard_elems=1000)
        values = np.linspace(0, 1, 2000, dtype=np.float32)
        accum = np.linspace(1, 2, 2 * (1000 + 2), dtype=np.float32)
        accum[1000:1002] = accum[-2:] = np.array([7], "<u8").view(np.float32)  # 7 steps each
        cluster = Cluster([], TOKEN, source=StaticRouting([url], n_buckets))
        defs = [{"name": "w", "optimizer": ADA["optimizer"]}]
        try:
            n = await asyncio.to_thread(
                install, cluster, layout, defs, {"w": values, "w/accum": accum}
            )
        finally:
            cluster.close()
        assert n == 2
        shards = layout.shards_of["w"]
        where = state_ranges(
            Optimizer.from_dict(ADA["optimizer"]), [(s.start, s.stop) for s in shards]
        )
        for s, (lo, hi) in zip(shards, where, strict=True):
            snap = await a.call("ckpt_read", bucket=layout.bucket_of[s.id])
            rec = snap["shards"][s.id]
            assert rec["v"].tobytes() == values[s.start : s.stop].tobytes()
            assert rec["a"].tobytes() == accum[lo:hi].tobytes()
    finally:
        await a.close()
        await runner.cleanup()


async def test_an_install_carries_its_version_and_never_lowers_one(tmp_path: Path) -> None:
    """Issue 39 #17: ckpt_install with `n` (the checkpoint's version): a fresh shard takes it;
    a shard already past it (a rollback) takes one more than its own, so an equal version is
    still equal data for an incremental checkpoint. A bad `n` is a 400, nothing applied."""
    _s, r, c = await _filled(tmp_path)
    try:
        n_buckets = (await c.get_json("/status"))["n_buckets"]
        b = stable_bucket("w/0", n_buckets)
        v0 = (await c.call("ckpt_read", bucket=b))["shards"]["w/0"]["version"]
        vals = np.zeros(1000, np.float32)
        await c.call("ckpt_install", bucket=b, force=True, shards={"w/0": {"v": vals, "n": 40}})
        assert (await c.call("ckpt_read", bucket=b))["shards"]["w/0"]["version"] == 40
        await c.call("ckpt_install", bucket=b, force=True, shards={"w/0": {"v": vals, "n": 5}})
        assert (await c.call("ckpt_read", bucket=b))["shards"]["w/0"]["version"] == 41
        await c.call("ckpt_install", bucket=b, force=True, shards={"w/0": {"v": vals}})
        assert (await c.call("ckpt_read", bucket=b))["shards"]["w/0"]["version"] == 42 > v0
        for bad in (-1, "7", 1.5):
            with pytest.raises(RpcError) as err:
                await c.call("ckpt_install", bucket=b, force=True,
                             shards={"w/0": {"v": vals + 1, "n": bad}})  # fmt: skip
            assert err.value.code == "bad_request" and "version" in err.value.message
        snap = await c.call("ckpt_read", bucket=b)
        assert snap["shards"]["w/0"]["version"] == 42 and not snap["shards"]["w/0"]["v"].any()
        rb = next(iter(snap["rows"]))
        await c.call("ckpt_install", bucket=b, force=True,
                     rows={rb: {"b": snap["rows"][rb]["b"], "n": 77}})  # fmt: skip
        assert (await c.call("ckpt_read", bucket=b))["rows"][rb]["version"] == 77
    finally:
        await c.close()
        await r.cleanup()


async def test_an_install_version_past_2_62_is_refused_and_the_server_keeps_persisting(
    tmp_path: Path,
) -> None:
    """Skeptic 17: an install of n = 2^64 - 1 was taken; the next push made the version 2^64,
    which neither a shard's LMDB record (uint64) nor a msgpack reply holds: every flush and
    describe of the shard failed with 500 from then on. An `n` beyond 2^62 is a 400 naming the
    bound, nothing applied, and the server goes on pushing, describing and flushing."""
    _s, r, c = await _filled(tmp_path)
    try:
        n_buckets = (await c.get_json("/status"))["n_buckets"]
        b = stable_bucket("w/0", n_buckets)
        rb = next(iter((await c.call("ckpt_read", bucket=b))["rows"]))
        block = (await c.call("ckpt_read", bucket=b))["rows"][rb]["b"]
        vals = np.zeros(1000, np.float32)
        for bad in (2**64 - 1, 2**63, 2**62 + 1):
            for fields in ({"shards": {"w/0": {"v": vals, "n": bad}}},
                           {"rows": {rb: {"b": block, "n": bad}}}):  # fmt: skip
                with pytest.raises(RpcError) as err:
                    await c.call("ckpt_install", bucket=b, force=True, **fields)
                assert err.value.code == "bad_request" and "2^62" in err.value.message
        before = await c.call("ckpt_read", bucket=b)
        await c.call("push_dense", tensor="w", delta=np.ones(2000, np.float32))
        d = await c.call("describe", name="w")
        assert d["shards"][0]["version"] == before["shards"]["w/0"]["version"] + 1
        flushed = await c.post_json("/flush", {})
        assert flushed["shards"] >= 1
        # the bound itself is taken: a version a run can reach
        await c.call("ckpt_install", bucket=b, force=True, shards={"w/0": {"v": vals, "n": 2**62}})
        assert (await c.call("ckpt_read", bucket=b))["shards"]["w/0"]["version"] == 2**62
    finally:
        await c.close()
        await r.cleanup()


async def test_an_install_travels_on_the_data_plane_and_is_checked_like_a_push(
    tmp_path: Path,
) -> None:
    """A restore's shards go to a server's data port as raw out-of-band payloads (issue 38
    item 7: no msgpack copy of the values), through the same checks: bit-identical values and
    optimizer state, and a NaN refused with a 4xx that changes nothing."""
    from adamps.checkpoint.save_restore import Cluster, install
    from adamps.client import StaticRouting
    from adamps.layout import Layout, TensorSpec

    server, runner, a = await start(tmp_path / "a", data_port=free_port())
    try:
        await a.call("create", **{**ADA, "init": {"kind": "zeros"}})
        n_buckets = (await a.get_json("/status"))["n_buckets"]
        url = f"http://127.0.0.1:{server.cfg.port}"
        layout = Layout([TensorSpec("w", (2000,))], n_buckets=n_buckets, max_shard_elems=1000)
        values = np.linspace(0, 1, 2000, dtype=np.float32)
        accum = np.linspace(1, 2, 2 * ACC, dtype=np.float32)
        accum[1000:1002] = accum[-2:] = np.array([7], "<u8").view(np.float32)
        defs = [{"name": "w", "optimizer": ADA["optimizer"]}]
        cluster = Cluster([], TOKEN, source=StaticRouting([url], n_buckets))
        try:
            n = await asyncio.to_thread(
                install, cluster, layout, defs, {"w": values, "w/accum": accum}
            )
            bad = values.copy()
            bad[1500] = np.nan
            with pytest.raises(RpcError) as err:
                await asyncio.to_thread(
                    install, cluster, layout, defs, {"w": bad, "w/accum": accum}, None, True
                )
        finally:
            cluster.close()
        assert n == 2
        assert err.value.code == "non_finite" and "NaN/Inf" in err.value.message
        for s in layout.shards_of["w"]:
            snap = await a.call("ckpt_read", bucket=layout.bucket_of[s.id])
            assert snap["shards"][s.id]["v"].tobytes() == values[s.start : s.stop].tobytes()
        text = await asyncio.to_thread(get_text, url, "/metrics")
        ok = [ln for ln in text.splitlines() if "dp_ckpt_install" in ln and '"ok"' in ln]
        assert ok and float(ok[0].rsplit(" ", 1)[1]) >= 2, ok  # both shards on the data plane
        assert (await a.call("list")) is not None  # still serving
    finally:
        await a.close()
        await runner.cleanup()


async def test_a_create_of_zeros_writes_no_values_and_a_restart_derives_them(
    tmp_path: Path,
) -> None:
    """A restore creates its tensors as zeros and installs the checkpoint over them (issue 38
    item 7): the create writes the definition alone, not a pass of zeros over the model, and a
    restart derives the same zero shards and fresh optimizer state (version 0); a tensor of
    another init keeps its written values; a pushed shard is flushed as before."""
    s1, r1, c = await start(tmp_path)
    try:
        await c.call("create", **{**ADA, "init": {"kind": "zeros"}})
        await c.call("create", **{**ADA, "name": "n"})
        nb = (await c.get_json("/status"))["n_buckets"]
        fresh = await c.call("ckpt_read", bucket=stable_bucket("w/0", nb))
        saved = {sd.meta["spec"]["name"]: sd for sd in s1.catalog.persister.load()}
        assert set(saved) >= {"w", "n"}
        assert not saved["w"].shards  # the definition alone
        assert sorted(saved["n"].shards) == ["n/0", "n/1"]
        await c.call("push_dense", tensor="w", delta=np.full(2000, 0.5, np.float32))
        pushed = await c.call("pull", tensors=["w"])
    finally:
        await c.close()
        await r1.cleanup()  # closes the server (its final flush)
    _s2, r2, c = await start(tmp_path)
    try:
        again = await c.call("pull", tensors=["w"])
        assert again["tensors"]["w"].tobytes() == pushed["tensors"]["w"].tobytes()
        await c.call("create", **{**ADA, "name": "z", "init": {"kind": "zeros"}})
    finally:
        await c.close()
        await r2.cleanup()  # closes the server (its final flush)
    _s3, r3, c = await start(tmp_path)
    try:
        snap = await c.call("ckpt_read", bucket=stable_bucket("z/0", nb))
        rec, ref = snap["shards"]["z/0"], fresh["shards"]["w/0"]
        assert rec["version"] == 0 and not rec["v"].any()
        assert rec["a"].tobytes() == ref["a"].tobytes()  # fresh optimizer state
    finally:
        await c.close()
        await r3.cleanup()  # closes the server (its final flush)


async def test_a_read_travels_on_the_data_plane_with_its_arrays_as_the_raw_payload(
    tmp_path: Path,
) -> None:
    """A save's ckpt_read goes to the data port and its shards come back out of band, as the
    frame's raw payload (issue 38 item 7: the client receives them into one buffer and writes
    the file from it; before, a bucket was one msgpack reply over HTTP): the same values,
    accumulators and row blocks as the HTTP reply, and the file written from them is the one
    safetensors writes."""
    from safetensors.numpy import save as st_save

    from adamps.checkpoint.format import write_file
    from adamps.checkpoint.save_restore import Cluster
    from adamps.client import StaticRouting
    from adamps.client.dataplane import REPLY, DataPlaneClient
    from adamps.wire import protocol

    dp_port = free_port()
    server, runner, a = await _filled(tmp_path / "a", data_port=dp_port)
    try:
        n_buckets = (await a.get_json("/status"))["n_buckets"]
        bucket = stable_bucket("w/0", n_buckets)
        want = await a.call("ckpt_read", bucket=bucket)

        def frame() -> tuple[int, int, dict]:
            with DataPlaneClient("127.0.0.1", dp_port, TOKEN) as dp:
                assert dp.send_message("ckpt_read", bucket=bucket)
                kind, payload_len, meta = dp._read_head()
                body = memoryview(np.empty(payload_len, np.uint8))
                dp._recv_exact(body)
                return kind, payload_len, protocol.decode(meta, body)

        kind, payload_len, raw = await asyncio.to_thread(frame)
        assert kind == REPLY
        arrays = [r[k] for r in raw["shards"].values() for k in ("v", "a")]
        assert payload_len >= sum(x.nbytes for x in arrays) > 0  # out of band, raw
        url = f"http://127.0.0.1:{server.cfg.port}"
        cluster = Cluster([], TOKEN, source=StaticRouting([url], n_buckets))
        try:  # what a save calls
            got = await asyncio.to_thread(
                lambda: cluster.message(cluster.rpc(url), "ckpt_read", bucket=bucket)
            )
        finally:
            cluster.close()
        assert not got["shards"]["w/0"]["v"].flags.owndata  # a view of the received payload
        for sid, rec in want["shards"].items():
            for k in ("v", "a"):
                assert got["shards"][sid][k].tobytes() == rec[k].tobytes()
                assert raw["shards"][sid][k].tobytes() == rec[k].tobytes()
        assert got["rows"] == want["rows"] and got["seq"] == want["seq"]
        content = {sid: r["v"] for sid, r in got["shards"].items()}
        content |= {f"{sid}/accum": r["a"] for sid, r in got["shards"].items()}
        content |= {sid: np.frombuffer(r["b"], np.uint8) for sid, r in got["rows"].items()}
        entry = write_file(tmp_path / "f.safetensors", content)
        assert (tmp_path / "f.safetensors").read_bytes() == st_save(content)
        assert entry["bytes"] == len(st_save(content))
    finally:
        await a.close()
        await runner.cleanup()
