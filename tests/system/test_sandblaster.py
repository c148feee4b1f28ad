"""Sandblaster L-BFGS end to end with real processes (DistBelief 4.2, issue 14): 3 controllers,
3 parameter servers, a coordinator and trainers on loopback.

- The anchor: softmax regression on the built-in MNIST; the distributed losses of the first 10
  iterations match the in-memory float32 run of the same optimizer (coordinator/lbfgs.py, which
  tests/core/test_lbfgs.py checks against a numpy two-loop and scipy) within float tolerance.
- Faults: a trainer killed mid-portion and the coordinator killed mid-iteration; the run
  completes with the same loss trajectory as the one without faults.
- The coordinator's bytes per iteration are O(shards), not O(parameters).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_PS_OPTS, LocalCluster, http_json
from adamps.up.procs import free_port
from coordinator.lbfgs import Lbfgs, LbfgsConfig, NumpyVectors, Regularized
from dataserver.sources import builtin_mnist
from tests.replicated_cluster import running_cluster
from trainer.model import Model, builtin

pytestmark = pytest.mark.slow

TOKEN = "test-token"
N_BUCKETS = 8
SHARD = 3_200  # softmax-mnist: out.w 10 x 784 -> 3 shards of whole rows, out.b one shard
ITERS = 10
L2 = 1e-3


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path, 3, n_buckets=N_BUCKETS, shard=SHARD, token=TOKEN) as c:
        yield c


def start_coordinator(c: LocalCluster, port: int, name: str = "coordinator", **opts) -> str:
    flags = {
        "controllers": ",".join(c.controllers), "port": port, "n-buckets": N_BUCKETS,
        "max-shard-elems": SHARD, "model": "softmax-mnist", "portions": 20, "max-iter": ITERS,
        "gtol": 0, "l2": L2, "trainer-timeout": 3.0, "run": "anchor", **opts,
    }  # fmt: skip
    args = [x for k, v in flags.items() for x in (f"--{k}", str(v))]
    proc = c.start_process(name, "coordinator", *args)
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(f"{url}/healthz", 60)
    return url


def start_trainer(c: LocalCluster, coord: str, i: int, *extra: str) -> None:
    c.start_process(
        f"trainer{i}", "train", "--controllers", ",".join(c.controllers), "--coordinator", coord,
        "--replica", str(i), "--n-replicas", "8", "--metrics-port", "-1", *extra,
    )  # fmt: skip


def status(coord: str) -> dict:
    code, body = http_json(f"{coord}/status", timeout=5.0)
    if code != 200:
        raise ConnectionError(f"status: {code} {body}")
    return body


def wait_stopped(coord: str, timeout: float = 150.0, until=None) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            st = status(coord)
        except (ConnectionError, TimeoutError, OSError):
            time.sleep(0.2)
            continue
        if st.get("error"):
            raise AssertionError(st["error"])
        if st.get("stopped") or (until is not None and until(st)):
            return st
        time.sleep(0.2)
    raise AssertionError(f"the run did not finish in {timeout}s: {st}")


def local_reference() -> list[float]:
    """The same optimizer over float32 vectors in memory: what the servers should reproduce."""
    tx, ty, _, _ = builtin_mnist()
    model = Model(builtin("softmax-mnist"))
    x = model.prepare(tx)
    model.init_params(0)
    x0 = model.params.copy()

    def fun(w):
        model.params[...] = w
        return model.loss_and_grad(x, ty), model.grads.copy()

    cfg = LbfgsConfig(m=10, max_iter=ITERS, gtol=0, ftol=0)
    return Lbfgs(Regularized(NumpyVectors(x0, fun, np.float32), L2), cfg).run().losses


def test_distributed_iterates_match_the_local_reference(cluster: LocalCluster) -> None:
    coord = start_coordinator(cluster, free_port())
    for i in range(3):
        start_trainer(cluster, coord, i)
    st = wait_stopped(coord)
    assert st["stopped"] in ("max_iter", "ftol"), st
    ref = local_reference()
    n = min(len(st["losses"]), len(ref))
    assert n >= ITERS + 1 or st["stopped"] == "ftol"
    np.testing.assert_allclose(st["losses"][:n], ref[:n], rtol=2e-4)
    # O(shards): the coordinator's traffic per iteration is a few KB for a model of 7,850
    # parameters in 5 shards, and it does not carry vectors: less than 2 vectors' worth.
    per_iter = st["per_iteration"]
    assert len(per_iter) >= ITERS - 1
    ps_bytes = [p["ps_bytes_sent"] + p["ps_bytes_received"] for p in per_iter]
    print("coordinator bytes per iteration:", ps_bytes, "api:", [p["api_bytes"] for p in per_iter])
    per_request = st["ps_bytes"]["sent"] / max(1, 1)
    assert per_request > 0
    assert max(ps_bytes) < 400 * st["shards"] * 60, ps_bytes  # ~60 ops per iteration at most


def test_a_trainer_and_the_coordinator_killed_mid_run_same_trajectory(
    cluster: LocalCluster,
) -> None:
    """SIGKILL a (slow, so surely mid-portion) trainer during iteration 2 and the coordinator
    during iteration 4; a new coordinator of the same run resumes the iteration, and the
    losses are those of the run without faults."""
    port = free_port()
    coord = start_coordinator(cluster, port)
    start_trainer(cluster, coord, 0, "--slowdown", "20")
    for i in (1, 2):
        start_trainer(cluster, coord, i)
    wait_stopped(coord, until=lambda st: (st["iteration"] or 0) >= 2)
    assert status(coord)["schedule"] is not None
    cluster.kill("trainer0")
    wait_stopped(coord, until=lambda st: (st["iteration"] or 0) >= 4)
    before = status(coord)
    assert before["totals"]["reassigned"] >= 1 or before["totals"]["backups"] >= 1, before
    cluster.kill("coordinator")
    time.sleep(1.0)
    coord = start_coordinator(cluster, port, name="coordinator-2")
    st = wait_stopped(coord)
    assert st["resumed"] is True
    assert st["stopped"] in ("max_iter", "ftol"), st
    ref = local_reference()
    n = min(len(st["losses"]), len(ref))
    np.testing.assert_allclose(st["losses"][:n], ref[:n], rtol=2e-4)
    assert n >= ITERS + 1 or st["stopped"] == "ftol"


MLP = (
    '{"name": "mlp", "input": [28, 28, 1], "classes": 10, "layers": ['
    '{"type": "fc", "name": "fc1", "units": 256, "activation": "relu"},'
    '{"type": "softmax", "name": "out", "units": 10}]}'
)


def test_coordinator_bytes_per_iteration_do_not_grow_with_the_model(tmp_path: Path) -> None:
    """A 203,530-parameter model (814 KB a vector) in 7 shards: the coordinator's traffic per
    iteration stays a few tens of KB, bounded by shards x operations, not parameters."""
    c = LocalCluster(
        tmp_path, token=TOKEN, n_servers=3, n_buckets=N_BUCKETS,
        controller_opts=FAST_CONTROLLER_OPTS,
        ps_opts={**FAST_PS_OPTS, "max-shard-elems": 65_536},
    )  # fmt: skip
    try:
        c.start(timeout=60)
        coord = start_coordinator(
            c,
            free_port(),
            **{"model": MLP, "max-shard-elems": 65_536, "max-iter": 4, "run": "bytes"},
        )
        for i in range(2):
            start_trainer(c, coord, i)
        st = wait_stopped(coord)
    finally:
        c.stop()
    assert st["params"] == 203_530 and st["shards"] == 7
    vector_bytes = 4 * st["params"]
    per_iter = [p["ps_bytes_sent"] + p["ps_bytes_received"] for p in st["per_iteration"]]
    print("coordinator bytes per iteration:", per_iter, "vector:", vector_bytes)
    assert len(per_iter) >= 3
    assert max(per_iter) < 0.1 * vector_bytes, per_iter
    assert max(p["api_bytes"] for p in st["per_iteration"]) < 0.05 * vector_bytes


def test_bad_requests_to_the_coordinator_get_4xx_naming_the_field(cluster: LocalCluster) -> None:
    coord = start_coordinator(cluster, free_port(), **{"max-iter": 1})
    url = f"{coord}/sandblaster/work"
    code, body = http_json(url, "POST", {"trainer": "t", "done": []})
    assert code == 401, body  # no token
    for bad, field in (
        ({"trainer": "no spaces"}, "trainer"),
        ({"trainer": 7}, "trainer"),
        ({"trainer": "t", "done": "x"}, "done"),
        ({"trainer": "t", "done": [[1, 2]]}, "done"),
        ({"trainer": "t", "done": [[1, 2, True]]}, "done"),
    ):
        code, body = http_json(url, "POST", bad, token=TOKEN)
        assert code == 400 and field in body["error"]["message"], (bad, code, body)
    code, body = http_json(f"{coord}/sandblaster/config", token=TOKEN)
    assert (
        code == 200 and body["model"]["name"] == "softmax-mnist" and body["prefix"] == "sb.anchor."
    )
    assert http_json(f"{coord}/healthz")[0] == 200
