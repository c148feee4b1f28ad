"""Trained weights as one ``.npz`` file with the model description inside.

The file holds one array per parameter tensor (its name, e.g. ``conv1.w``) and ``__model__``: the
model description as a JSON string, and ``__meta__``: JSON facts about the run (epochs, held-out
accuracy, ...). ``load`` rebuilds a ready-to-use ``trainer.model.Model``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from trainer.model import Model, resolve_spec

MODEL_KEY = "__model__"
META_KEY = "__meta__"


def save(
    path: str | os.PathLike[str],
    spec: str | dict[str, Any],
    tensors: Mapping[str, np.ndarray],
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Writes the tensors and the description; written to a temporary name, then renamed, so a
    reader never sees half a file."""
    spec = resolve_spec(spec)
    expected = dict(Model(spec, params=np.empty(0, np.float32), _layout_only=True).tensors())
    if set(tensors) != set(expected):
        raise ValueError(f"tensors {sorted(tensors)} do not match the model's {sorted(expected)}")
    arrays: dict[str, Any] = {}
    for name, shape in expected.items():
        arr = np.asarray(tensors[name], np.float32)
        if arr.shape != shape:
            raise ValueError(f"tensor {name}: shape {arr.shape}, the model's is {shape}")
        arrays[name] = arr
    arrays[MODEL_KEY] = np.array(json.dumps(spec))
    arrays[META_KEY] = np.array(json.dumps(dict(meta or {})))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return path


def load(path: str | os.PathLike[str]) -> tuple[Model, dict[str, Any]]:
    """The model with its weights loaded, and the run's meta data."""
    with np.load(path, allow_pickle=False) as f:
        spec = json.loads(str(f[MODEL_KEY]))
        meta = json.loads(str(f[META_KEY])) if META_KEY in f else {}
        model = Model(spec)
        for name, _shape in model.tensors():
            model.param(name)[...] = f[name]
    return model, meta
