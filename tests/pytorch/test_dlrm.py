"""The DLRM example (examples/torch_dlrm.py) trained through ``adamps up --torch`` on the data
servers' planted-truth click logs (issue 38's Done-when): its held-out AUC is within 0.005 of the
same model trained in plain PyTorch on the same batches, from the same initial weights and rows,
with the same optimizers (Adagrad on the MLPs at the run's lr, Adagrad on the rows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")

from adamps.up.procs import adamps_argv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

EXAMPLES = 40_000  #: examples.torch_dlrm.task's default: the data servers' --ctr-examples
EPOCHS, BATCH, LR, SEED = 2, 256, 0.02, 0
DATA_SEED = 1234  #: the data servers' default --seed (the per-epoch order and the split)
TRAIN_ARGS = [f"batch_size={BATCH}", "optimizer=adagrad", f"lr={LR}", "n_push=1", "n_fetch=1",
              f"seed={SEED}"]  # fmt: skip


def plain_auc() -> float:
    """The same DLRM in plain PyTorch (nn.EmbeddingBag tables holding the server tables' initial
    rows), on the batches the data server streams to replica 0 of 1 in epochs 1..EPOCHS."""
    from dataserver.sources import load_source

    ds = load_source("ctr", ctr_examples=EXAMPLES, seed=DATA_SEED)
    threads = torch.get_num_threads()
    # one intra-op thread, as the replica's: on a loaded 2-core machine more made it 5x slower
    torch.set_num_threads(1)
    try:
        return _train_plain(ds)
    finally:
        torch.set_num_threads(threads)


def _train_plain(ds: Any) -> float:
    from adamps.torch.data import clicks
    from dataserver.partition import stream_positions
    from examples.torch_dlrm import DLRM, ROW_ADAGRAD_INITIAL, ROW_LR, ctr_auc
    from trainer.ctr_data import CtrSpec

    torch.manual_seed(SEED)  # as adamps train builds the factory's model
    model = DLRM(plain_sizes=CtrSpec().sizes)
    dense = [p for n, p in model.named_parameters() if not n.startswith("sparse.")]
    opts = [
        torch.optim.Adagrad(dense, lr=LR),
        torch.optim.Adagrad(model.sparse.parameters(), lr=ROW_LR,
                            initial_accumulator_value=ROW_ADAGRAD_INITIAL),
    ]  # fmt: skip
    loss_fn = torch.nn.BCEWithLogitsLoss()
    n = len(ds.train_y)
    for epoch in range(1, EPOCHS + 1):
        order = stream_positions(n, 0, 1, epoch, DATA_SEED, shuffle=True)
        for s in range(0, n, BATCH):
            sel = order[s : s + BATCH]
            x, y = clicks(ds.train_x[sel], ds.train_ids[sel], ds.train_y[sel])
            for o in opts:
                o.zero_grad()
            loss_fn(model(x), y).backward()
            for o in opts:
                o.step()
    model.eval()
    with torch.no_grad():
        x, y = clicks(ds.test_x, ds.test_ids, ds.test_y)
        return ctr_auc(model(x), y)


@pytest.mark.slow
@pytest.mark.timeout(420)
# torch's sparse Adagrad (the plain tables' rows) warns that it skips its invariant checks
@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")
def test_dlrm_through_adamps_up_matches_plain_pytorch(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("ADAMPS_TOKEN", None)
    args = [a for kv in TRAIN_ARGS for a in ("--train-arg", kv)]
    out = subprocess.run(
        adamps_argv("up", "--run-dir", str(run), "--no-progress", "--torch",
                    "examples.torch_dlrm:task", "--epochs", str(EPOCHS), "--trainers", "1",
                    "--controllers", "1", "--servers", "1", "--buckets", "8",
                    "--target-accuracy", "0", *args),
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=280,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "held-out metric (the task's)" in out.stdout, out.stdout[-2000:]
    ds_log = (run / "logs" / "dataserver0.log").read_text()
    assert "source ctr:" in ds_log and "rows of 13 dense features and 4 ids" in ds_log, ds_log
    adamps_auc = json.loads((run / "result.json").read_text())["heldout_accuracy"]
    reference = plain_auc()
    assert reference > 0.8, reference  # the planted truth is learnt at all
    assert abs(adamps_auc - reference) <= 0.005, (adamps_auc, reference)
    assert np.isfinite(adamps_auc)
