"""The data server's leased slices for elastic replicas (issue 25) on a real loopback socket:
slices streamed with the real client cover the epoch exactly once, bad lease requests get a JSON
4xx naming the problem and change nothing, and the counters show what was trained."""

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
from dataserver.client import DataClient
from dataserver.config import DataServerConfig
from dataserver.partition import stream_positions
from dataserver.service import DataServer
from dataserver.sources import Dataset, builtin_mnist

pytestmark = pytest.mark.timeout(60)

TOKEN = "ds-token"


def mnist_dataset() -> Dataset:
    tx, ty, vx, vy = builtin_mnist()
    return Dataset(tx, ty, vx, vy, classes=[str(i) for i in range(10)], description="builtin")


@contextlib.asynccontextmanager
async def running(dataset: Dataset, **cfg_fields):
    cfg = DataServerConfig(token=TOKEN, **{"workers": 0, "port": free_port(), **cfg_fields})
    server = DataServer(cfg, dataset)
    await server.start()
    runner = await aweb.serve(server.make_app(), "127.0.0.1", cfg.port)
    try:
        yield server, f"http://127.0.0.1:{cfg.port}"
    finally:
        await runner.cleanup()
        await server.close()


async def _post(url: str, path: str, op: str, **fields):
    body = protocol.encode(protocol.request(op, **fields))
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/msgpack"}
    async with aiohttp.ClientSession() as s, s.post(url + path, data=body, headers=headers) as r:
        data = await r.read()
        if r.headers["Content-Type"].startswith("application/json"):
            return r.status, json.loads(data)
        return r.status, protocol.decode(data)


def lease(**kw):
    return {"run": "r", "replica": "a", "epochs": 2, **kw}


async def test_leased_slices_stream_the_epoch_once_and_count_it() -> None:
    async with running(mnist_dataset(), augment=False, slice_size=700) as (server, url):
        client = DataClient([url], TOKEN)
        seen = []
        while True:
            status, got = await _post(url, "/lease", "lease", **lease())
            assert status == 200
            if got["state"] != "grant" or got["epoch"] != 1:
                break
            batches = await asyncio.to_thread(
                lambda g=got: list(client.span(1, g["start"], g["stop"], batch_size=64))
            )
            assert batches[0].position == got["start"]
            seen.append(np.concatenate([b.index for b in batches]))
            status, done = await _post(url, "/complete", "complete", run="r", replica="a",
                                       epoch=1, slice=got["slice"])  # fmt: skip
            assert status == 200 and done["counted"]
        idx = np.concatenate(seen)
        n = len(server.train_y)
        order = stream_positions(n, 0, 1, 1, server.cfg.seed)
        np.testing.assert_array_equal(idx, server.train_index[order])  # the epoch's order, once
        runs = json.loads(await _get(url, "/runs"))
        assert runs["r"]["counters"]["1"] == {
            "served": n, "trained": n, "slices_done": -(-n // 700), "reissued": 0,
        }  # fmt: skip
        assert runs["r"]["completed"] == 1
        text = await _get(url, "/metrics")
        assert (
            f'adamps_dataserver_run_examples_trained_total{{epoch="1",run="r"}} {float(n)}' in text
        )


async def _get(url: str, path: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        return (await r.read()).decode()


@pytest.mark.parametrize(
    ("path", "op", "fields", "status", "code", "names"),
    [
        ("/lease", "lease", lease(run="a b"), 400, "bad_request", "run"),
        ("/lease", "lease", lease(replica=""), 400, "bad_request", "replica"),
        ("/lease", "lease", lease(epochs=0), 400, "bad_request", "epochs"),
        ("/lease", "lease", lease(epoch_fraction=1.5), 400, "bad_request", "epoch_fraction"),
        ("/lease", "lease", lease(epochs=3), 409, "conflict", "epochs=2"),
        (
            "/complete",
            "complete",
            {"run": "r", "replica": "a", "epoch": 1, "slice": 3},
            400,
            "bad_request",
            "never handed out",
        ),  # fmt: skip
        (
            "/complete",
            "complete",
            {"run": "nope", "replica": "a", "epoch": 1, "slice": 0},
            404,
            "not_found",
            "nope",
        ),  # fmt: skip
        ("/heartbeat", "heartbeat", {"run": "r"}, 400, "bad_request", "replica"),
    ],
)
async def test_bad_lease_requests_get_json_4xx_and_change_nothing(
    path, op, fields, status, code, names
) -> None:
    async with running(mnist_dataset(), augment=False, slice_size=1000) as (_server, url):
        ok, first = await _post(url, "/lease", "lease", **lease())
        assert ok == 200 and first["slice"] == 0
        before = json.loads(await _get(url, "/runs"))
        got, body = await _post(url, path, op, **fields)
        assert (got, body["error"]["code"]) == (status, code)
        assert names in body["error"]["message"]
        assert json.loads(await _get(url, "/runs"))["r"]["counters"] == before["r"]["counters"]
        ok, nxt = await _post(url, "/lease", "lease", **lease())  # keeps serving
        assert ok == 200 and nxt["slice"] == 1


async def test_a_bounded_stream_checks_stop() -> None:
    async with running(mnist_dataset(), augment=False) as (_server, url):
        body = {"replica": 0, "n_replicas": 1, "epoch": 1, "batch_size": 8, "stop": 10**6}
        status, got = await _post(url, "/stream", "stream", **body)
        assert (status, got["error"]["code"]) == (400, "bad_request")
        assert "stop" in got["error"]["message"]
