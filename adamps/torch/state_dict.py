"""A model's values as a PyTorch ``state_dict`` file (issue 24): what ``adamps export --format
torch`` writes and what ``adamps train --init`` (and ``model.load_state_dict``) reads.

Server tensors of a PyTorch run are named ``<run>..<parameter>`` (params.py); the state_dict
holds them under the parameter's own name, the run prefix removed, so that
``model.load_state_dict(torch.load(path))`` fits the user's module. Tensors of other runs are
left out; names without a run prefix (the numpy engine's ``conv1.w``) are kept as they are.
The file is written with ``torch.save`` and read with ``torch.load(weights_only=True)``: no
code from the file runs."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from adamps.torch.params import SEP, split_name


def state_dict_of(values: Mapping[str, np.ndarray], run: str | None) -> dict[str, torch.Tensor]:
    """{parameter name: float32 tensor} of `values` (server tensor name -> array) for `run`
    (None: the only run the names carry, or names without one)."""
    runs = sorted({split_name(n)[0] for n in values if SEP in n})
    if run is None and len(runs) > 1:
        raise ValueError(f"the checkpoint holds the runs {runs}: name one with --run")
    if run is not None and run not in runs:
        # the unprefixed names alone were written (or "no tensor of run"), as if --run matched
        raise ValueError(f"no run {run!r} in the checkpoint (runs: {runs})")
    run = run if run is not None else (runs[0] if runs else None)
    out: dict[str, torch.Tensor] = {}
    for name, a in values.items():
        if SEP in name:
            r, param = split_name(name)
            if r != run:
                continue
        else:
            param = name
        out[param] = torch.from_numpy(np.ascontiguousarray(a, np.float32).copy())
    if not out:
        raise ValueError(f"no tensor of run {run!r} in the checkpoint (runs: {runs})")
    return out


def save_state_dict(values: Mapping[str, np.ndarray], out: Path, run: str | None) -> list[str]:
    sd = state_dict_of(values, run)
    torch.save(sd, str(out))
    return sorted(sd)


def load_state_dict(path: Path) -> dict[str, np.ndarray]:
    """{name: float32 array} of a state_dict file (run prefixes removed); ValueError if it is
    not one (tensors under string keys)."""
    try:
        sd = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip or torch errors: a file that is not a state_dict
        raise ValueError(f"not a readable PyTorch state_dict: {exc}") from None
    if not isinstance(sd, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()
    ):
        raise ValueError("not a state_dict (a mapping of names to tensors)")
    return {
        (split_name(k)[1] if SEP in k else k): v.detach().to(torch.float32).numpy()
        for k, v in sd.items()
    }
