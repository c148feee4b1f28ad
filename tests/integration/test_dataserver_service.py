"""The data server on a real loopback socket, driven by the real prefetching client (Project Adam 3.1)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import numpy as np
import pytest

from adamps.up.procs import free_port
from adamps.wire import protocol
from adamps.wire import web as aweb
from dataserver.augment import AugmentParams, augment_images, epoch_transforms
from dataserver.client import DataClient, DataServerError
from dataserver.config import DataServerConfig
from dataserver.partition import stream_positions
from dataserver.service import DataServer
from dataserver.sources import Dataset, builtin_mnist

TOKEN = "ds-token"


@pytest.fixture(scope="module")
def mnist() -> Dataset:
    tx, ty, vx, vy = builtin_mnist()
    return Dataset(tx, ty, vx, vy, classes=[str(i) for i in range(10)], description="builtin")


@contextlib.asynccontextmanager
async def running(dataset: Dataset, **cfg_fields):
    fields = {"workers": 0, "ahead": 1, "port": free_port(), **cfg_fields}
    cfg = DataServerConfig(token=TOKEN, **fields)
    server = DataServer(cfg, dataset)
    await server.start()
    runner = await aweb.serve(server.make_app(), "127.0.0.1", cfg.port)
    try:
        yield server, f"http://127.0.0.1:{cfg.port}"
    finally:
        await runner.cleanup()
        await server.close()


def collect(client: DataClient, replica: int, n_replicas: int, epoch: int, **kw):
    with client.epoch(replica, n_replicas, epoch, **kw) as it:
        batches = list(it)
    return batches, it


async def test_each_replica_receives_its_partition_exactly_once_per_epoch(mnist) -> None:
    async with running(mnist, workers=1) as (server, url):  # real augmentation worker process
        client = DataClient([url], TOKEN)
        for epoch in (0, 1):
            seen = []
            for r in range(3):
                batches, _ = await asyncio.to_thread(collect, client, r, 3, epoch, batch_size=100)
                idx = np.concatenate([b.index for b in batches])
                assert len(idx) == len(np.unique(idx))  # every image of the partition once ...
                expected = stream_positions(4000, r, 3, epoch, server.cfg.seed)
                assert idx.tolist() == expected.tolist()  # ... in the epoch's shuffled order
                assert [b.position for b in batches] == list(range(0, len(idx), 100))
                for b in batches:
                    assert b.x.shape == (len(b.y), 28, 28) and b.x.dtype == np.uint8
                    assert np.array_equal(b.y, mnist.train_y[b.index])  # labels kept
                seen.append(idx)
            every = np.concatenate(seen)
            assert np.array_equal(np.sort(every), np.arange(4000))  # disjoint and covering
        # the served pixels are the epoch's augmentation of each image, not the original
        b = batches[0]
        t = epoch_transforms(4000, 1, server.cfg.seed, AugmentParams())[b.index]
        assert np.array_equal(b.x, augment_images(mnist.train_x[b.index], t))
        assert not np.array_equal(b.x, mnist.train_x[b.index])
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            text = await r.text()
        assert 'adamps_dataserver_images_served_total{split="train"} 8000.0' in text
        assert (
            "adamps_dataserver_cache_bytes" in text
            and "adamps_dataserver_augment_backlog_images" in text
        )


async def test_held_out_split_is_served_unaugmented_in_fixed_order(mnist) -> None:
    async with running(mnist) as (_server, url):
        client = DataClient([url], TOKEN)
        batches, _ = await asyncio.to_thread(collect, client, 1, 2, 5, batch_size=128, split="test")
        idx = np.concatenate([b.index for b in batches])
        assert idx.tolist() == list(range(1, 1000, 2))
        x = np.concatenate([b.x for b in batches])
        assert np.array_equal(x, mnist.test_x[idx])
        assert np.array_equal(np.concatenate([b.y for b in batches]), mnist.test_y[idx])


async def test_servers_split_the_dataset_into_slices(mnist) -> None:
    async with (
        running(mnist, slice_index=0, n_slices=2) as (s0, u0),
        running(mnist, slice_index=1, n_slices=2) as (s1, u1),
    ):
        assert s0.train_x.shape[0] == s1.train_x.shape[0] == 2000  # each holds half
        client = DataClient([u1, u0], TOKEN)
        seen = []
        for r in range(2):
            batches, _ = await asyncio.to_thread(collect, client, r, 2, 0, batch_size=64)
            seen.append(np.concatenate([b.index for b in batches]))
            assert {int(i) % 2 for i in batches[0].index} != {int(i) % 2 for i in batches[1].index}
        every = np.concatenate(seen)
        assert len(every) == 4000 and np.array_equal(np.sort(every), np.arange(4000))


async def _post(url: str, body: bytes, token: str | None = TOKEN) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/stream", data=body, headers=headers) as r,
    ):
        assert r.headers["Content-Type"].startswith("application/json")
        return r.status, json.loads(await r.read())


def stream_body(**fields) -> bytes:
    base = {"replica": 0, "n_replicas": 2, "epoch": 0, "batch_size": 32}
    return protocol.encode(protocol.request("stream", **{**base, **fields}))


@pytest.mark.parametrize(
    ("fields", "status", "code", "names"),
    [
        ({"replica": 2}, 400, "bad_request", "replica"),
        ({"replica": -1}, 400, "bad_request", "replica"),
        ({"n_replicas": 0}, 400, "bad_request", "n_replicas"),
        ({"epoch": -3}, 400, "bad_request", "epoch"),
        ({"epoch": "one"}, 400, "bad_request", "epoch"),
        ({"batch_size": 0}, 400, "bad_request", "batch_size"),
        ({"batch_size": 10**6}, 400, "bad_request", "batch_size"),
        ({"split": "validation"}, 400, "bad_request", "split"),
        ({"start": 5000}, 400, "bad_request", "start"),
        ({"fingerprint": "0123"}, 409, "conflict", "dataset"),
    ],
)
async def test_bad_stream_requests_get_json_4xx(mnist, fields, status, code, names) -> None:
    async with running(mnist, augment=False) as (_server, url):
        got, body = await _post(url, stream_body(**fields))
        assert (got, body["error"]["code"]) == (status, code)
        assert names in body["error"]["message"]
        # the server keeps serving
        ok = await asyncio.to_thread(collect, DataClient([url], TOKEN), 0, 2, 0, batch_size=500)
        assert sum(len(b.y) for b in ok[0]) == 2000


async def test_bad_token_garbage_and_unknown_op_get_json_4xx(mnist) -> None:
    async with running(mnist, augment=False) as (_server, url):
        assert (await _post(url, stream_body(), token="wrong"))[0] == 401
        assert (await _post(url, stream_body(), token=None))[0] == 401
        status, body = await _post(url, b"\xc1 not msgpack")
        assert (status, body["error"]["code"]) == (400, "malformed")
        status, body = await _post(url, protocol.encode(protocol.request("push", replica=0)))
        assert (status, body["error"]["code"]) == (400, "unknown_op")
        # the client surfaces a 4xx as an error (no failover loop on a bad request)
        with pytest.raises(DataServerError, match="replica"):
            await asyncio.to_thread(collect, DataClient([url], TOKEN), 3, 2, 0)
        with pytest.raises(DataServerError, match="unauthorized"):
            await asyncio.to_thread(collect, DataClient([url], "nope"), 0, 2, 0)


async def test_wait_frames_keep_a_slow_epoch_from_looking_like_a_dead_server() -> None:
    """An epoch that takes longer to augment than the client's read timeout is not a failover.

    The augmentation runs in a worker process, as it does in production: in a thread of the
    test's process (workers=0) it shared the GIL with the event loop that sends the wait frames
    and with the client, and on a loaded machine a frame came later than the client's 0.1 s read
    timeout now and then. A wait frame every 20 ms against a read timeout of 0.3 s."""
    timeout = 0.3
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (600, 128, 128), dtype=np.uint8)
    y = np.arange(600, dtype=np.int64) % 10
    big = Dataset(x, y, x[:10], y[:10])
    async with running(big, ahead=0, heartbeat=0.02, workers=1) as (server, url):
        client = DataClient([url], TOKEN, timeout=timeout)
        t0 = asyncio.get_running_loop().time()
        batches, it = await asyncio.to_thread(collect, client, 0, 1, 5, batch_size=100)
        assert (
            asyncio.get_running_loop().time() - t0 > 2 * timeout
        )  # augmentation really was slower than the timeout
        assert it.failovers == 0
        assert sorted(np.concatenate([b.index for b in batches]).tolist()) == list(range(600))


async def test_client_waits_for_a_data_server_that_is_still_starting(mnist) -> None:
    port = free_port()
    client = DataClient([f"http://127.0.0.1:{port}"], TOKEN, failover_timeout=20.0)
    pending = asyncio.ensure_future(asyncio.to_thread(collect, client, 0, 1, 0, batch_size=500))
    await asyncio.sleep(0.5)  # the client is retrying discovery: nothing listens yet
    assert not pending.done()
    async with running(mnist, augment=False, port=port):
        batches, _ = await pending
    assert sorted(np.concatenate([b.index for b in batches]).tolist()) == list(range(4000))
