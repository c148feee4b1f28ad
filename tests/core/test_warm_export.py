"""`adamps export` and `adamps train --init` (issue 24): a checkpoint's values out as npz or
safetensors, and in as a run's initial weights; a source that does not fit the model is a
message naming the file and the tensor, and nothing starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from adamps.checkpoint.export import export
from adamps.checkpoint.save_restore import write
from trainer.warm import InitError, initial_values

SHAPES = {"a": (2, 3), "b": (4,)}


def _ckpt(d: Path) -> Path:
    arrays = {n: np.arange(np.prod(s), dtype=np.float32).reshape(s) + i
              for i, (n, s) in enumerate(SHAPES.items())}  # fmt: skip
    arrays["a/accum"] = np.ones((2, 3), np.float32)
    write(d, arrays, {}, {"tensors": [{"name": n, "shape": list(s)} for n, s in SHAPES.items()],
                          "tables": []})  # fmt: skip
    return d


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
def test_export_then_init_round_trips_the_values(tmp_path: Path, fmt: str) -> None:
    d = _ckpt(tmp_path / "c")
    out = tmp_path / f"m.{fmt}"
    assert export(d, out, fmt) == ["a", "b"]
    got = dict(np.load(out)) if fmt == "npz" else load_file(str(out))
    assert sorted(got) == ["a", "b"]  # values only: accumulators stay in the checkpoint
    from_dir = initial_values(str(d), SHAPES)
    for n in SHAPES:
        assert got[n].tobytes() == from_dir[n].tobytes()
    if fmt == "npz":
        again = initial_values(str(out), SHAPES)
        assert all(again[n].tobytes() == got[n].tobytes() for n in SHAPES)


def test_init_that_does_not_fit_the_model_names_file_and_tensor(tmp_path: Path) -> None:
    d = _ckpt(tmp_path / "c")
    with pytest.raises(InitError, match=r"c: layout mismatch: tensor 'b' is \[4\]"):
        initial_values(str(d), {"a": (2, 3), "b": (5,)})
    with pytest.raises(InitError, match="no tensor 'z'"):
        initial_values(str(d), {"z": (1,)})
    with pytest.raises(InitError, match="no such checkpoint"):
        initial_values(str(tmp_path / "nothing"), SHAPES)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(InitError, match=r"bad\.npz: not a readable \.npz"):
        initial_values(str(tmp_path / "bad.npz"), SHAPES)


def test_a_model_of_one_run_warm_starts_another(tmp_path: Path) -> None:
    """Issue 25: `adamps train --run B --init` of run A's export (tensors "A..fc1.w") finds the
    same parameters under B's namespace; two runs' tensors that could stand for one are refused."""
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.savez(tmp_path / "a.npz", **{"exp1..fc1.w": w, "exp1..fc1.b": w[0]})
    got = initial_values(str(tmp_path / "a.npz"), {"exp2..fc1.w": (2, 3), "fc1.b": (3,)})
    assert got["exp2..fc1.w"].tobytes() == w.tobytes() and got["fc1.b"].tobytes() == w[0].tobytes()
    np.savez(tmp_path / "two.npz", **{"exp1..fc1.w": w, "exp3..fc1.w": w})
    with pytest.raises(InitError, match=r"several runs' tensors .*exp1\.\.fc1\.w"):
        initial_values(str(tmp_path / "two.npz"), {"exp2..fc1.w": (2, 3)})


def test_adamps_train_init_refuses_a_mismatched_model_before_starting(tmp_path: Path) -> None:
    np.savez(tmp_path / "m.npz", **{"conv1.w": np.zeros(3, np.float32)})
    r = subprocess.run(
        [sys.executable, "-m", "adamps", "train", "--init", str(tmp_path / "m.npz"),
         "--ps", "http://127.0.0.1:9", "--token", "t" * 32],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    assert (
        "m.npz: layout mismatch: tensor 'conv1.w' is [3], the model's is [10, 5, 5, 1]" in r.stderr
    )


def test_adamps_export_names_a_bad_format_and_a_bad_checkpoint(tmp_path: Path) -> None:
    d = _ckpt(tmp_path / "c")
    base = [
        sys.executable,
        "-m",
        "adamps",
        "export",
        "--from",
        str(d),
        "--out",
        str(tmp_path / "o"),
    ]
    r = subprocess.run([*base, "--format", "pt"], capture_output=True, text=True, timeout=60)
    assert (
        r.returncode == 2 and "--format 'pt': expected one of npz, safetensors, torch" in r.stderr
    )
    (d / "manifest.json").unlink()
    r = subprocess.run([*base, "--format", "npz"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no manifest" in r.stderr and not (tmp_path / "o").exists()
