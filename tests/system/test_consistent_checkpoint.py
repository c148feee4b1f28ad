"""`adamps checkpoint save --consistent` (issue 24): one cut across every bucket, with writes
held for the moment of the cut, under push load from real processes on loopback.

The load: THREADS clients push +1 to every element of a tensor whose shards fall in every
bucket, again and again; each push is one request per server, touching every bucket that server
is primary of. A consistent cut holds each request whole or not at all, so every bucket of one
primary shows the same count, and the counts of all buckets differ by at most the pushes under
way (one per thread). Per-bucket cuts (no --consistent) are taken one after the other while pushes
land, and spread much further."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from adamps.checkpoint.save_restore import load
from adamps.client import ControllerRouting, PSClient
from adamps.layout import Layout, TensorSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import N_BUCKETS, SHARD, TOKEN, running_cluster  # noqa: E402

pytestmark = pytest.mark.slow

C = TensorSpec("c", (64 * SHARD,))  # 64 shards over 8 buckets
THREADS = 4
#: never pushed: it makes each bucket's copy take a while, so that without a hold pushes
#: would land between the copies of one server's buckets
PAD = TensorSpec("pad", (3000 * SHARD,))


def _counts(x: np.ndarray, layout: Layout) -> dict[int, set[float]]:
    """bucket -> the distinct values of its elements (one value: the bucket holds whole pushes)."""
    out: dict[int, set[float]] = {}
    for s in layout.shards_of["c"]:
        out.setdefault(layout.bucket_of[s.id], set()).update(np.unique(x[s.start : s.stop]))
    return out


def _save(c, to: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "adamps", "checkpoint", "save", "--to", str(to), *flags,
         "--controllers", ",".join(c.controllers), "--token", TOKEN],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_consistent_cut_holds_each_request_whole(tmp_path: Path) -> None:
    with running_cluster(tmp_path / "a", n_servers=3) as a:
        layout = Layout([C], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
        assert set(layout.bucket_of.values()) == set(range(N_BUCKETS))
        clients = [PSClient(ControllerRouting(a.controllers), layout, TOKEN, retry_for=20.0)
                   for _ in range(THREADS)]  # fmt: skip
        clients[0].create(C, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
        clients[0].create(PAD, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
        ones = np.ones(C.shape, np.float32)
        stop = threading.Event()
        pushed = [0] * THREADS

        def push(i: int) -> None:
            while not stop.is_set():
                clients[i].push_dense("c", ones)
                pushed[i] += 1

        threads = [threading.Thread(target=push, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        try:
            time.sleep(1.0)
            results = {}
            for flags in (("--consistent",), ()):
                d = tmp_path / ("cut" if flags else "per-bucket")
                r = _save(a, d, *flags)
                assert r.returncode == 0, r.stderr
                results[bool(flags)] = d
                time.sleep(0.3)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        n_pushed = sum(pushed)
        for c in clients:
            c.close()
        assert n_pushed > 20
    manifest = json.loads((results[True] / "manifest.json").read_text())
    assert manifest["consistent"] is True and 0 < manifest["hold_ms"] < 5000
    assert 0 <= manifest["hold_server_ms"] <= manifest["hold_ms"]
    _m, arrays, _rows = load(results[True])
    counts = _counts(arrays["c"], layout)
    primary = {int(b): url for b, url in manifest["cut_on"].items()}  # who cut each bucket
    assert all(len(v) == 1 for v in counts.values()), counts  # no bucket holds part of a push
    by_primary: dict[str, set[float]] = {}
    for b, v in counts.items():
        by_primary.setdefault(primary[b], set()).update(v)
    assert all(len(v) == 1 for v in by_primary.values()), by_primary  # requests whole
    values = sorted(set().union(*counts.values()))
    assert values[-1] - values[0] <= THREADS, values  # one instant: the pushes under way
    assert values[0] > 0
    # The per-bucket cuts of a plain save, taken one after the other while pushes land, are no
    # single instant: the load is dense enough for the checks above to see a torn cut.
    m2 = json.loads((results[False] / "manifest.json").read_text())
    assert m2["consistent"] is False
    per = sorted(set().union(*_counts(load(results[False])[1]["c"], layout).values()))
    assert len(per) > 1, per
    print(f"consistent cut: {values}, hold {manifest['hold_ms']:.1f} ms; per-bucket: {per}")
