"""Checkpoints that move (issue 24), with real processes on loopback: a checkpoint saved from
3 servers under push load and restored onto 1 and onto 5, pulls bit-identical to the
checkpoint; a primary SIGKILLed during a save; a cluster that lost every server's data
directory restored from its checkpoint, training on."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from adamps.checkpoint.save_restore import Cluster, save, write
from adamps.checkpoint.save_restore import load as load_ckpt
from adamps.client.rpc import SyncRpc
from adamps.layout import Layout, TensorSpec
from adamps.testing.exactness import ExactnessLoad
from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_PS_OPTS, LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import (  # noqa: E402  (in tests/; the tests import in importlib mode)
    N_BUCKETS,
    SHARD,
    TENSOR,
    TOKEN,
    digests_agree,
    make_client,
    running_cluster,
)

pytestmark = pytest.mark.slow


@contextmanager
def cluster_of(root: Path, n: int) -> Iterator[LocalCluster]:
    """running_cluster with a replication factor the servers can meet (1 server: 1 copy)."""
    c = LocalCluster(
        root, token=TOKEN, n_servers=n, n_buckets=N_BUCKETS,
        controller_opts={**FAST_CONTROLLER_OPTS, "replication": min(3, n)},
        ps_opts={**FAST_PS_OPTS, "max-shard-elems": SHARD},
    )  # fmt: skip
    try:
        c.start(timeout=60)
        yield c
    finally:
        c.stop()


ADA = TensorSpec("w", (5_000,))
TABLE = "emb"
ADAM_TABLE = "emb_adam"


def _populate(c: LocalCluster):
    """TENSOR (exactness load target), an Adam tensor (amsgrad: 3 state arrays and a step count
    per shard, all checkpointed) and an embedding table with rows (row-wise Adagrad: one
    accumulator per row)."""
    client, layout = make_client(c)
    client.create(ADA, init={"kind": "normal", "std": 0.1, "seed": 3},
                  optimizer={"kind": "adam", "lr": 0.01, "amsgrad": True})  # fmt: skip
    layout = layout.with_tensor(ADA)
    client.layout = layout
    client.create_table(TABLE, 4, optimizer={"kind": "rowwise_adagrad", "lr": 0.05})
    # row Adam: signed first moments and a step count per row, checkpointed with the rows
    client.create_table(ADAM_TABLE, 3, optimizer={"kind": "sparse_adam", "lr": 0.05})
    rng = np.random.default_rng(0)
    for _ in range(3):
        client.push_dense("w", rng.standard_normal(ADA.shape).astype(np.float32))
        ids = rng.integers(0, 10_000, 200)
        client.push_rows(TABLE, ids, rng.standard_normal((200, 4)).astype(np.float32))
        client.push_rows(ADAM_TABLE, ids, rng.standard_normal((200, 3)).astype(np.float32))
    return client, layout


def _cli(c: LocalCluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "adamps", "checkpoint", *args,
         "--controllers", ",".join(c.controllers), "--token", TOKEN],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _restored_matches(c: LocalCluster, ckpt: Path, tmp: Path) -> np.ndarray | None:
    """Restores `ckpt` onto `c` with the CLI; the pulls equal the checkpoint bit for bit, and
    a save of the restored cluster holds the same arrays (accumulators and rows too)."""
    r = _cli(c, "restore", "--from", str(ckpt))
    assert r.returncode == 0, r.stderr
    manifest, want, want_rows = load_ckpt(ckpt)
    # The tensors the checkpoint holds (the primary-kill test's has no Adagrad tensor nor table)
    names = [d["name"] for d in manifest["tensors"]]
    specs = [t for t in (TENSOR, ADA) if t.name in names]
    layout = Layout(specs, n_buckets=N_BUCKETS, max_shard_elems=SHARD)
    from adamps.client import ControllerRouting, PSClient

    client = PSClient(ControllerRouting(c.controllers), layout, TOKEN, retry_for=20.0)
    got, _ = client.pull(names)
    for name in names:
        assert got[name].tobytes() == want[name].tobytes(), name
    rows = None
    if manifest["tables"]:
        client.tables[TABLE] = 4
        rows = client.pull_rows(TABLE, np.arange(10_000))
    client.close()
    again = tmp / "again"
    cl = Cluster(c.controllers, TOKEN)
    save(cl, again)
    cl.close()
    _m, re, re_rows = load_ckpt(again)
    if "w" in names:  # Adam's state: 3 arrays of 5,000 and a step count (2) per shard
        assert want["w/accum"].size == 3 * ADA.shape[0] + 2 * len(layout.shards_of["w"])
    assert sorted(re) == sorted(want)
    for k in want:
        assert re[k].tobytes() == want[k].tobytes(), k
    assert re_rows.keys() == want_rows.keys()
    for k in want_rows:  # the rows and their optimizer state (sparse_adam's too) bit for bit
        assert re_rows[k].tobytes() == want_rows[k].tobytes(), k
    digests_agree(c)
    return rows


def test_round_trip_from_3_servers_under_load_onto_1_and_5(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    with running_cluster(tmp_path / "a", n_servers=3) as a:
        client, layout = _populate(a)
        rows_before = None
        client.tables[TABLE] = 4
        load = ExactnessLoad(client, layout, "x", threads=3)
        load.start()
        time.sleep(1.0)
        with load.out.lock:
            acked_before = set(load.out.acked)
        r = _cli(a, "save", "--to", str(ckpt))
        time.sleep(0.5)
        load.stop()
        assert r.returncode == 0, r.stderr
        rows_before = client.pull_rows(TABLE, np.arange(10_000))
        client.close()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["format"] == 2 and manifest["consistent"] is False
    assert sorted(manifest["cuts"]) == sorted(str(b) for b in range(N_BUCKETS))
    assert all(cut["seq"] is not None and cut["epoch"] > 0 for cut in manifest["cuts"].values())
    x = load_ckpt(ckpt)[1]["x"]
    assert len(acked_before) > 20
    _cut_is_of_acknowledged_pushes(x, acked_before, set(load.out.failed))
    for n in (1, 5):
        with cluster_of(tmp_path / f"b{n}", n) as b:
            rows = _restored_matches(b, ckpt, tmp_path / f"b{n}")
            # No push reached the rows during the save: the restored rows are the source's.
            assert rows.tobytes() == rows_before.tobytes()
            if n == 5:
                _a_half_created_tensor_is_named_by_the_save(b, tmp_path / "half")


def _a_half_created_tensor_is_named_by_the_save(c: LocalCluster, to: Path) -> None:
    """A create that reached one server of five (create is not replicated) fails every save:
    the save names the tensor and says to send its create again, then saves once it is."""
    view = c.cluster()
    servers = view["servers"]
    # a primary's server: a save reads every bucket from its primary (a copy held by
    # secondaries only would be invisible to it); 16 shards over 8 buckets reach the others too
    first = next(bk["primary"] for bk in view["buckets"] if bk.get("primary"))
    half = {"name": "half", "shape": [16 * SHARD], "init": {"kind": "zeros"}}
    with SyncRpc(servers[first]["address"], TOKEN) as rpc:
        rpc.call("create", **half)
    r = _cli(c, "save", "--to", str(to))
    assert r.returncode != 0
    assert "'half' is defined on some servers only" in r.stderr, r.stderr
    assert "send its create again to every server" in r.stderr, r.stderr
    for sid in servers:
        with SyncRpc(servers[sid]["address"], TOKEN) as rpc:
            rpc.call("create", **half)
    r = _cli(c, "save", "--to", str(to))
    assert r.returncode == 0, r.stderr


def _cut_is_of_acknowledged_pushes(x: np.ndarray, acked_before: set[int], failed: set[int]) -> None:
    """A checkpoint of ExactnessLoad's tensor is a cut of its pushes: every element 0 or 1,
    every push acknowledged before the save began present, no refused push present."""
    assert set(np.unique(x)) <= {0.0, 1.0}
    missing = [i for i in acked_before if x[i] != 1.0]
    assert not missing, f"acknowledged before the save, absent from it: {missing[:10]}"
    present = [i for i in failed if x[i] != 0.0]
    assert not present, f"refused pushes present in the checkpoint: {present[:10]}"


def test_a_primary_sigkilled_during_a_save(tmp_path: Path) -> None:
    """The save either completes with a correct cut (the killed primary's buckets read from
    their new primaries) or fails with a clear error and leaves no manifest."""
    ckpt = tmp_path / "ckpt"
    with running_cluster(tmp_path / "a", n_servers=4) as a:
        client, layout = make_client(a)
        load = ExactnessLoad(client, layout, "x", threads=3)
        load.start()
        time.sleep(1.0)
        view = a.cluster()
        victim = max(a.server_ids,
                     key=lambda s: sum(b["primary"] == s for b in view["buckets"]))  # fmt: skip
        with load.out.lock:
            acked_before = set(load.out.acked)
        proc = subprocess.Popen(
            [sys.executable, "-m", "adamps", "checkpoint", "save", "--to", str(ckpt),
             "--controllers", ",".join(a.controllers), "--token", TOKEN],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        a.kill(victim)
        out, err = proc.communicate(timeout=120)
        time.sleep(0.5)
        load.stop()
        with load.out.lock:
            failed = set(load.out.failed)
        client.close()
        if proc.returncode != 0:  # a clear error, and no checkpoint to restore wrong data
            assert "adamps checkpoint save:" in err and not (ckpt / "manifest.json").exists()
            return
    x = load_ckpt(ckpt)[1]["x"]
    _cut_is_of_acknowledged_pushes(x, acked_before, failed)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert any(cut["epoch"] > 1 for cut in manifest["cuts"].values()), (
        "no bucket was read from a primary promoted after the kill"
    )
    with cluster_of(tmp_path / "b", 3) as b:
        _restored_matches(b, ckpt, tmp_path / "b")


def test_disaster_recovery_every_data_dir_lost(tmp_path: Path) -> None:
    """Every server's data directory is lost; a new cluster restored from the checkpoint takes
    pushes on top of it, exactly once; a second restore onto it is refused (not empty) unless
    --force, and the refusal changes nothing."""
    ckpt = tmp_path / "ckpt"
    with running_cluster(tmp_path / "a", n_servers=3) as a:
        client, _ = make_client(a)
        ones = np.zeros(TENSOR.shape, np.float32)
        ones[::7] = 1.0
        client.push_dense("x", ones)
        r = _cli(a, "save", "--to", str(ckpt))
        assert r.returncode == 0, r.stderr
        client.push_dense("x", ones)  # after the checkpoint: lost with the disks
        client.close()
    for d in (tmp_path / "a").glob("ps*"):  # the disaster
        shutil.rmtree(d)
    with running_cluster(tmp_path / "b", n_servers=3) as b:
        r = _cli(b, "restore", "--from", str(ckpt))
        assert r.returncode == 0, r.stderr
        client, _ = make_client(b)
        got, _ = client.pull(["x"])
        assert got["x"].tobytes() == ones.tobytes()
        # Training continues on the restored state: pushes add exactly once on top of it.
        client.push_dense("x", ones)
        got, _ = client.pull(["x"])
        assert got["x"].tobytes() == (2 * ones).tobytes()
        refused = _cli(b, "restore", "--from", str(ckpt))
        assert refused.returncode == 1 and "already holds tensors ['x']" in refused.stderr
        assert "--force" in refused.stderr
        got, _ = client.pull(["x"])
        assert got["x"].tobytes() == (2 * ones).tobytes()  # nothing changed
        forced = _cli(b, "restore", "--from", str(ckpt), "--force")
        assert forced.returncode == 0, forced.stderr
        got, _ = client.pull(["x"])
        assert got["x"].tobytes() == ones.tobytes()
        # Checkpoints whose layout does not fit this cluster: refused before any write.
        sgd = {"kind": "sgd", "lr": -1.0}
        other = tmp_path / "other-shape"
        write(other, {"x": np.zeros(10, np.float32)}, {},
              {"n_buckets": N_BUCKETS, "tensors": [{"name": "x", "shape": [10],
               "optimizer": sgd}], "tables": []})  # fmt: skip
        r = _cli(b, "restore", "--from", str(other), "--force")
        assert r.returncode == 1 and "layout mismatch: tensor 'x' is [10]" in r.stderr
        rows = tmp_path / "other-buckets"
        write(rows, {"y": np.zeros(3, np.float32)}, {"t#rows/0": np.zeros(8, np.uint8)},
              {"n_buckets": 3, "tensors": [{"name": "y", "shape": [3], "optimizer": sgd}],
               "tables": [{"name": "t", "dim": 2}]})  # fmt: skip
        r = _cli(b, "restore", "--from", str(rows), "--force")
        assert r.returncode == 1 and "hashed into 3 buckets, the cluster has 8" in r.stderr
        got, _ = client.pull(["x"])
        assert got["x"].tobytes() == ones.tobytes()
        statuses = []
        for addr in b.servers:
            with SyncRpc(addr, TOKEN) as rpc:
                statuses.append(rpc.get_json("/status"))
        assert all(set(st["tensors"]) == {"x"} for st in statuses)  # no 'y' created
        digests_agree(b)
        client.close()
