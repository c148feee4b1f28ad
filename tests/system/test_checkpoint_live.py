"""Checkpoints on a live cluster (issue 39), with real processes on loopback: the documented
rollback (`restore --force` onto the cluster the trainers still use, whose tensors they created
with their own init), a save right after a server crash, and the versions a restored shard
carries."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from adamps.checkpoint.save_restore import Cluster, save
from adamps.checkpoint.save_restore import load as load_ckpt
from adamps.client import ControllerRouting, PSClient
from adamps.layout import Layout, TensorSpec
from adamps.up.cluster import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import (  # noqa: E402  (in tests/; the tests import in importlib mode)
    N_BUCKETS,
    SHARD,
    TOKEN,
    digests_agree,
    running_cluster,
)

pytestmark = pytest.mark.slow

BIAS = TensorSpec("conv1.b", (3_000,))
W = TensorSpec("conv1.w", (2_000,))
TABLE = "emb"


def _trainer(c: LocalCluster) -> PSClient:
    """What a trainer creates: tensors with its own (non-zero) init, an Adagrad one, a table."""
    layout = Layout([BIAS, W], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
    client = PSClient(ControllerRouting(c.controllers), layout, TOKEN, retry_for=20.0)
    client.create(BIAS, init={"kind": "constant", "value": 0.1},
                  optimizer={"kind": "sgd", "lr": 0.5})  # fmt: skip
    client.create(W, init={"kind": "normal", "std": 0.1, "seed": 7},
                  optimizer={"kind": "adagrad", "lr": 0.1})  # fmt: skip
    client.create_table(TABLE, 4, optimizer={"kind": "adagrad", "lr": 0.05})
    return client


def _train(client: PSClient, rng: np.random.Generator, steps: int) -> None:
    for _ in range(steps):
        client.push_dense("conv1.b", rng.standard_normal(BIAS.shape).astype(np.float32))
        client.push_dense("conv1.w", rng.standard_normal(W.shape).astype(np.float32))
        ids = rng.integers(0, 5_000, 100)
        client.push_rows(TABLE, ids, rng.standard_normal((100, 4)).astype(np.float32))


def _cli(c: LocalCluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "adamps", "checkpoint", *args,
         "--controllers", ",".join(c.controllers), "--token", TOKEN],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_force_restore_rolls_back_a_live_training_run(tmp_path: Path) -> None:
    """Issue 39 #6: the trainers created their tensors with their own init (not zeros); a
    checkpoint of the run, more training, then `restore --force` onto the same cluster: the
    values, accumulators and rows are the checkpoint's again, bit for bit, every copy agrees,
    and the trainers' definitions are kept. A shape mismatch is still refused, unchanged."""
    ckpt = tmp_path / "ckpt"
    rng = np.random.default_rng(0)
    with running_cluster(tmp_path / "c", n_servers=3) as c:
        client = _trainer(c)
        _train(client, rng, 3)
        r = _cli(c, "save", "--to", str(ckpt))
        assert r.returncode == 0, r.stderr
        _, want, want_rows = load_ckpt(ckpt)
        _train(client, rng, 3)  # the run goes on, then is rolled back
        got, _ = client.pull(["conv1.b"])
        assert got["conv1.b"].tobytes() != want["conv1.b"].tobytes()
        r = _cli(c, "restore", "--from", str(ckpt), "--force")
        assert r.returncode == 0, r.stderr
        got, _ = client.pull(["conv1.b", "conv1.w"])
        for name in ("conv1.b", "conv1.w"):
            assert got[name].tobytes() == want[name].tobytes(), name
        again = tmp_path / "again"
        cl = Cluster(c.controllers, TOKEN)
        save(cl, again)
        cl.close()
        _, re, re_rows = load_ckpt(again)
        assert re["conv1.w/accum"].tobytes() == want["conv1.w/accum"].tobytes()
        assert {k: v.tobytes() for k, v in re_rows.items()} == {
            k: v.tobytes() for k, v in want_rows.items()
        }
        defs = {d["name"]: d for d in json.loads((again / "manifest.json").read_text())["tensors"]}
        assert defs["conv1.b"]["init"] == {"kind": "constant", "value": 0.1}
        digests_agree(c)
        # The trainers go on: a push applies on top of the restored values.
        client.push_dense("conv1.b", np.ones(BIAS.shape, np.float32))
        got, _ = client.pull(["conv1.b"])
        assert np.array_equal(got["conv1.b"], want["conv1.b"] - 0.5)
        # A checkpoint of another shape for the same name is refused, naming it; nothing changes.
        m = json.loads((ckpt / "manifest.json").read_text())
        m["tensors"] = [d if d["name"] != "conv1.b" else {**d, "shape": [1000, 3]}
                        for d in m["tensors"]]  # fmt: skip
        (ckpt / "manifest.json").write_text(json.dumps(m))
        r = _cli(c, "restore", "--from", str(ckpt), "--force")
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "layout mismatch: tensor 'conv1.b' is [1000, 3]" in r.stderr, r.stderr
        after, _ = client.pull(["conv1.b"])
        assert after["conv1.b"].tobytes() == got["conv1.b"].tobytes()
        client.close()


@pytest.mark.parametrize("consistent", [False, True])
def test_a_save_right_after_a_server_crash_waits_for_the_failover(
    tmp_path: Path, consistent: bool
) -> None:
    """Issue 39 #9: a save started at once after a server's SIGKILL (the controllers have not
    declared it dead yet, the routing table still lists it) reads the dead server's buckets
    from the primaries the failover makes, within its deadline, and completes with every
    acknowledged push in it."""
    ckpt = tmp_path / "ckpt"
    with running_cluster(tmp_path / "c", n_servers=4) as c:
        layout = Layout([BIAS], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
        client = PSClient(ControllerRouting(c.controllers), layout, TOKEN, retry_for=20.0)
        client.create(BIAS, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
        ones = np.ones(BIAS.shape, np.float32)
        client.push_dense("conv1.b", ones)
        view = c.cluster()
        victim = max(c.server_ids,
                     key=lambda s: sum(b["primary"] == s for b in view["buckets"]))  # fmt: skip
        cluster = Cluster(c.controllers, TOKEN, retry_for=30.0)
        c.kill(victim)
        t0 = time.monotonic()
        try:
            manifest = save(cluster, ckpt, consistent=consistent)
        finally:
            cluster.close()
        assert time.monotonic() - t0 < 30.0
        assert manifest["consistent"] is consistent
        assert any(cut["epoch"] > 1 for cut in manifest["cuts"].values()), (
            "no bucket was read from a primary promoted after the kill"
        )
        _, got, _ = load_ckpt(ckpt)
        assert got["conv1.b"].tobytes() == ones.tobytes()
        client.close()


def test_a_save_past_its_deadline_is_one_clear_line(tmp_path: Path) -> None:
    """With every server stopped (no failover can come), the save ends after --wait with a
    message naming the deadline, exit code 1, no traceback, no manifest."""
    ckpt = tmp_path / "ckpt"
    with running_cluster(tmp_path / "c", n_servers=3) as c:
        for s in c.server_ids:
            c.kill(s)
        t0 = time.monotonic()
        r = _cli(c, "save", "--to", str(ckpt), "--wait", "3")
        assert time.monotonic() - t0 < 60.0
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "3 s (--wait)" in r.stderr, r.stderr
        assert not (ckpt / "manifest.json").exists()


def test_restored_shards_carry_the_checkpoints_versions(tmp_path: Path) -> None:
    """Issue 39 #17: a checkpoint restored onto a new cluster: every shard and row shard
    reports the version the manifest holds (not 1), on every copy (a save of the restored
    cluster, which reads each bucket's primary, records the same versions)."""
    ckpt = tmp_path / "ckpt"
    rng = np.random.default_rng(1)
    with running_cluster(tmp_path / "a", n_servers=3) as a:
        client = _trainer(a)
        _train(client, rng, 12)
        client.close()
        r = _cli(a, "save", "--to", str(ckpt))
        assert r.returncode == 0, r.stderr
    saved = json.loads((ckpt / "manifest.json").read_text())
    want = {sid: rec["version"] for part in ("shards", "row_shards")
            for sid, rec in saved[part].items()}  # fmt: skip
    assert min(v for sid, v in want.items() if "#rows" not in sid) >= 12
    with running_cluster(tmp_path / "b", n_servers=3) as b:
        r = _cli(b, "restore", "--from", str(ckpt))
        assert r.returncode == 0, r.stderr
        cl = Cluster(b.controllers, TOKEN)
        again = save(cl, tmp_path / "again")
        cl.close()
        got = {sid: rec["version"] for part in ("shards", "row_shards")
               for sid, rec in again[part].items()}  # fmt: skip
        assert got == want
        digests_agree(b)
