"""`adamps train --init CHECKPOINT` (issue 24): a run trained with Adagrad on one cluster is
saved with `adamps checkpoint save`; a new run on a new, empty cluster starts from it at the
checkpoint's held-out accuracy (within 0.1 points: the same weights), with the checkpoint's
Adagrad accumulators installed on the servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from adamps.checkpoint.save_restore import load
from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_PS_OPTS, LocalCluster
from trainer.local import builtin_data
from trainer.model import Model, resolve_spec

pytestmark = pytest.mark.slow
TOKEN = "warm-start-token"


def _cluster(root: Path) -> LocalCluster:
    return LocalCluster(root, token=TOKEN, n_servers=1, n_buckets=8,
                        controller_opts={**FAST_CONTROLLER_OPTS, "replication": 1},
                        ps_opts=FAST_PS_OPTS)  # fmt: skip


def _train(c: LocalCluster, ds: str, history: Path, *more: str) -> None:
    p = c.start_process(
        f"train-{history.stem}", "train", "--controllers", ",".join(c.controllers),
        "--dataservers", f"http://{ds}", "--epochs", "1", "--optimizer", "adagrad",
        "--metrics-port", "-1", "--history", str(history), *more,
    )  # fmt: skip
    assert p.popen.wait(600) == 0, p.tail(40)


@pytest.mark.timeout(900)
def test_a_run_started_from_a_checkpoint_begins_at_its_accuracy(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    a = _cluster(tmp_path / "a")
    try:
        a.start(timeout=60)
        ds = a.start_dataserver("--no-augment")
        _train(a, ds, tmp_path / "h1.jsonl")
        r = subprocess.run(
            [sys.executable, "-m", "adamps", "checkpoint", "save", "--to", str(ckpt),
             "--controllers", ",".join(a.controllers), "--token", TOKEN],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
    finally:
        a.stop()
    # The checkpoint's own held-out accuracy, from its values alone.
    _m, arrays, _rows = load(ckpt)
    model = Model(resolve_spec("adam-mnist"))
    for name, _shape in model.tensors():
        model.param(name)[...] = arrays[name]
    _, _, test_x, test_y = builtin_data()
    acc_ckpt = model.accuracy(model.prepare(test_x), test_y)
    assert any(k.endswith("/accum") and arrays[k].any() for k in arrays)  # Adagrad's, saved
    b = _cluster(tmp_path / "b")
    try:
        b.start(timeout=60)
        ds = b.start_dataserver("--no-augment")
        _train(b, ds, tmp_path / "h2.jsonl", "--init", str(ckpt))
        log = (tmp_path / "b" / "logs" / "train-h2.log").read_text()
    finally:
        b.stop()
    lines = [json.loads(x) for x in (tmp_path / "h2.jsonl").read_text().splitlines()]
    start = next(x for x in lines if x["epoch"] == 0)
    assert abs(start["accuracy"] - acc_ckpt) * 100 <= 0.1, (start, acc_ckpt)
    assert acc_ckpt > 0.5  # a trained model, not chance
    assert "warm start: optimizer state of" in log, log[-2000:]  # Adagrad's, installed
    assert np.isfinite(lines[-1]["accuracy"])
