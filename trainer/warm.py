"""`adamps train --init`: a run's initial weights from a checkpoint directory (adamps
checkpoint save, every file verified against its manifest; with the Adagrad accumulators it
holds), a ``model.npz`` (trainer/export.py or ``adamps export``) or a PyTorch ``state_dict``
file (``adamps export --format torch``, ``torch.save(model.state_dict())``), checked against the model's tensors before anything is created: a
mismatch names the file, the tensor and both shapes."""

from __future__ import annotations

import importlib
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from adamps.checkpoint.save_restore import CheckpointError, load
from adamps.layout import ungrouped


class InitError(ValueError):
    """An --init source that cannot start this model; the message names the file."""


def initial_values(path: str, want: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """{tensor: float32 values} for every tensor of `want` (name -> shape) from `path`."""
    return initial_state(path, want)[0]


def initial_state(
    path: str, want: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """({tensor: values}, {tensor: Adagrad accumulator}) for the tensors of `want` from `path`:
    the accumulators of those a checkpoint directory has them for (none from a file)."""
    p = Path(path)
    if p.is_dir():
        try:
            _manifest, arrays, _rows = load(p)
        except CheckpointError as exc:
            raise InitError(str(exc)) from None
        where = p
    elif p.is_file() and _is_state_dict(p):
        # Imported only for a state_dict file: torch is an optional extra (adamps[torch]).
        try:
            sd = importlib.import_module("adamps.torch.state_dict")
        except ImportError as exc:
            raise InitError(
                f"{p}: a PyTorch state_dict needs torch (adamps[torch]): {exc}"
            ) from None
        try:
            arrays = sd.load_state_dict(p)
        except ValueError as exc:
            raise InitError(f"{p}: {exc}") from None
        where = p
    elif p.is_file():
        try:
            with np.load(p, allow_pickle=False) as f:
                arrays = {k: f[k] for k in f.files if not k.startswith("__") and k != "model"}
        except (OSError, ValueError) as exc:
            raise InitError(f"{p}: not a readable .npz: {exc}") from None
        where = p
    else:
        raise InitError(f"{p}: no such checkpoint directory, .npz or state_dict file")
    out: dict[str, np.ndarray] = {}
    accums: dict[str, np.ndarray] = {}
    for name, shape in want.items():
        a = arrays.get(name)
        if a is None:
            a = _same_param(arrays, name, where)
        if a is None:
            raise InitError(f"{where}: layout mismatch: no tensor {name!r} (the model needs it)")
        if tuple(a.shape) != tuple(shape):
            raise InitError(
                f"{where}: layout mismatch: tensor {name!r} is {list(a.shape)}, "
                f"the model's is {list(shape)}"
            )
        out[name] = np.ascontiguousarray(a, np.float32)
        key = name if name in arrays else _same_key(arrays, name, where)
        acc = arrays.get(f"{key}/accum") if p.is_dir() else None
        if acc is not None:
            accums[name] = np.ascontiguousarray(acc, np.float32)
    return out, accums


def _bare(name: str) -> str:
    """`name` without a run's namespace ("exp1..fc1.w" -> "fc1.w"; issue 25) or a placement
    group's tag ("exp1..{0}fc1.w" -> "fc1.w"; adamps/layout.py)."""
    name = ungrouped(name)
    return name.split("..", 1)[1] if ".." in name else name


def _same_key(arrays: Mapping[str, np.ndarray], name: str, where: Path) -> str | None:
    """The one key saved for the same parameter under another run's namespace (or none): a
    model trained as run A warm-starts run B. Several candidates are refused, named."""
    found = [k for k in arrays if not k.endswith("/accum") and _bare(k) == _bare(name)]
    if len(found) > 1:
        raise InitError(
            f"{where}: tensor {name!r} is not there, and several runs' tensors could stand for "
            f"it: {sorted(found)}; export the one run's tensors alone"
        )
    return found[0] if found else None


def _same_param(arrays: Mapping[str, np.ndarray], name: str, where: Path) -> np.ndarray | None:
    """The array of `_same_key` (or none)."""
    key = _same_key(arrays, name, where)
    return arrays[key] if key is not None else None


def _is_state_dict(p: Path) -> bool:
    """torch.save's zip format (``<archive>/data.pkl``), not numpy's .npz (``*.npy``)."""
    try:
        with zipfile.ZipFile(p) as z:
            return any(n.endswith("/data.pkl") or n == "data.pkl" for n in z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False
