"""Sandblaster's vector operations on a replicated cluster (3 controllers, 4 servers, real
processes): a run of random operations, mirrored in numpy, with the busiest primary killed in
the middle. Each operation either happened on a bucket or did not, exactly once: the values
end bit-identical to numpy's and the replicas' digests agree. The coordinator's record
survives the failover. Reference: DistBelief 4.2, Project Adam 3.3.3."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from adamps.client import ControllerRouting
from adamps.layout import Layout, TensorSpec
from adamps.metered import MeteredClient
from adamps.up.cluster import LocalCluster
from coordinator.psvectors import PsVectors
from coordinator.record import ServerRecord
from tests.replicated_cluster import running_cluster
from tests.system.test_failover import busiest_primary, digests_agree

pytestmark = pytest.mark.slow

TOKEN = "test-token"
N_BUCKETS = 8
SHARD = 32_768
W = TensorSpec("w", (40_000,))  # 2 shards
B = TensorSpec("b", (16, 4_000))  # 2 shards (whole rows)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path, 4, n_buckets=N_BUCKETS, shard=SHARD, token=TOKEN) as c:
        yield c


def test_vector_ops_survive_a_primary_kill_exactly_once(cluster: LocalCluster) -> None:
    layout = Layout([], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
    client = MeteredClient(ControllerRouting(cluster.controllers), layout, TOKEN, retry_for=30.0)
    for t, seed in ((W, 1), (B, 2)):
        client.create(t, init={"kind": "uniform", "low": -1, "high": 1, "seed": seed})
    vec = PsVectors(client, [W, B], client_id="coordinator-test")
    names = ["param", "a", "b"]
    vec.ensure(*names)
    record = ServerRecord(vec, "test")
    values, _ = client.pull([W.name, B.name])
    model = {"param": np.concatenate([values[W.name].ravel(), values[B.name].ravel()])}
    for v in ("a", "b"):
        model[v] = np.zeros_like(model["param"])
    initial = client.meter.sent + client.meter.received
    rng = np.random.default_rng(7)
    killed: dict[str, str] = {}

    def kill_later() -> None:
        time.sleep(1.5)
        victim = busiest_primary(cluster)
        killed["server"] = victim
        cluster.kill(victim)

    killer = threading.Thread(target=kill_later)
    killer.start()
    done = 0
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        if "server" in killed and "at" not in killed:
            killed["at"] = done
        if done >= 60 and "at" in killed and done >= killed["at"] + 20:
            break
        kind = ["copy", "scale", "axpy", "mul", "dot"][rng.integers(5)]
        y, x = (names[i] for i in rng.choice(3, 2, replace=False))
        alpha = float(rng.uniform(-1.5, 1.5))
        if kind == "copy":
            vec.copy(y, x)
            model[y][...] = model[x]
        elif kind == "scale":
            vec.scale(y, alpha)
            model[y] *= np.float32(alpha)
        elif kind == "axpy":
            vec.axpy(y, alpha, x)
            model[y] += np.float32(alpha) * model[x]
        elif kind == "mul":
            vec.mul(y, x)
            model[y] *= model[x]
            np.clip(model[y], -1e3, 1e3, out=model[y])
            vec.scale(y, 1.0)  # keep the op sequence identical
            if np.abs(model[y]).max() >= 1e3:  # keep magnitudes tame: reset to param
                vec.copy(y, "param")
                model[y][...] = model["param"]
        else:
            got = vec.dot(y, x)
            want = float(model[y].astype(np.float64) @ model[x])
            assert got == pytest.approx(want, rel=1e-9, abs=1e-9)
        if done % 10 == 0:
            record.save({"done": done, "pi": 3.141592653589793})
        done += 1
    killer.join()
    # A vector op costs a few hundred bytes per server, not the vector (4 shards of 32k floats):
    # everything sent and received so far (the creates' and the initial pull's bytes included).
    per_op = (client.meter.sent + client.meter.received - initial) / max(vec.ops, 1)
    assert per_op < 2048, per_op
    assert "server" in killed and done >= killed["at"] + 20, (done, killed)
    for v in names:
        tensors = [W.name, B.name] if v == "param" else [f"{W.name}@{v}", f"{B.name}@{v}"]
        got, _ = client.pull(tensors)
        flat = np.concatenate([got[t].ravel() for t in tensors])
        np.testing.assert_array_equal(flat, model[v], err_msg=f"vector {v}")
    assert record.load() == {"done": (done - 1) // 10 * 10, "pi": 3.141592653589793}
    digests_agree(cluster)
    client.close()
