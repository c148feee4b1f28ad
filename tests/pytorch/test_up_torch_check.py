"""`adamps up --torch` checks the factory and runs one batch forward and backward before it
starts any process (issue 37): a module that does not exist, or a model whose output does not fit
the labels, is one line naming the problem (the shapes), exit 2, no run directory, no log."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="adamps.torch needs torch")

from adamps.up.procs import adamps_argv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

WRONG = """
import torch
from torch import nn


class FiveWay(nn.Module):  # 5 outputs for the built-in images' 10 classes
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(28 * 28, 5)

    def forward(self, x):
        return self.fc(x.flatten(1))


class WrongInput(nn.Module):  # expects 100 features, gets images
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(100, 10)

    def forward(self, x):
        return self.fc(x.flatten(1))


def ctr_wrong():  # a Task whose model gives [batch, 2] for labels [batch]
    from adamps.torch import Task
    x = torch.randint(0, 50, (64, 4))
    y = torch.randint(0, 2, (64,)).float()
    data = torch.utils.data.TensorDataset(x, y)
    model = nn.Sequential(nn.Embedding(50, 3), nn.Flatten(), nn.Linear(12, 2))
    return Task(model=model, loss=nn.BCEWithLogitsLoss(), train=data, test=data)
"""


def up(cwd: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(cwd)])}
    t0 = time.monotonic()
    out = subprocess.run(
        adamps_argv("up", "--run-dir", str(cwd / "run"), "--no-progress", *flags),
        cwd=cwd, env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    return out, time.monotonic() - t0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "usermodels:FiveWay",
            "--torch usermodels:FiveWay: model output [8, 5] does not fit the labels [8] of 10 "
            "classes",
        ),
        ("usermodels:WrongInput", "the model's forward failed on inputs [8, 1, 28, 28]: "),
        ("usermodels:ctr_wrong", "model output [8, 2] does not fit the labels [8]: "),
        ("examples.nosuch:Net", "cannot import module 'examples.nosuch'"),
    ],
)
def test_bad_model_refused_before_any_process(tmp_path: Path, spec: str, message: str) -> None:
    (tmp_path / "usermodels.py").write_text(WRONG)
    out, _secs = up(tmp_path, "--torch", spec)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    # nothing was started: no run directory (its logs/ and pids.json), nothing printed on stdout
    assert not (tmp_path / "run").exists()
    assert out.stdout == ""
