"""The data servers' batches are read-only arrays (views of the received bytes); turning them into
tensors must not print PyTorch's "NumPy array is not writable" warning, which every torch trainer
printed (issue 37)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="adamps.torch needs torch")

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import types
import numpy as np
from adamps.torch.data import dataserver_batches
x = np.frombuffer(bytes(range(256)) * 4, dtype=np.uint8).reshape(4, 16, 16)
y = np.frombuffer(np.arange(4, dtype=np.int64).tobytes(), dtype=np.int64)
assert not x.flags.writeable and not y.flags.writeable
(xt, yt), = dataserver_batches([types.SimpleNamespace(x=x, y=y)])
assert xt.shape == (4, 1, 16, 16) and float(xt.max()) == 1.0 and yt.tolist() == [0, 1, 2, 3]
print("ok")
"""


def test_read_only_batches_make_tensors_without_a_warning() -> None:
    out = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", CODE],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert "not writable" not in out.stderr
