"""Minibatches for torch models: from the data servers (dataserver/client.py) as tensors, and
the user's model factory named on the command line (``PKG.MODULE:FACTORY``)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from adamps.torch.params import ModelError


def images(x: np.ndarray) -> torch.Tensor:
    """uint8 images [b, h, w] or [b, h, w, c] -> float32 [b, c, h, w] in [0, 1]."""
    t = torch.from_numpy(np.ascontiguousarray(x)).to(torch.float32).div_(255.0)
    if t.dim() == 3:
        return t.unsqueeze(1)
    if t.dim() == 4:
        return t.permute(0, 3, 1, 2).contiguous()
    return t


def dataserver_batches(batches: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) of a data-server epoch iterator (``DataClient.epoch(...)``)."""
    for b in batches:
        yield images(b.x), torch.from_numpy(np.asarray(b.y, dtype=np.int64))


def heldout(data: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole held-out split of the data servers (``DataClient``), as two tensors."""
    xs, ys = [], []
    for x, y in dataserver_batches(data.epoch(0, 1, 0, batch_size=1000, split="test")):
        xs.append(x)
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def load_factory(spec: str) -> Any:
    """The callable named ``PKG.MODULE:FACTORY`` (ModelError naming what is wrong)."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ModelError(
            f"--torch {spec!r}: expected PKG.MODULE:FACTORY, e.g. examples.torch_mnist:Net"
        )
    if os.getcwd() not in sys.path:  # as `python -m` would: modules next to the user's shell
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ModelError(f"--torch {spec!r}: cannot import module {mod_name!r}: {exc}") from None
    fn = getattr(mod, attr, None)
    if fn is None or not callable(fn):
        raise ModelError(f"--torch {spec!r}: module {mod_name!r} has no callable {attr!r}")
    return fn


def build_model(spec: str, seed: int) -> nn.Module:
    """Calls the factory (seeded: every replica builds the same initial weights)."""
    fn = load_factory(spec)
    torch.manual_seed(seed)
    model = fn()
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"--torch {spec!r}: the factory returned a {type(model).__name__}, "
            "expected a torch.nn.Module"
        )
    return model
