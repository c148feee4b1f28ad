"""A restore at the disk's speed (issue 38 item 7), on an in-process standalone server: its
tensors defined in one ``create_tensors`` per server (checked whole: a bad definition creates
none), its row blocks sent to the data port as raw payloads like the dense shards, and a
hostile install frame (a payload shorter than its arrays, one over the body limit, one cut off
mid-stream, a row block of the wrong dtype) refused with an error naming the problem, nothing
changed, the server serving on."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adamps.client.dataplane import HEADER, REQUEST, frame_header
from adamps.client.rpc import AsyncRpc, RpcError, get_text
from adamps.server.api.app import ParameterServer
from adamps.server.config import PsConfig
from adamps.up.procs import free_port
from adamps.wire import protocol
from adamps.wire import web as aweb
from tests.integration.test_connections import TOKEN, start_ps


async def _server(tmp: Path, **opts: Any) -> tuple[ParameterServer, Any, AsyncRpc]:
    port = free_port()
    cfg = PsConfig(port=port, token=TOKEN, data_dir=str(tmp / "ps"), owner_threads=1,
                   flush_interval=3600, max_shard_elems=1000, **opts)  # fmt: skip
    ps = ParameterServer(cfg)
    runner = await aweb.serve(ps.make_app(), "127.0.0.1", port)
    return ps, runner, AsyncRpc(f"http://127.0.0.1:{port}", TOKEN)


def _defn(name: str, n: int, **more: Any) -> dict[str, Any]:
    return {"name": name, "shape": [n], "init": {"kind": "zeros"},
            "optimizer": {"kind": "adagrad", "lr": 0.1}, **more}  # fmt: skip


async def _names(c: AsyncRpc) -> list[str]:
    return sorted(d["name"] for d in (await c.call("list"))["tensors"])


@pytest.mark.parametrize(
    ("tensors", "code", "named"),
    [
        ([], "bad_request", "lists no definition"),
        ([_defn("a", 10), {"name": "b", "shape": [-1]}], "bad_shape", "tensors[1] ('b')"),
        ([_defn("a", 10), "b"], "bad_request", "tensors[1] must be a map"),
        ([_defn("a", 10), _defn("a", 10)], "bad_request", "tensor 'a' named twice"),
        ([_defn("a", 10), _defn("b", 10, optimizer={"kind": "nope"})], "bad_request", "tensors[1]"),
        ([_defn("a", 3000), _defn("b", 3000)], "too_large", "'b' would put 6000 elements"),
    ],
)
async def test_create_tensors_checks_every_definition_before_it_creates_any(
    tmp_path: Path, tensors: list[Any], code: str, named: str
) -> None:
    _ps, runner, c = await _server(tmp_path, max_server_elems=5000)
    try:
        with pytest.raises(RpcError) as err:
            await c.call("create_tensors", tensors=tensors)
        assert err.value.code == code and named in err.value.message, err.value
        assert await _names(c) == []  # nothing created, not even the good ones
        await c.call("create", **_defn("ok", 10))  # still serving
    finally:
        await c.close()
        await runner.cleanup()


async def test_create_tensors_defines_all_at_once_durably_and_idempotently(
    tmp_path: Path,
) -> None:
    # 300 small tensors too: laid out once, not a layout rebuilt per tensor
    defs = (
        [_defn(f"t{i}", 2500) for i in range(5)]
        + [{"name": "n", "shape": [40, 30], "init": {"kind": "normal", "std": 0.1, "seed": 7}}]
        + [{"name": f"s{i}", "shape": [3]} for i in range(300)]
    )
    _ps, runner, c = await _server(tmp_path)
    try:
        got = await c.call("create_tensors", tensors=defs)
        assert sorted(got["created"]) == sorted(d["name"] for d in defs) and got["tensors"] == 306
        seeded = (await c.call("pull", shards=["n/0", "n/1"]))["shards"]
        again = await c.call("create_tensors", tensors=defs)  # the same: nothing new
        assert again["created"] == []
        await c.call("create", **_defn("t0", 2500))  # create agrees with it
        with pytest.raises(RpcError) as err:  # another definition under a name it holds
            await c.call("create_tensors", tensors=[_defn("fresh", 5), _defn("t1", 7)])
        assert err.value.code == "exists" and "'t1'" in err.value.message
        assert "fresh" not in await _names(c)
    finally:
        await c.close()
        await runner.cleanup()
    # Written in LMDB before the reply: a restarted server holds every one of them
    _ps, runner, c = await _server(tmp_path)
    try:
        assert await _names(c) == sorted(d["name"] for d in defs)
        reloaded = (await c.call("pull", shards=["n/0", "n/1"]))["shards"]
        for sid in ("n/0", "n/1"):
            assert reloaded[sid].tobytes() == seeded[sid].tobytes()
    finally:
        await c.close()
        await runner.cleanup()


@pytest.mark.parametrize("data_port", [True, False])
async def test_row_shards_are_restored_over_the_data_plane_bit_exact(
    tmp_path: Path, data_port: bool
) -> None:
    """A table's row blocks go to the data port as raw payloads (they went over HTTP, msgpack
    bytes), through the same checks: read back bit-identical. A server without a data port
    takes the same uint8 block over HTTP."""
    from adamps.checkpoint.restore import send
    from adamps.checkpoint.save_restore import Cluster
    from adamps.client import StaticRouting

    table = {"name": "emb", "dim": 3, "optimizer": {"kind": "adagrad", "lr": 0.1}}
    a, ra, ca = await _server(tmp_path / "a")
    b, rb, cb = await _server(tmp_path / "b", data_port=free_port() if data_port else 0)
    try:
        await ca.call("create_table", **table)
        ids = np.arange(300, dtype=np.int64)
        grads = np.linspace(-1, 1, 900, dtype=np.float32).reshape(300, 3)
        await ca.call("push_rows", table="emb", ids=ids, grads=grads)
        n_buckets = (await ca.get_json("/status"))["n_buckets"]
        want: dict[str, bytes] = {}
        rows: dict[int, dict[str, Any]] = {}
        for bucket in range(n_buckets):
            for sid, rec in (await ca.call("ckpt_read", bucket=bucket))["rows"].items():
                want[sid] = rec["b"]
                block = np.frombuffer(rec["b"], np.uint8)
                rows.setdefault(bucket, {})[sid] = {"b": block, "n": rec["version"]}
        assert len(want) > 1
        await cb.call("create_table", **table)
        url = f"http://127.0.0.1:{b.cfg.port}"
        cluster = Cluster([], TOKEN, source=StaticRouting([url], n_buckets))
        try:
            n = await asyncio.to_thread(send, cluster, n_buckets, {}, rows, False, 1 << 20, 2)
        finally:
            cluster.close()
        assert n == len(want)
        for bucket in range(n_buckets):
            got = (await cb.call("ckpt_read", bucket=bucket))["rows"]
            for sid, rec in got.items():
                if sid in want:
                    assert rec["b"] == want[sid], sid
                    # the checkpoint's version, or one more than the fresh shard's 0
                    assert rec["version"] == max(1, rows[bucket][sid]["n"])
        text = await asyncio.to_thread(get_text, url, "/metrics")
        ok = [ln for ln in text.splitlines() if "dp_ckpt_install" in ln and '"ok"' in ln]
        if data_port:
            assert ok and float(ok[0].rsplit(" ", 1)[1]) >= len(rows), ok  # all on the data port
        else:
            assert not ok, ok
    finally:
        for c, r in ((ca, ra), (cb, rb)):
            await c.close()
            await r.cleanup()


# -- hostile install frames ------------------------------------------------------------------


def _frame(meta: dict[str, Any], payload_len: int) -> bytes:
    body = protocol.encode(protocol.request("ckpt_install", token=TOKEN, **meta))
    return frame_header(REQUEST, len(body), payload_len) + body


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            raise ConnectionError("closed")
        out += got
    return out


def _reply(s: socket.socket) -> dict[str, Any]:
    """The error frame's meta (the reply to the frame sent)."""
    _m, _v, _kind, _z, meta_len, payload_len = HEADER.unpack(_recv_exact(s, HEADER.size))
    meta = _recv_exact(s, meta_len)
    _recv_exact(s, payload_len)
    return protocol.decode(meta)


def _oob(at: int, n: int, dtype: str = "float32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": [n], "at": at}


async def test_a_hostile_install_payload_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    ps, runner, dport = await start_ps(tmp_path, max_body=1 << 20)
    rpc = AsyncRpc(f"http://127.0.0.1:{ps.cfg.port}", TOKEN)
    try:
        await rpc.call("create", name="w", shape=[1000], init={"kind": "constant", "value": 2.0})
        await rpc.call("create_table", name="emb", dim=3)
        bucket = ps.store.layout.bucket_of["w/0"]
        rsid = f"emb#rows/{bucket}"

        def hostile() -> list[dict[str, Any]]:
            out = []
            with socket.create_connection(("127.0.0.1", dport), timeout=10) as s:
                # the arrays overrun the payload the frame carries (4000 bytes named, 2000 sent)
                s.sendall(_frame({"bucket": bucket, "shards": {"w/0": {"v": _oob(0, 1000)}}},
                                 2000) + bytes(2000))  # fmt: skip
                out.append(_reply(s))
                # a row block of float32, not bytes
                s.sendall(_frame({"bucket": bucket, "rows": {rsid: {"b": _oob(0, 4)}}}, 16)
                          + bytes(16))  # fmt: skip
                out.append(_reply(s))
            with socket.create_connection(("127.0.0.1", dport), timeout=10) as s:
                # a payload over the body limit: refused from its header, never read
                s.sendall(_frame({"bucket": bucket, "shards": {"w/0": {"v": _oob(0, 1000)}}},
                                 (1 << 20) + 8))  # fmt: skip
                out.append(_reply(s))
            with socket.create_connection(("127.0.0.1", dport), timeout=10) as s:
                # the client leaves mid-payload
                s.sendall(_frame({"bucket": bucket, "shards": {"w/0": {"v": _oob(0, 1000)}}},
                                 4000) + np.ones(500, np.float32).tobytes())  # fmt: skip
            return out

        replies = await asyncio.to_thread(hostile)
        errors = [(r["error"]["code"], r["error"]["message"]) for r in replies]
        assert errors[0][0] == "bad_length" and "overruns the payload" in errors[0][1], errors
        assert errors[1][0] == "bad_request" and rsid in errors[1][1], errors
        assert "uint8" in errors[1][1], errors
        assert errors[2][0] == "too_large", errors
        await asyncio.sleep(0.3)
        got = (await rpc.call("pull", shards=["w/0"]))["shards"]["w/0"]
        np.testing.assert_array_equal(got, np.full(1000, 2.0, np.float32))  # nothing applied
        described = await rpc.call("describe", name="w")
        assert described["shards"][0]["version"] == 0
        assert ps.store.tables.shard(rsid).value.n == 0
    finally:
        await rpc.close()
        await runner.cleanup()


@pytest.mark.parametrize("kind", ["sgd", "adam"])
async def test_a_forced_restore_onto_another_optimizer_takes_the_values_only(
    tmp_path: Path, kind: str
) -> None:
    """Skeptic 17, docs/operations.md ("Restore"): a tensor the cluster holds under another
    optimizer than the checkpoint's keeps its definition and takes the checkpoint's values, its
    optimizer state afresh. The restore sent the checkpoint's Adagrad accumulator anyway: SGD's
    and Adam's shards refused it (bad_shape) after the creates and the other installs."""
    from adamps.checkpoint.restore import restore
    from adamps.checkpoint.save_restore import Cluster, save
    from adamps.client import StaticRouting

    a, ra, ca = await _server(tmp_path / "a")
    b, rb, cb = await _server(tmp_path / "b", data_port=free_port())
    clusters = []
    try:
        await ca.call("create_tensors", tensors=[_defn("w", 2500), _defn("x", 10)])
        await ca.call("push_dense", tensor="w", delta=np.linspace(-1, 1, 2500, dtype=np.float32))
        want = (await ca.call("pull", tensors=["w"]))["tensors"]["w"]
        n_buckets = (await ca.get_json("/status"))["n_buckets"]
        for srv in (a, b):
            url = f"http://127.0.0.1:{srv.cfg.port}"
            clusters.append(Cluster([], TOKEN, source=StaticRouting([url], n_buckets)))
        ckpt = tmp_path / "ckpt"
        await asyncio.to_thread(save, clusters[0], ckpt)
        opt = {"kind": kind, "lr": 0.5}
        await cb.call("create", name="w", shape=[2500], optimizer=opt)
        await asyncio.to_thread(restore, clusters[1], ckpt, True)
        got = (await cb.call("pull", tensors=["w"]))["tensors"]["w"]
        assert got.tobytes() == want.tobytes()
        d = await cb.call("describe", name="w")
        assert d["optimizer"]["kind"] == kind and d["optimizer"]["lr"] == 0.5
        # x, which the cluster lacked, is created with the checkpoint's definition
        assert (await cb.call("describe", name="x"))["optimizer"]["kind"] == "adagrad"
        # its state is fresh: the next push moves it as a first step of `kind` would
        await cb.call("push_dense", tensor="w", delta=np.ones(2500, np.float32))
        after = (await cb.call("pull", tensors=["w"]))["tensors"]["w"]
        assert np.allclose(want - after, 0.5, atol=1e-4)
    finally:
        for cl in clusters:
            cl.close()
        for c, r in ((ca, ra), (cb, rb)):
            await c.close()
            await r.cleanup()


async def test_a_forced_restore_onto_a_table_of_another_row_layout_writes_nothing(
    tmp_path: Path,
) -> None:
    """Skeptic 17: a table the cluster holds under an optimizer keeping another state per row
    cannot take the checkpoint's row blocks whole; the first row install failed ("not a row
    block") after the creates and the other installs. Now refused before any write."""
    from adamps.checkpoint.format import CheckpointError
    from adamps.checkpoint.restore import restore
    from adamps.checkpoint.save_restore import Cluster, save
    from adamps.client import StaticRouting

    a, ra, ca = await _server(tmp_path / "a")
    b, rb, cb = await _server(tmp_path / "b", data_port=free_port())
    clusters = []
    try:
        await ca.call("create", **_defn("w", 2500))
        await ca.call("create_table", name="emb", dim=4, optimizer={"kind": "adagrad", "lr": 0.1})
        ids = np.arange(500, dtype=np.int64)
        await ca.call("push_rows", table="emb", ids=ids, grads=np.ones((500, 4), np.float32))
        n_buckets = (await ca.get_json("/status"))["n_buckets"]
        for srv in (a, b):
            url = f"http://127.0.0.1:{srv.cfg.port}"
            clusters.append(Cluster([], TOKEN, source=StaticRouting([url], n_buckets)))
        ckpt = tmp_path / "ckpt"
        await asyncio.to_thread(save, clusters[0], ckpt)
        # held tensors without --force: named, the first 5 and how many more (skeptic 17: the
        # message listed 5 of 7 as if they were all)
        await cb.call("create_tensors", tensors=[_defn(f"k{i}", 3) for i in range(7)])
        with pytest.raises(CheckpointError) as err:
            await asyncio.to_thread(restore, clusters[1], ckpt, False)
        assert "holds tensors ['k0', 'k1', 'k2', 'k3', 'k4'] and 2 more" in str(err.value)
        await cb.call("create_table", name="emb", dim=4, optimizer={"kind": "sgd", "lr": 0.1})
        with pytest.raises(CheckpointError) as err:
            await asyncio.to_thread(restore, clusters[1], ckpt, True)
        msg = str(err.value)
        assert "layout mismatch: table 'emb' keeps 4 floats" in msg and "nothing restored" in msg
        assert "w" not in await _names(cb)  # w not created, no row installed
        await cb.call("push_rows", table="emb", ids=ids[:3], grads=np.ones((3, 4), np.float32))
    finally:
        for cl in clusters:
            cl.close()
        for c, r in ((ca, ra), (cb, rb)):
            await c.close()
            await r.cleanup()
