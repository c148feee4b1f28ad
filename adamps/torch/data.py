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
from adamps.torch.task import Task, as_task, check

#: the built-in data set of `adamps up` (the data servers' --source builtin): MNIST
BUILTIN_SHAPE = (28, 28)
BUILTIN_CLASSES = 10


def images(x: np.ndarray) -> torch.Tensor:
    """uint8 images [b, h, w] or [b, h, w, c] -> float32 [b, c, h, w] in [0, 1]."""
    # converted in numpy: a new, writable array (the data servers' arrays are read-only views of
    # the received bytes, and torch warns about every tensor made from a read-only array)
    t = torch.from_numpy(np.array(x, dtype=np.float32)).div_(255.0)  # always a copy
    if t.dim() == 3:
        return t.unsqueeze(1)
    if t.dim() == 4:
        return t.permute(0, 3, 1, 2).contiguous()
    return t


def clicks(dense: np.ndarray, ids: np.ndarray, y: np.ndarray) -> tuple[Any, torch.Tensor]:
    """A click-log batch (the data servers' ``ctr`` source) as a model sees it:
    ``((dense float32 [b, n_dense], ids int64 [b, fields]), labels float32 [b])`` (writable
    copies; labels as floats for ``BCEWithLogitsLoss``)."""
    x = (
        torch.from_numpy(np.array(dense, dtype=np.float32)),
        torch.from_numpy(np.array(ids, dtype=np.int64)),
    )
    return x, torch.from_numpy(np.array(y, dtype=np.float32))


def dataserver_batches(batches: Any) -> Iterator[tuple[Any, torch.Tensor]]:
    """(inputs, labels) of a data-server epoch iterator (``DataClient.epoch(...)``): images, or
    click logs' rows (see `clicks`)."""
    for b in batches:
        ids = getattr(b, "ids", None)  # any batch with x and y: a click log's has ids too
        if ids is not None:
            yield clicks(b.x, ids, b.y)
        else:
            yield images(b.x), torch.from_numpy(np.array(b.y, dtype=np.int64))  # a writable copy


def _cat(parts: list[Any]) -> Any:
    """Batches' inputs joined: tensors, or tuples of tensors element by element."""
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p) for p in zip(*parts, strict=True))
    return torch.cat(parts)


def heldout(data: Any) -> tuple[Any, torch.Tensor]:
    """The whole held-out split of the data servers (``DataClient``), as one batch."""
    xs, ys = [], []
    for x, y in dataserver_batches(data.epoch(0, 1, 0, batch_size=1000, split="test")):
        xs.append(x)
        ys.append(y)
    return _cat(xs), torch.cat(ys)


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


def build_task(spec: str, seed: int) -> Task:
    """Calls the factory (seeded: every replica builds the same initial weights); a bare model
    becomes ``Task(model)``."""
    fn = load_factory(spec)
    torch.manual_seed(seed)
    try:
        obj = fn()
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's factory: its message, in one line
        line = (str(exc).strip().splitlines() or [""])[0]
        raise ModelError(
            f"--torch {spec!r}: the factory raised {type(exc).__name__}: {line}"
        ) from None
    return as_task(obj, spec)


def build_model(spec: str, seed: int) -> nn.Module:
    """The factory's model (see build_task)."""
    return build_task(spec, seed).model


def builtin_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A minibatch shaped as the data servers' built-in images: [b, 1, 28, 28], 10 classes."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (batch_size, *BUILTIN_SHAPE), dtype=np.uint8)
    y = np.arange(batch_size) % BUILTIN_CLASSES  # every class once when the batch is big enough
    return images(x), torch.from_numpy(y.astype(np.int64))


def preflight(spec: str, seed: int, batch_size: int) -> Task:
    """`adamps up --torch`, before any process starts: the factory imported and called, and one
    batch forward and backward (its own data, else a batch shaped as the built-in images)."""
    task = build_task(spec, seed)
    if task.own_data:
        check(task, spec, seed, batch_size)
    elif task.source.partition(":")[0] == "ctr":  # the click logs' first rows
        from adamps.data.clicks import sample as ctr_sample
        from adamps.data.dataset import SourceError

        try:
            rows = ctr_sample(task.source, batch_size)
        except SourceError as exc:
            raise ModelError(f"--torch {spec}: Task.source {task.source!r}: {exc}") from None
        check(task, spec, seed, batch_size, clicks(*rows))
    else:
        check(task, spec, seed, batch_size, builtin_batch(batch_size), BUILTIN_CLASSES)
    return task
