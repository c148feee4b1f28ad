"""Faults under a PyTorch run (issue 22; Project Adam 3.3.3): 3 controllers, 3 replicated
parameter servers, 2 `adamps train --torch` replicas of examples/torch_mnist.py. After epoch 1 the
primary of the first linear layer's weight is SIGKILLed, then replica 1 is SIGKILLed and
started again. The run still reaches 97% held-out after both faults, the restarted replica
finishes, and an exactness load pushing +1 beside the training (adamps/testing/exactness.py)
finds every acknowledged push exactly once, every refused one absent: the torch replicas share
the one write path."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="adamps.torch needs torch")

from adamps.client.rpc import get_json  # noqa: E402
from adamps.layout import Layout, TensorSpec  # noqa: E402
from adamps.testing.exactness import ExactnessLoad  # noqa: E402
from tests.polling import wait_for  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import digests_agree, make_client, running_cluster  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EPOCHS = 10
TRAIN_ARGS = ["--batch-size", "16", "--n-push", "2", "--n-fetch", "4", "--optimizer", "sgd",
              "--lr", "0.1", "--local-lr", "0.1"]  # fmt: skip


def test_torch_run_survives_a_primary_and_a_replica_kill(tmp_path: Path) -> None:
    with running_cluster(tmp_path, n_servers=3) as c:
        ds = c.start_dataserver("--no-augment")
        c.procs["dataserver0"].wait_http(f"http://{ds}/healthz", 60)
        client, layout = make_client(c)
        load = ExactnessLoad(client, layout, "x", threads=2, pause=0.02, retry_for=30.0)
        load.start()

        history, out = tmp_path / "history.jsonl", tmp_path / "model.pt"
        common = ["train", "--torch", "examples.torch_mnist:Net", "--run", "faults",
                  "--controllers", ",".join(c.controllers), "--dataservers", f"http://{ds}",
                  "--n-replicas", "2", "--epochs", str(EPOCHS), "--metrics-port", "-1",
                  *TRAIN_ARGS]  # fmt: skip
        r0 = c.start_process("train0", *common, "--replica", "0", "--history", str(history),
                             "--out", str(out))  # fmt: skip
        r1 = c.start_process("train1", *common, "--replica", "1")

        wait_for(lambda: history.exists() and history.read_text().strip(), 240, "epoch 1's end")
        table = get_json(c.controllers[0], "/routing")
        n_buckets = int(table["n_buckets"])
        spec = TensorSpec("faults..9.weight", (128, 512))  # the first nn.Linear
        shard = Layout([spec], n_buckets, 1_000).shards_of[spec.name][0]
        bucket = Layout([spec], n_buckets, 1_000).bucket_of[shard.id]
        view = c.cluster()
        assert view is not None
        victim = next(b["primary"] for b in view["buckets"] if b["bucket"] == bucket)
        c.kill(victim)

        # replica 1 dies once it reported epoch 2 done, and comes back (a new process, a new
        # client id): it skips the epochs it reported and redoes the one it was in
        def replica1_done() -> int:
            epochs = get_json(c.controllers[0], "/progress").get("epochs", {})
            done = [int(e) for e, reps in epochs.items()
                    if reps.get("faults/torch/1", {}).get("done")]  # fmt: skip
            return max(done, default=0)

        wait_for(lambda: replica1_done() >= 2, 240, "replica 1's epoch 2")
        assert r1.alive, r1.tail(40)
        c.kill("train1")
        r1b = c.start_process("train1b", *common, "--replica", "1")
        restarted_at = time.time()

        assert r0.popen.wait(420) == 0, r0.tail(60)
        assert r1b.popen.wait(120) == 0, r1b.tail(60)
        load.stop()
        after = get_json(c.controllers[0], "/routing")
        assert next(b["primary"] for b in after["buckets"] if b["bucket"] == bucket) != victim

        lines = [json.loads(x) for x in history.read_text().splitlines()]
        assert lines[-1]["epoch"] == EPOCHS
        # The run reaches 97% after both faults (an epoch evaluated before replica 1's restart
        # does not count), and ends trained. Each epoch is evaluated on the servers' weights with
        # replica 0's own BatchNorm statistics (buffers are not server tensors, docs/training.md)
        # while replica 1 still pushes: one evaluation can dip (0.891 between 0.968 and 0.965,
        # seen), and the last came out 0.968 to 0.982 in runs whose best was 0.977 to 0.985; so
        # the end is judged by the median of the last three evaluations.
        after = [x["accuracy"] for x in lines if x["time"] > restarted_at]
        last3 = sorted(x["accuracy"] for x in lines[-3:])
        assert after and max(after) >= 0.97 and last3[1] >= 0.96, lines
        assert out.exists()
        values, _ = client.pull(["x"])
        counts = load.check(values["x"])
        assert counts["acked"] > 100, counts
        log1 = (tmp_path / "logs" / "train1b.log").read_text()
        assert "epoch 1 already reported done by this replica: skipped" in log1, log1[-2000:]
        assert "epoch 10:" in log1
        digests_agree(c)
        client.close()
