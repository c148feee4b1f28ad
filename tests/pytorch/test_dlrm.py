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
    from adamps.data.ctr_data import CtrSpec
    from adamps.torch.data import clicks
    from dataserver.partition import stream_positions
    from examples.torch_dlrm import DLRM, ROW_ADAGRAD_INITIAL, ROW_LR, ctr_auc

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


def criteo_tsv(path: Path, rows: int) -> Path:
    """A small Criteo-format TSV, some fields empty: a click is likely (0.8) when field 0 holds
    one of its first 30 values, unlikely (0.15) otherwise."""
    rng = np.random.default_rng(11)
    lines = []
    for _ in range(rows):
        dense = [str(v) if v < 30 else "" for v in rng.integers(0, 33, 13)]
        cats = [f"{v:08x}" if v < 60 else "" for v in rng.integers(0, 64, 26)]
        label = int(rng.random() < (0.8 if cats[0] and int(cats[0], 16) < 30 else 0.15))
        lines.append("\t".join([str(label), *dense, *cats]) + "\n")
    path.write_text("".join(lines))
    return path


def test_a_task_names_a_source_the_data_servers_know() -> None:
    from adamps.torch import Task
    from adamps.torch.params import ModelError
    from adamps.torch.task import as_task

    model = torch.nn.Linear(2, 1)
    for bad in ("csv:clicks.csv", "ctr:", "images"):
        with pytest.raises(ModelError, match=f"Task.source is {bad!r}, expected 'builtin', 'ctr'"):
            as_task(Task(model=model, source=bad), "m:f")
    assert as_task(Task(model=model, source="ctr:/data/day_0.tsv"), "m:f").source.endswith("tsv")


def test_preflight_checks_a_click_model_on_its_sources_first_rows(tmp_path, monkeypatch) -> None:
    """adamps up --torch's check before anything starts: the DLRM runs forward and backward on
    the generator's rows, and the 26-field one on a TSV's; a click log without rows is refused
    naming the file."""
    from adamps.torch.data import preflight
    from adamps.torch.params import ModelError

    assert preflight("examples.torch_dlrm:task", 0, 16).source == "ctr"
    monkeypatch.setenv("ADAMPS_CTR_FILE", str(criteo_tsv(tmp_path / "day.tsv", 40)))
    task = preflight("examples.torch_dlrm:criteo", 0, 16)
    assert task.source == f"ctr:{tmp_path / 'day.tsv'}" and len(task.model.fields) == 26
    (tmp_path / "empty.tsv").write_text("not a row\n")
    monkeypatch.setenv("ADAMPS_CTR_FILE", str(tmp_path / "empty.tsv"))
    with pytest.raises(ModelError, match=rf"click log {tmp_path / 'empty.tsv'} has no row"):
        preflight("examples.torch_dlrm:criteo", 0, 16)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dlrm_trains_on_a_criteo_tsv_through_adamps_up(tmp_path: Path) -> None:
    """`--source ctr:FILE` chosen by the Task: adamps up starts the data server on the file (26
    fields) and the DLRM trains on it to a held-out AUC."""
    path = criteo_tsv(tmp_path / "day_0.tsv", 2000)
    run = tmp_path / "run"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "ADAMPS_CTR_FILE": str(path)}
    env.pop("ADAMPS_TOKEN", None)
    args = [a for kv in ["batch_size=64", *TRAIN_ARGS[1:]] for a in ("--train-arg", kv)]
    out = subprocess.run(
        adamps_argv("up", "--run-dir", str(run), "--no-progress", "--torch",
                    "examples.torch_dlrm:criteo", "--epochs", "2", "--trainers", "1",
                    "--controllers", "1", "--servers", "1", "--buckets", "8",
                    "--target-accuracy", "0.6", *args),
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=280,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ds_log = (run / "logs" / "dataserver0.log").read_text()
    assert (
        f"source ctr:{path}: 1600 training / 400 held-out rows of 13 dense features and 26 ids"
        in ds_log
    )
    assert json.loads((run / "result.json").read_text())["heldout_accuracy"] >= 0.6
