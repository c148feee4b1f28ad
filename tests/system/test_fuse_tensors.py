"""The numpy engine's placement groups (`adamps train --fuse-tensors`, issue 36): the model's
small layers are packed by adamps.torch's code (adamps/layout.py ``pack_groups``) into groups
that share one bucket, which changes where the tensors live and nothing of what they learn:
one replica under ``--consistency sync`` ends with the same weights as without the flag."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from adamps.up.procs import free_port
from trainer import export
from trainer.local import builtin_data

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MLP = json.dumps({"input": [28, 28, 1], "classes": 10, "layers": [
    {"type": "fc", "name": "fc1", "units": 64, "activation": "relu"},
    {"type": "fc", "name": "fc2", "units": 32, "activation": "relu"},
    {"type": "softmax", "name": "out", "units": 10}]})  # fmt: skip
STEP = ["--optimizer", "sgd", "--lr", "0.1", "--workers", "1", "--n-push", "1", "--epochs", "1",
        "--batch-size", "16", "--consistency", "sync", "--replica", "0", "--n-replicas", "1",
        "--metrics-port", "-1", "--model", MLP]  # fmt: skip


def status(url: str) -> dict:
    with urllib.request.urlopen(url + "/status", timeout=5) as resp:
        return json.loads(resp.read())


def test_fused_layers_share_a_bucket_and_learn_the_same(procs, tmp_path) -> None:
    tx, ty, vx, vy = builtin_data()
    data = tmp_path / "small.npz"
    np.savez(data, x_train=tx[:800], y_train=ty[:800], x_test=vx[:200], y_test=vy[:200])
    port = free_port()
    procs.start("ds", "dataserver", "--port", str(port), "--no-augment",
                "--source", f"npz:{data}").wait_http(f"http://127.0.0.1:{port}/healthz", 60)  # fmt: skip
    ds = f"http://127.0.0.1:{port}"
    port = free_port()
    procs.start("ps", "ps", "--port", str(port), "--data-dir", str(tmp_path / "ps"),
                "--no-lmdb-sync").wait_http(f"http://127.0.0.1:{port}/healthz", 60)  # fmt: skip
    ps = f"http://127.0.0.1:{port}"
    runs = {}
    for run, extra in (("plain", []), ("fused", ["--fuse-tensors"])):
        out = tmp_path / f"{run}.npz"
        p = procs.start(run, "train", "--ps", ps, "--dataservers", ds, "--run", run,
                        "--out", str(out), *STEP, *extra)  # fmt: skip
        assert p.popen.wait(200) == 0, p.tail()
        runs[run] = export.load(out)[0]
    # the model's shards (not the run's progress board, "RUN..adamps.board")
    shards = {sid: v for sid, v in status(ps)["shards"].items() if "adamps.board" not in sid}
    buckets = {
        run: {v["bucket"] for sid, v in shards.items() if sid.startswith(f"{run}..")}
        for run in runs
    }
    fused = sorted({sid.rsplit(".", 1)[0] for sid in shards if sid.startswith("fused..")})
    assert fused == ["fused..{0}fc1", "fused..{0}fc2", "fused..{0}out"], fused
    assert len(buckets["fused"]) == 1 and len(buckets["plain"]) > 1, buckets
    plain, grouped = runs["plain"], runs["fused"]
    init = type(plain)(plain.spec)
    init.init_params(0)
    assert np.abs(plain.params - init.params).max() > 0.01  # it learned
    np.testing.assert_allclose(grouped.params, plain.params, atol=1e-6, rtol=0)
