"""`adamps train --init`: a run's initial weights from a checkpoint directory (adamps
checkpoint save, every file verified against its manifest) or a ``model.npz`` (trainer/export.py
or ``adamps export``), checked against the model's tensors before anything is created: a
mismatch names the file, the tensor and both shapes."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from adamps.checkpoint import CheckpointError, load


class InitError(ValueError):
    """An --init source that cannot start this model; the message names the file."""


def initial_values(path: str, want: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """{tensor: float32 values} for every tensor of `want` (name -> shape) from `path`."""
    p = Path(path)
    if p.is_dir():
        try:
            _manifest, arrays, _rows = load(p)
        except CheckpointError as exc:
            raise InitError(str(exc)) from None
        where = p
    elif p.is_file():
        try:
            with np.load(p, allow_pickle=False) as f:
                arrays = {k: f[k] for k in f.files if not k.startswith("__") and k != "model"}
        except (OSError, ValueError) as exc:
            raise InitError(f"{p}: not a readable .npz: {exc}") from None
        where = p
    else:
        raise InitError(f"{p}: no such checkpoint directory or .npz file")
    out: dict[str, np.ndarray] = {}
    for name, shape in want.items():
        a = arrays.get(name)
        if a is None:
            raise InitError(f"{where}: layout mismatch: no tensor {name!r} (the model needs it)")
        if tuple(a.shape) != tuple(shape):
            raise InitError(
                f"{where}: layout mismatch: tensor {name!r} is {list(a.shape)}, "
                f"the model's is {list(shape)}"
            )
        out[name] = np.ascontiguousarray(a, np.float32)
    return out
