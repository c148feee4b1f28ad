"""`python -m trainer.ctr --local`: 2 model replicas (processes) train embeddings and an MLP on
the planted click-through workload against a real local cluster; the held-out AUC beats chance
clearly and the loss falls (docs/training.md, "Embedding tables")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def test_ctr_command_trains_two_replicas_against_a_local_cluster() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ADAMPS_TOKEN": "ctr-test"}
    out = subprocess.run(
        [sys.executable, "-m", "trainer.ctr", "--local", "--servers", "2", "--replication", "2",
         "--replicas", "2", "--examples", "30720", "--test", "20000"],
        capture_output=True, text=True, timeout=200, env=env, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["replicas"] == 2 and res["examples"] == 2 * 30720 // 512 * 512
    assert res["n_ids"] >= 1_000_000
    assert res["loss_last"] < res["loss_first"]
    assert 0.6 < res["auc"] <= res["best_auc"] + 0.01, res
    # Bytes per step follow the batch's distinct ids (at most 4 x 512), not the table.
    assert res["row_bytes_per_step"] < 2 * 4 * 512 * (8 + 8 * 4)
