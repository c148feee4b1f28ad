"""Consistency modes enforced by the parameter servers (issue 25), with real processes.

- sync: 2 replicas of batch 8 end, after 100 steps of SGD, within 1e-5 of 1 replica of batch 16
  (the servers sum the replicas' gradients of a step, as Downpour does: the single replica takes
  the same step at twice the learning rate);
- ssp:2: with one replica 4x slower, the servers' staleness metric never exceeds 2 (and reaches
  it: the fast replica was held back), and a replica declaring another mode for the live run is
  refused with 409 naming both modes.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import numpy as np
import pytest

from adamps.client.rpc import RpcError, SyncRpc
from adamps.up.procs import free_port
from trainer import export
from trainer.local import builtin_data

pytestmark = pytest.mark.slow

N_TRAIN = 1600  # 100 steps of 16 images, or of 8 images for each of 2 replicas


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def small_dataset(tmp_path, n_train: int) -> str:
    tx, ty, vx, vy = builtin_data()
    path = tmp_path / "small.npz"
    np.savez(path, x_train=tx[:n_train], y_train=ty[:n_train], x_test=vx[:500], y_test=vy[:500])
    return f"npz:{path}"


def start_ps(procs, tmp_path, name: str) -> str:
    port = free_port()
    p = procs.start(name, "ps", "--port", str(port), "--data-dir", str(tmp_path / name),
                    "--no-lmdb-sync")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    p.wait_http(url + "/healthz", 60)
    return url


def start_ds(procs, tmp_path, n_train: int = N_TRAIN) -> str:
    port = free_port()
    p = procs.start("ds", "dataserver", "--port", str(port), "--no-augment",
                    "--source", small_dataset(tmp_path, n_train))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    p.wait_http(url + "/healthz", 60)
    return url


#: a small MLP: a convolution's max-pool ties on the digits' blank background let float
#: rounding pick another maximum, and 100 steps of two summation orders then drift apart
MLP = json.dumps({"input": [28, 28, 1], "classes": 10, "layers": [
    {"type": "fc", "name": "fc1", "units": 64, "activation": "relu"},
    {"type": "softmax", "name": "out", "units": 10}]})  # fmt: skip
STEP = ["--optimizer", "sgd", "--workers", "1", "--n-push", "1", "--epochs", "1",
        "--metrics-port", "-1", "--model", MLP]  # fmt: skip


@pytest.mark.timeout(240)
def test_sync_two_replicas_of_8_match_one_of_16(procs, tmp_path) -> None:
    ds = start_ds(procs, tmp_path)
    ps2, ps1 = start_ps(procs, tmp_path, "ps2"), start_ps(procs, tmp_path, "ps1")
    two = ["train", "--ps", ps2, "--dataservers", ds, "--consistency", "sync", "--run", "two",
           "--batch-size", "8", "--lr", "0.05", "--n-replicas", "2", *STEP]  # fmt: skip
    a = procs.start("two0", *two, "--replica", "0", "--out", str(tmp_path / "two.npz"))
    b = procs.start("two1", *two, "--replica", "1")
    one = procs.start("one", "train", "--ps", ps1, "--dataservers", ds, "--consistency", "sync",
                      "--run", "one", "--batch-size", "16", "--lr", "0.1", "--replica", "0",
                      "--n-replicas", "1", "--out", str(tmp_path / "one.npz"), *STEP)  # fmt: skip
    for p in (a, b, one):
        assert p.popen.wait(200) == 0, p.tail()
    m2, _ = export.load(tmp_path / "two.npz")
    m1, _ = export.load(tmp_path / "one.npz")
    assert '"images": 800' in a.tail(1) and '"images": 800' in b.tail(1)
    assert '"images": 1600' in one.tail(1)
    init = type(m1)(m1.spec)
    init.init_params(0)
    assert np.abs(m1.params - init.params).max() > 0.01  # the 100 steps went somewhere
    np.testing.assert_allclose(m2.params, m1.params, atol=1e-5, rtol=0)


def metric(text: str, name: str, labels: str) -> list[float]:
    return [float(v) for v in re.findall(rf"^{re.escape(name)}{{{labels}}} (\S+)$", text, re.M)]


@pytest.mark.timeout(240)
def test_ssp_bounds_the_staleness_of_a_4x_slower_replica(procs, tmp_path, token) -> None:
    ds = start_ds(procs, tmp_path, 480)  # 30 steps of 8 each: the fast one reaches S early
    ps = start_ps(procs, tmp_path, "ps")
    common = ["train", "--ps", ps, "--dataservers", ds, "--consistency", "ssp:2", "--run", "ssp",
              "--batch-size", "8", "--lr", "0.05", "--n-replicas", "2", *STEP]  # fmt: skip
    fast = procs.start("fast", *common, "--replica", "0")
    slow = procs.start("slow", *common, "--replica", "1", "--slowdown", "4")
    # While the run is live, a replica asking for another mode is refused, naming both.
    rpc = SyncRpc(ps, token)
    deadline = time.monotonic() + 120
    while "ssp" not in json.loads(get(ps + "/status"))["clocks"]:
        assert time.monotonic() < deadline, "the run never reported a clock"
        time.sleep(0.2)
    with pytest.raises(RpcError) as err:
        rpc.call("clock", run="ssp", replica="intruder", mode="sync", step=0, join=True)
    assert err.value.http_status == 409
    assert "ssp:2" in err.value.message and "sync" in err.value.message
    rpc.close()
    for p in (fast, slow):
        assert p.popen.wait(200) == 0, p.tail()
    text = get(ps + "/metrics")
    (worst,) = metric(text, "adamps_ps_run_max_staleness_steps", 'run="ssp"')
    assert worst == 2  # never more than S = 2, and the fast replica did run 2 steps ahead
    per_replica = metric(text, "adamps_ps_replica_staleness_steps", 'replica="\\d",run="ssp"')
    assert len(per_replica) == 2 and max(per_replica) <= 2
