"""`adamps export --format torch` and `adamps train --init STATE_DICT` (issue 24): a checkpoint's
values as a PyTorch state_dict under the parameters' own names (the run prefix removed), which
`torch.load` + `load_state_dict` put into the user's model, and a state_dict file as --init."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from adamps.checkpoint.save_restore import write
from trainer.warm import InitError, initial_values


def _ckpt(d: Path, runs: tuple[str, ...] = ("default",)) -> Path:
    rng = np.random.default_rng(0)
    arrays, defs = {}, []
    for run in runs:
        for name, shape in (("fc.weight", (3, 4)), ("fc.bias", (3,))):
            arrays[f"{run}..{name}"] = rng.standard_normal(shape).astype(np.float32)
            defs.append({"name": f"{run}..{name}", "shape": list(shape)})
    arrays["default..fc.weight/accum"] = np.ones((3, 4), np.float32)
    write(d, arrays, {}, {"tensors": defs, "tables": []})
    return d


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "adamps", "export", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_export_torch_loads_into_the_users_model(tmp_path: Path) -> None:
    d = _ckpt(tmp_path / "c")
    out = tmp_path / "model.pt"
    r = _export("--from", str(d), "--format", "torch", "--out", str(out))
    assert r.returncode == 0, r.stderr
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(4, 3))
    sd = torch.load(str(out), weights_only=True)
    assert sorted(sd) == ["fc.bias", "fc.weight"]  # no run prefix, no accumulators
    model.load_state_dict(sd)  # strict: every parameter, nothing else
    from adamps.checkpoint.save_restore import load

    want = load(d)[1]
    assert model.fc.weight.detach().numpy().tobytes() == want["default..fc.weight"].tobytes()
    # ... and the same file starts a run (--init), as a state_dict of the user's own does
    got = initial_values(str(out), {"fc.weight": (3, 4), "fc.bias": (3,)})
    assert got["fc.bias"].tobytes() == want["default..fc.bias"].tobytes()
    own = tmp_path / "own.pt"
    torch.save(nn.Linear(4, 3).state_dict(), str(own))
    assert initial_values(str(own), {"weight": (3, 4), "bias": (3,)})["bias"].shape == (3,)


def test_export_torch_names_an_ambiguous_run_and_init_a_bad_state_dict(tmp_path: Path) -> None:
    d = _ckpt(tmp_path / "c", runs=("a", "b"))
    out = tmp_path / "m.pt"
    r = _export("--from", str(d), "--format", "torch", "--out", str(out))
    assert r.returncode == 1 and "runs ['a', 'b']: name one with --run" in r.stderr
    assert not out.exists()
    r = _export("--from", str(d), "--format", "torch", "--run", "b", "--out", str(out))
    assert r.returncode == 0, r.stderr
    with pytest.raises(InitError, match=r"m\.pt: layout mismatch: tensor 'fc.bias' is \[3\]"):
        initial_values(str(out), {"fc.bias": (4,)})
    bad = tmp_path / "bad.pt"
    torch.save({"fc.weight": [1, 2, 3]}, str(bad))  # not tensors
    with pytest.raises(InitError, match=r"bad\.pt: not a"):
        initial_values(str(bad), {"fc.weight": (3,)})


def test_export_torch_refuses_a_run_the_checkpoint_lacks(tmp_path: Path) -> None:
    """Skeptic 17: --run naming a run the checkpoint lacks wrote its unprefixed tensors (the
    numpy engine's), exit code 0, as if the run were there."""
    d = tmp_path / "c"
    w = np.ones((3, 4), np.float32)
    write(d, {"conv1.w": w}, {}, {"tensors": [{"name": "conv1.w", "shape": [3, 4]}], "tables": []})
    out = tmp_path / "m.pt"
    r = _export("--from", str(d), "--format", "torch", "--run", "nope", "--out", str(out))
    assert r.returncode == 1 and "no run 'nope' in the checkpoint (runs: [])" in r.stderr, r
    assert not out.exists()
    r = _export("--from", str(d), "--format", "torch", "--out", str(out))
    assert r.returncode == 0 and sorted(torch.load(str(out), weights_only=True)) == ["conv1.w"]
