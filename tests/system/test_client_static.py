"""adamps.client.ps against two real parameter-server processes with a static bucket map.

After ps-lite's end-to-end test: push known values N times and pull exactly N times them; the
model's shards are split over two servers, so every pull and push is a multi-server operation.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from adamps.client import PSClient, StaticRouting
from adamps.layout import Layout, TensorSpec
from adamps.up.procs import free_port

pytestmark = pytest.mark.slow

N_BUCKETS = 16
TENSORS = [
    TensorSpec("conv.w", (20, 10, 5, 5)),
    TensorSpec("fc.w", (600, 500)),
    TensorSpec("fc.b", (600,)),
]


def start_two_servers(procs, tmp_path, token, data_ports=False):
    urls = []
    halves = [range(0, N_BUCKETS // 2), range(N_BUCKETS // 2, N_BUCKETS)]
    for i, buckets in enumerate(halves):
        port = free_port()
        p = procs.start(
            f"ps{i}", "ps", "--port", str(port), "--data-dir", str(tmp_path / f"ps{i}"),
            "--n-buckets", str(N_BUCKETS), "--buckets", ",".join(map(str, buckets)),
            "--max-shard-elems", "50000",
            *(["--data-port", str(free_port())] if data_ports else []),
        )  # fmt: skip
        p.wait_http(f"http://127.0.0.1:{port}/healthz")
        urls.append(f"http://127.0.0.1:{port}")
    return urls


def test_exact_sums_across_two_servers(procs, tmp_path, token) -> None:
    urls = start_two_servers(procs, tmp_path, token)
    layout = Layout(TENSORS, n_buckets=N_BUCKETS, max_shard_elems=50_000)
    servers_used = {b < N_BUCKETS // 2 for b in layout.bucket_of.values()}
    assert servers_used == {True, False}, "the model must span both servers for this test"
    client = PSClient(StaticRouting(urls, N_BUCKETS), layout, token)
    for spec in TENSORS:
        client.create(spec, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
        client.create(
            spec, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0}
        )  # idempotent

    n_threads, n_pushes = 4, 10
    rng = np.random.default_rng(0)
    deltas = {t.name: rng.integers(-3, 4, size=t.shape).astype(np.float32) for t in TENSORS}

    def pusher() -> None:
        for _ in range(n_pushes):
            for t in TENSORS:
                client.push_dense(t.name, deltas[t.name])

    threads = [threading.Thread(target=pusher) for _ in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    values, versions = client.pull([t.name for t in TENSORS])
    for t in TENSORS:
        np.testing.assert_array_equal(values[t.name], n_threads * n_pushes * deltas[t.name])
        assert all(v == n_threads * n_pushes for v in versions[t.name])

    # Activation/error vectors: the servers compute W -= lr * e.T @ a for their row blocks.
    a = rng.integers(-2, 3, size=(8, 500)).astype(np.float32)
    e = rng.integers(-2, 3, size=(8, 600)).astype(np.float32)
    client.push_fc("fc.w", a, e)
    after, _ = client.pull(["fc.w"])
    np.testing.assert_array_equal(after["fc.w"], values["fc.w"] + e.T @ a)  # lr = -1 adds
    client.close()


def test_a_round_in_one_request_per_server_equals_its_separate_pushes(procs, tmp_path, token):
    """PSClient.push_round (issue 27): the fc layers' vectors and the dense deltas in one
    request per server, over the data plane, across two servers: exactly the Adagrad steps of
    push_fc per layer plus push_dense_many, bit for bit."""
    urls = start_two_servers(procs, tmp_path, token, data_ports=True)
    twins = [TensorSpec(f"{run}{t.name}", t.shape) for run in ("r.", "s.") for t in TENSORS]
    layout = Layout(twins, n_buckets=N_BUCKETS, max_shard_elems=50_000)
    client = PSClient(StaticRouting(urls, N_BUCKETS), layout, token)
    opt = {"kind": "adagrad", "lr": 0.05, "initial_accumulator": 0.1}
    for spec in twins:
        client.create(spec, init={"kind": "normal", "std": 0.1, "seed": 3}, optimizer=opt)
    rng = np.random.default_rng(1)
    for _ in range(3):
        a = rng.standard_normal((8, 500), np.float32)
        e = rng.standard_normal((8, 600), np.float32)
        d = {t.name: rng.standard_normal(t.shape, np.float32) for t in TENSORS if t.name != "fc.w"}
        client.push_round({"r.fc.w": (a, e)}, {f"r.{n}": v for n, v in d.items()})
        client.push_fc("s.fc.w", a, e)
        client.push_dense_many({f"s.{n}": v for n, v in d.items()})
    got, versions = client.pull([t.name for t in twins])
    for t in TENSORS:
        np.testing.assert_array_equal(got[f"r.{t.name}"], got[f"s.{t.name}"])
        n = len(versions[f"r.{t.name}"])
        assert versions[f"r.{t.name}"] == versions[f"s.{t.name}"] == [3] * n
    assert client.dp_requests > 0 and client.http_requests == 0  # the data plane carried them
    client.close()
