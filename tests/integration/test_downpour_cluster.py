"""Downpour SGD with real processes: 1 parameter server (static bucket map), 1 data server and
2 `adamps train` replicas train adam-mnist on the built-in data for 2 epochs (DistBelief 4.1,
Project Adam 3.2): both finish, the held-out accuracy is far above chance, the final weights are
exported, and the server received both activation/error-vector and dense pushes."""

from __future__ import annotations

import json
import re
import urllib.request

import numpy as np
import pytest

from adamps.client.rpc import SyncRpc
from adamps.up.procs import free_port
from trainer import export
from trainer.board import BOARD_TENSOR
from trainer.local import builtin_data

pytestmark = pytest.mark.slow


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in metrics"
    return float(m.group(1))


@pytest.mark.timeout(150)
def test_two_replicas_train_and_export(procs, tmp_path, token) -> None:
    ps_port, ds_port, m1_port = free_port(), free_port(), free_port()
    ps = procs.start("ps", "ps", "--port", str(ps_port), "--data-dir", str(tmp_path / "ps"),
                     "--no-lmdb-sync")  # fmt: skip
    ds = procs.start("ds", "dataserver", "--port", str(ds_port), "--no-augment")
    ps_url, ds_url = f"http://127.0.0.1:{ps_port}", f"http://127.0.0.1:{ds_port}"
    ps.wait_http(ps_url + "/healthz", 60)
    ds.wait_http(ds_url + "/healthz", 60)
    common = ["train", "--ps", ps_url, "--dataservers", ds_url, "--n-replicas", "2",
              "--epochs", "2", "--warm-start", "50"]  # fmt: skip
    out, history = tmp_path / "model.npz", tmp_path / "history.jsonl"

    # Replica 1 first: it waits for replica 0 (tensors, warm start) and serves its metrics.
    r1 = procs.start("train1", *common, "--replica", "1", "--metrics-port", str(m1_port))
    r1.wait_http(f"http://127.0.0.1:{m1_port}/healthz", 60)
    text = get(f"http://127.0.0.1:{m1_port}/metrics")
    for name in ("adamps_trainer_images_total", "adamps_trainer_loss",
                 "adamps_trainer_images_per_second", "adamps_trainer_fetch_staleness_steps",
                 "adamps_trainer_heldout_accuracy", "adamps_trainer_epoch"):  # fmt: skip
        assert name in text
    assert metric(text, "adamps_trainer_images_total") == 0  # still waiting for replica 0
    status = json.loads(get(f"http://127.0.0.1:{m1_port}/status"))
    assert status["role"] == "trainer" and status["config"]["token"] == "***"

    r0 = procs.start("train0", *common, "--replica", "0", "--out", str(out),
                     "--history", str(history), "--metrics-port", "-1")  # fmt: skip
    assert r0.popen.wait(120) == 0, r0.tail()
    assert r1.popen.wait(60) == 0, r1.tail()

    # Per-epoch history of replica 0, evaluated with the servers' weights at each epoch end.
    lines = [json.loads(x) for x in history.read_text().splitlines()]
    assert [x["epoch"] for x in lines] == [1, 2]
    for x in lines:
        assert set(x) >= {"time", "epoch", "loss", "accuracy", "images_per_s"}
    assert lines[-1]["accuracy"] >= 0.90, lines

    # The export: the model description and weights that reproduce the accuracy.
    model, meta = export.load(out)
    assert meta["epochs"] == 2 and meta["replicas"] == 2
    _, _, test_x, test_y = builtin_data()
    acc = model.accuracy(model.prepare(test_x), test_y)
    assert acc >= 0.90 and abs(acc - meta["heldout_accuracy"]) < 1e-9

    # Both kinds of pushes reached the server: conv layers and biases dense, fc vectors.
    ps_metrics = get(ps_url + "/metrics")
    assert metric(ps_metrics, "adamps_ps_updates_applied_total", '{kind="fc"}') > 0
    assert metric(ps_metrics, "adamps_ps_updates_applied_total", '{kind="dense"}') > 0

    # The board: both replicas finished epoch 2, replica 0's warm-start mark is set.
    rpc = SyncRpc(ps_url, token)
    board = rpc.call("pull", tensors=[BOARD_TENSOR])["tensors"][BOARD_TENSOR]
    np.testing.assert_array_equal(board, [2, 2, 1])
    rpc.close()
    # Each replica trained its half of each epoch.
    assert "epoch 2: 2000 images" in r0.tail(200) and "epoch 2: 2000 images" in r1.tail(200)

    # A new run on the same servers: its own board (the finished epochs above are not its own),
    # so it trains its whole epoch, continuing from the stored weights.
    again = procs.start("again", "train", "--ps", ps_url, "--dataservers", ds_url, "--run",
                        "again", "--epochs", "1", "--metrics-port", "-1")  # fmt: skip
    assert again.popen.wait(60) == 0, again.tail()
    summary = again.summary()
    assert summary["images"] == 4000 and summary["heldout_accuracy"]["1"] >= 0.90
    assert "already records finished epochs" not in again.tail(200)


def test_bad_configuration_exits_2(procs) -> None:
    p = procs.start("bad", "train", "--ps", "http://127.0.0.1:9", "--replica", "3",
                    "--n-replicas", "2")  # fmt: skip
    assert p.popen.wait(60) == 2
    assert "replica must be in 0..n_replicas-1" in p.tail()


@pytest.mark.timeout(150)
def test_a_slow_replica_moves_on_from_a_complete_epoch(procs, tmp_path) -> None:
    """Adam 3.2.5 with epoch_fraction 0.5 and 2 replicas: an epoch is complete as soon as one
    replica finished it. Replica 1 trains at batch size 1 (several times slower per image), so
    it is still inside each epoch when replica 0 completes it, and moves on; replica 0 evaluates
    every epoch end without waiting for it."""
    ps_port, ds_port = free_port(), free_port()
    ps = procs.start("ps", "ps", "--port", str(ps_port), "--data-dir", str(tmp_path / "ps"),
                     "--no-lmdb-sync")  # fmt: skip
    ds = procs.start("ds", "dataserver", "--port", str(ds_port), "--no-augment")
    ps_url, ds_url = f"http://127.0.0.1:{ps_port}", f"http://127.0.0.1:{ds_port}"
    ps.wait_http(ps_url + "/healthz", 60)
    ds.wait_http(ds_url + "/healthz", 60)
    common = ["train", "--ps", ps_url, "--dataservers", ds_url, "--n-replicas", "2",
              "--epochs", "2", "--warm-start", "0", "--epoch-fraction", "0.5",
              "--metrics-port", "-1", "--progress-interval", "0.2"]  # fmt: skip
    history = tmp_path / "history.jsonl"
    r1 = procs.start("train1", *common, "--replica", "1", "--batch-size", "1")
    r0 = procs.start("train0", *common, "--replica", "0", "--batch-size", "32",
                     "--history", str(history))  # fmt: skip
    assert r0.popen.wait(120) == 0, r0.tail()
    assert r1.popen.wait(60) == 0, r1.tail()
    assert "moving on" in r1.tail(200), r1.tail(200)
    assert "(moved on)" in r1.tail(200)
    summary = r1.summary()
    assert summary["images"] < 4000  # it did not train all of its 2 x 2000 images
    assert [json.loads(x)["epoch"] for x in history.read_text().splitlines()] == [1, 2]
