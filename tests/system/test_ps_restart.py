"""A real PS process: push/pull over HTTP, flush, SIGKILL, restart on the same LMDB directory.

Done-when of issue 2: every flushed value (and accumulator and version) is back after the restart.
Also the exact-sum check after ps-lite, with several concurrent clients against the real process.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from adamps.client.rpc import SyncRpc
from adamps.up.procs import Proc, free_port

pytestmark = pytest.mark.slow


def start_ps(procs, name: str, data_dir: Path) -> tuple[Proc, int]:
    """A PS on a fresh port (retried: a free port can be taken by a concurrent process first)."""
    for attempt in range(3):
        port = free_port()
        proc = procs.start(
            f"{name}-{attempt}", "ps", "--port", str(port), "--data-dir", str(data_dir),
            "--flush-interval", "3600",
        )  # fmt: skip
        try:
            proc.wait_http(f"http://127.0.0.1:{port}/healthz", timeout=30)
            return proc, port
        except RuntimeError:
            proc.stop()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def test_flushed_values_survive_sigkill_and_restart(procs, token: str, tmp_path: Path) -> None:
    data = tmp_path / "lmdb"
    ps, port = start_ps(procs, "ps-1", data)
    c = SyncRpc(f"http://127.0.0.1:{port}", token)
    g = np.random.default_rng(0)
    c.call(
        "create",
        name="w",
        shape=[700, 600],
        init={"kind": "xavier", "seed": 1},
        optimizer={"kind": "sgd", "lr": 0.1},
    )
    c.call("create", name="b", shape=[600], optimizer={"kind": "adagrad", "lr": 0.5})
    acc = np.zeros(600, np.float64)  # the Adagrad accumulator the server should hold for b
    for _ in range(3):
        c.call("push_dense", tensor="w", delta=g.standard_normal((700, 600)).astype(np.float32))
        gb = g.standard_normal(600).astype(np.float32)
        c.call("push_dense", tensor="b", delta=gb)
        acc += gb.astype(np.float64) ** 2
    c.call(
        "push_fc",
        tensor="w",
        a=g.standard_normal((8, 600)).astype(np.float32),
        e=g.standard_normal((8, 700)).astype(np.float32),
    )
    before = c.call("pull", tensors=["w", "b"])
    assert before["versions"] == {"w": [4, 4], "b": [3]}
    flushed = c.call("flush")
    assert flushed["shards"] == 3
    # An update after the flush is inside the loss window: a crash now may lose it (Adam 3.3.2).
    c.call("push_dense", tensor="b", delta=np.ones(600, np.float32))
    ps.kill()  # SIGKILL: no final flush, no cleanup
    c.close()

    _, port = start_ps(procs, "ps-2", data)  # same LMDB directory, any port
    c = SyncRpc(f"http://127.0.0.1:{port}", token)
    after = c.call("pull", tensors=["w", "b"])
    assert np.array_equal(after["tensors"]["w"], before["tensors"]["w"])
    assert np.array_equal(after["tensors"]["b"], before["tensors"]["b"])
    assert after["versions"] == before["versions"]
    listed = {t["name"]: t for t in c.call("list")["tensors"]}
    assert listed["b"]["optimizer"]["kind"] == "adagrad" and listed["w"]["init"]["seed"] == 1
    # The Adagrad accumulator came back too: the same gradient gives the same step on both sides.
    d = np.full(600, 0.3, np.float32)
    c.call("push_dense", tensor="b", delta=d)
    step = c.call("pull", tensors=["b"])["tensors"]["b"] - before["tensors"]["b"]
    np.testing.assert_allclose(step, -0.5 * 0.3 / np.sqrt(acc + 0.09 + 1e-8), rtol=1e-4, atol=1e-6)
    c.close()


def test_exact_sum_of_concurrent_pushes(procs, token: str, tmp_path: Path) -> None:
    """After ps-lite's test: N known pushes with lr=-1 SGD pull back exactly N times them."""
    _, port = start_ps(procs, "ps", tmp_path / "lmdb")
    base = f"http://127.0.0.1:{port}"
    c = SyncRpc(base, token)
    c.call("create", name="x", shape=[1000, 300], optimizer={"kind": "sgd", "lr": -1})  # 2 shards
    delta = (np.arange(300_000, dtype=np.float32) % 5 - 2).reshape(1000, 300)
    n_clients, n_pushes = 4, 25
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with SyncRpc(base, token) as cc:
                for s in range(n_pushes):
                    cc.call("push_dense", tensor="x", delta=delta, client=f"c{i}", seq=s)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    pulled = c.call("pull", tensors=["x"])
    assert np.array_equal(pulled["tensors"]["x"], delta * (n_clients * n_pushes))
    assert pulled["versions"] == {"x": [n_clients * n_pushes] * 2}
    assert c.get_json("/status")["clients"] == n_clients
    c.close()


def test_sigterm_flushes_everything_before_exit(procs, token: str, tmp_path: Path) -> None:
    data = tmp_path / "lmdb"
    ps, port = start_ps(procs, "ps-1", data)
    c = SyncRpc(f"http://127.0.0.1:{port}", token)
    c.call("create", name="v", shape=[5000], optimizer={"kind": "sgd", "lr": -1})
    c.call(
        "push_dense", tensor="v", delta=np.full(5000, 3.0, np.float32)
    )  # never flushed explicitly
    c.close()
    assert ps.stop(timeout=20) == 0
    _, port = start_ps(procs, "ps-2", data)  # same LMDB directory, any port
    with SyncRpc(f"http://127.0.0.1:{port}", token) as c2:
        pulled = c2.call("pull", tensors=["v"])
    assert np.array_equal(pulled["tensors"]["v"], np.full(5000, 3.0, np.float32))
    assert pulled["versions"] == {"v": [1]}
