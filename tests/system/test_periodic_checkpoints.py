"""Periodic checkpoints run by the controllers' leader (issue 24), with real processes on
loopback: the leader SIGKILLed in the middle of a periodic checkpoint; the next leader takes
over the schedule (from the Raft record), its checkpoint is incremental on the last complete
one (an unchanged tensor is not written again), pruning keeps what it names, and the
checkpoint restores bit-identical onto a new cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adamps.checkpoint import series as ckpt_series
from adamps.checkpoint.save_restore import load
from adamps.client import ControllerRouting, PSClient
from adamps.layout import Layout, TensorSpec
from adamps.testing.exactness import ExactnessLoad
from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_PS_OPTS, LocalCluster, http_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import N_BUCKETS, SHARD, TENSOR, TOKEN, make_client  # noqa: E402

pytestmark = pytest.mark.slow

#: a tensor nobody pushes to: an incremental checkpoint names the files that already hold it
BIG = TensorSpec("big", (3_000_000,))
INTERVAL = 2.0


def _cluster(root: Path, n: int, **ctl: Any) -> LocalCluster:
    return LocalCluster(
        root, token=TOKEN, n_servers=n, n_buckets=N_BUCKETS,
        controller_opts={**FAST_CONTROLLER_OPTS, "replication": min(3, n), **ctl},
        ps_opts={**FAST_PS_OPTS, "max-shard-elems": SHARD},
    )  # fmt: skip


def _record(c: LocalCluster) -> dict[str, Any] | None:
    """The checkpoint record and running checkpoint of the current leader's /status."""
    i = c.controller_leader()
    if i is None:
        return None
    code, st = http_json(f"http://{c.controllers[i]}/status", timeout=1.0)
    return {**st["checkpoints"], "leader": i} if code == 200 else None


def _wait(c: LocalCluster, pred, timeout: float, what: str, poll: float = 0.2) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = _record(c)
        if rec is not None and pred(rec):
            return rec
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}; last record {_record(c)}")


def _holds(root: Path, rec: dict[str, Any], tensor: str) -> bool:
    """Whether the record's last complete checkpoint holds the tensor."""
    if not rec["count"] or not rec.get("last"):
        return False
    try:
        manifest = json.loads((root / rec["last"]["name"] / "manifest.json").read_text())
    except OSError:  # pruned meanwhile: the next record names a newer one
        return False
    return any(d["name"] == tensor for d in manifest["tensors"])


def test_the_leader_killed_during_a_periodic_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    a = _cluster(tmp_path / "a", 3, **{"checkpoint-interval": INTERVAL, "checkpoint-keep": 2,
                                      "checkpoint-dir": str(root)})  # fmt: skip
    try:
        a.start(timeout=60)
        client, layout = make_client(a)
        client.create(BIG, init={"kind": "normal", "std": 0.1, "seed": 5},
                      optimizer={"kind": "adagrad", "lr": 0.1})  # fmt: skip
        load_ = ExactnessLoad(client, layout, "x", threads=2)
        load_.start()
        # The schedule runs from the cluster's start: a first checkpoint may predate BIG, and
        # one built on it writes BIG whole. Wait for one that holds BIG.
        first = _wait(a, lambda r: _holds(root, r, "big"), 60, "a periodic checkpoint of big")
        # The next one, caught under way on the leader: SIGKILL that leader.
        running = _wait(a, lambda r: r["running"] is not None, 30, "a checkpoint under way",
                        poll=0.01)  # fmt: skip
        killed_name = running["running"]
        a.kill(f"controller{running['leader']}")
        with load_.out.lock:
            acked_at_kill = set(load_.out.acked)
        # The next leader finds the checkpoint due in the replicated record and takes it.
        after = _wait(
            a, lambda r: r["count"] > first["count"] and r["last"]["name"] != killed_name
            and r["leader"] != running["leader"], 60, "the next leader's checkpoint",
        )  # fmt: skip
        _wait(a, lambda r: r["count"] >= after["count"] + 1, 30, "one more checkpoint")
        load_.stop()
        with load_.out.lock:
            failed = set(load_.out.failed)
        client.close()
    finally:
        a.stop()
    taken = json.loads((root / after["last"]["name"] / "manifest.json").read_text())
    assert taken["format"] == 2 and taken["base"] is not None
    # Incremental: the unchanged tensor's shards are named in an earlier checkpoint's files.
    big = [r for r in taken["shards"].values() if r["tensor"] == "big"]
    assert big and all(r["file"].startswith("../") for r in big)
    assert taken["written_bytes"] < sum(f["bytes"] for f in taken["files"].values()) / 4
    # keep=2: only the two newest complete checkpoints remain, and they load.
    done = ckpt_series.complete(root)
    assert len(done) == 2, done
    for d in done:
        load(d)
    newest = done[-1]
    _manifest, arrays, _rows = load(newest)
    x = arrays["x"]
    assert set(np.unique(x)) <= {0.0, 1.0}
    missing = [i for i in acked_at_kill if x[i] != 1.0]
    assert not missing, f"acknowledged before the checkpoint, absent from it: {missing[:10]}"
    assert not [i for i in failed if x[i] != 0.0]
    # Restored onto a new cluster of one server: pulls bit-identical to the checkpoint.
    b = _cluster(tmp_path / "b", 1)
    try:
        b.start(timeout=60)
        r = subprocess.run(
            [sys.executable, "-m", "adamps", "checkpoint", "restore", "--from", str(newest),
             "--controllers", ",".join(b.controllers), "--token", TOKEN],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        lay = Layout([TENSOR, BIG], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
        c = PSClient(ControllerRouting(b.controllers), lay, TOKEN, retry_for=20.0)
        got, _ = c.pull(["x", "big"])
        c.close()
    finally:
        b.stop()
    for name in ("x", "big"):
        assert got[name].tobytes() == arrays[name].tobytes(), name
