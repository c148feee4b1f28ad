"""What ``--torch PKG.MODULE:FACTORY`` names: a model, or a :class:`Task` (a model, its loss, its
own datasets and its held-out metric), and the one-batch check run before any process starts.

    def ctr_task() -> adamps.torch.Task:
        return Task(model=CtrNet(), loss=nn.BCEWithLogitsLoss(), train=TensorDataset(x, y),
                    test=TensorDataset(xt, yt), metric=auc)

A factory returning a bare ``nn.Module`` keeps the plain meaning: images from the data servers,
cross-entropy, accuracy. A Task with ``train`` replaces the data servers for that run: each
replica trains its share of a per-epoch shuffle of ``train`` (``--replica`` of
``--n-replicas``), and replica 0 scores ``test`` (required then) with ``metric``.

:func:`check_task` runs one batch forward and backward in this process, on a copy of nothing the
servers hold (a model's server tables answer from a local stand-in), so a model whose output
does not fit the labels is a one-line :class:`ModelError` naming the shapes, before any cluster
process starts (``adamps up``) or any tensor is created (``adamps train``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from adamps.torch.embedding import row_tables
from adamps.torch.params import ModelError


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The default metric: the share of rows whose argmax is the label."""
    return float((outputs.argmax(1) == targets).float().mean()) if len(targets) else 0.0


@dataclass
class Task:
    """What a ``--torch`` factory may return instead of a bare model.

    - ``model``: the ``nn.Module`` trained (its parameters on the servers);
    - ``loss``: ``loss(outputs, targets) -> scalar tensor`` (default: cross-entropy);
    - ``train`` / ``test``: ``torch.utils.data.Dataset`` s of ``(inputs, target)`` items; with
      ``train`` the run reads no data server (``test`` is then required); without, images come
      from the data servers;
    - ``metric``: ``metric(outputs, targets) -> float`` over the whole held-out set, higher is
      better (default: accuracy); it is what the views, the history and ``--target-accuracy``
      read as the held-out accuracy;
    - ``source``: without ``train``, the data servers' source ``adamps up`` starts them with:
      ``"builtin"`` (MNIST images), ``"ctr"`` (click logs of the planted-truth generator) or
      ``"ctr:FILE"`` (a Criteo-format TSV); a click-log batch reaches the model as
      ``(dense, ids)`` with float labels (adamps.torch.data.clicks);
    - ``source_args``: further ``adamps dataserver`` flags for that source, e.g.
      ``("--ctr-examples", "20000")``.
    """

    model: nn.Module
    loss: Callable[[Any, Any], torch.Tensor] | None = None
    train: Dataset[Any] | None = None
    test: Dataset[Any] | None = None
    metric: Callable[[torch.Tensor, torch.Tensor], float] | None = None
    source: str = "builtin"
    source_args: tuple[str, ...] = ()

    @property
    def loss_fn(self) -> Callable[[Any, Any], torch.Tensor]:
        return self.loss if self.loss is not None else nn.functional.cross_entropy

    @property
    def metric_fn(self) -> Callable[[torch.Tensor, torch.Tensor], float]:
        return self.metric if self.metric is not None else accuracy

    @property
    def own_data(self) -> bool:
        """True when the run reads the task's datasets, not the data servers."""
        return self.train is not None


def as_task(obj: Any, spec: str) -> Task:
    """The factory's result as a Task (ModelError naming what is wrong)."""
    if isinstance(obj, nn.Module):
        obj = Task(model=obj)
    if not isinstance(obj, Task):
        raise ModelError(
            f"--torch {spec!r}: the factory returned a {type(obj).__name__}, "
            "expected a torch.nn.Module or an adamps.torch.Task"
        )
    if not isinstance(obj.model, nn.Module):
        raise ModelError(
            f"--torch {spec!r}: Task.model is a {type(obj.model).__name__}, "
            "expected a torch.nn.Module"
        )
    for name in ("train", "test"):
        ds = getattr(obj, name)
        if ds is not None and not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise ModelError(
                f"--torch {spec!r}: Task.{name} is a {type(ds).__name__}, expected a "
                "torch.utils.data.Dataset with __len__ (a map-style data set)"
            )
    if obj.train is not None and (obj.test is None or len(obj.test) == 0):
        raise ModelError(f"--torch {spec!r}: a Task with train data needs a non-empty test set")
    kind, _, arg = str(obj.source).partition(":")
    if obj.source not in ("builtin", "ctr") and not (kind == "ctr" and arg):
        raise ModelError(
            f"--torch {spec!r}: Task.source is {obj.source!r}, expected 'builtin', 'ctr' or "
            "'ctr:FILE'"
        )
    if obj.train is not None and len(obj.train) == 0:
        raise ModelError(f"--torch {spec!r}: Task.train is empty")
    return obj


# -- batches of a Task's datasets --------------------------------------------------------------


def _collate(ds: Dataset[Any], idx: np.ndarray) -> tuple[Any, ...]:
    if isinstance(ds, TensorDataset):  # a slice per tensor: no per-item Python loop
        t = torch.from_numpy(idx)
        return tuple(x[t] for x in ds.tensors)
    from torch.utils.data import default_collate

    return tuple(default_collate([ds[int(i)] for i in idx]))


def dataset_batches(
    ds: Dataset[Any], replica: int, n_replicas: int, epoch: int, batch_size: int, seed: int = 0
) -> Iterator[tuple[Any, ...]]:
    """Replica `replica`'s share of epoch `epoch`: every n-th index of one shuffle of the data
    set that every replica draws alike (seeded by `seed` and the epoch), in minibatches."""
    n = len(ds)  # type: ignore[arg-type]
    order = np.random.default_rng([seed, epoch]).permutation(n)[replica::n_replicas]
    for s in range(0, len(order), batch_size):
        yield _collate(ds, order[s : s + batch_size])


def test_batches(ds: Dataset[Any], batch_size: int = 1000) -> Iterator[tuple[Any, ...]]:
    """The whole held-out data set in order."""
    n = len(ds)  # type: ignore[arg-type]
    for s in range(0, n, batch_size):
        yield _collate(ds, np.arange(s, min(n, s + batch_size)))


@torch.no_grad()
def score(model: nn.Module, batches: Any, metric: Callable[[Any, Any], float]) -> float:
    """`metric` over every batch's outputs at once, in eval mode."""
    was = model.training
    model.eval()
    outs, ys = [], []
    for x, y, *_ in batches:
        outs.append(model(x))
        ys.append(y)
    model.train(was)
    return float(metric(torch.cat(outs), torch.cat(ys)))


# -- the one-batch check -----------------------------------------------------------------------


class _LocalRows:
    """A stand-in for the servers' tables during the check: random rows, pushes dropped."""

    def __init__(self) -> None:
        self.tables: dict[str, int] = {}

    def create_table(self, name: str, dim: int, **_: Any) -> None:
        self.tables[name] = dim

    def pull_rows(self, table: str, ids: np.ndarray) -> np.ndarray:
        return (
            np.random.default_rng(0)
            .normal(0, 0.05, (len(ids), self.tables[table]))
            .astype(np.float32)
        )

    def push_rows(self, *_: Any, **__: Any) -> None:
        pass

    def round(self, *_: Any, fetch_rows: Any = None, **__: Any) -> dict[str, np.ndarray]:
        """An EmbeddingBagCollection's fetch (its pushes dropped)."""
        return {t: self.pull_rows(t, ids) for t, ids in (fetch_rows or {}).items()}


def _shape(t: Any) -> str:
    return str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def check_task(
    task: Task, spec: str, sample: tuple[Any, Any], n_classes: int | None, test: Any = None
) -> None:
    """One batch forward and backward (no server involved), and the metric on one held-out
    batch `test` if given; ModelError in one line naming the shapes when the model, its inputs,
    the loss, the labels or the metric do not fit."""
    model, (x, y) = task.model, sample
    tables = row_tables(model)
    if tables:
        local = _LocalRows()
        for m in tables:
            m.bind(local, None, True, False)
    was = model.training
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}  # BatchNorm's statistics
    model.train()
    try:
        out = model(x)
    except Exception as exc:  # noqa: BLE001 - the user's model: its message, in one line
        raise ModelError(
            f"--torch {spec}: the model's forward failed on inputs {_shape(x)}: {_first_line(exc)}"
        ) from None
    if task.loss is None and isinstance(out, torch.Tensor) and isinstance(y, torch.Tensor):
        classes = n_classes if n_classes is not None else int(y.max()) + 1 if y.numel() else 0
        fits = out.dim() == 2 and out.shape[0] == y.shape[0] and out.shape[1] >= classes
        if y.dim() != 1 or not fits:
            raise ModelError(
                f"--torch {spec}: model output {_shape(out)} does not fit the labels {_shape(y)} "
                f"of {classes} classes (cross-entropy wants [batch, classes] logits)"
            )
    try:
        loss = task.loss_fn(out, y)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"the loss is {_shape(loss)}, expected a scalar tensor")
        loss.backward()
    except Exception as exc:  # noqa: BLE001
        raise ModelError(
            f"--torch {spec}: model output {_shape(out)} does not fit the labels {_shape(y)}: "
            f"{_first_line(exc)}"
        ) from None
    finally:
        model.zero_grad(set_to_none=True)
    try:
        if test is not None:
            tx, ty = test
            with torch.no_grad():
                model.eval()
                task.metric_fn(model(tx), ty)
    except Exception as exc:  # noqa: BLE001
        raise ModelError(
            f"--torch {spec}: the metric failed on a held-out batch {_shape(tx)}: "
            f"{_first_line(exc)}"
        ) from None
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was)
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
        for m in tables:  # unbound again: the optimizer binds the servers' tables
            m._binding.client = m._binding.table = None
            m.take_grads()


def check(
    task: Task,
    spec: str,
    seed: int,
    batch_size: int,
    sample: tuple[Any, Any] | None = None,
    n_classes: int | None = None,
) -> None:
    """The one-batch check of a built task: on the task's own first training batch, else on
    `sample` (a batch of the data servers' images, or one shaped as the built-in ones)."""
    if task.own_data:
        assert task.train is not None and task.test is not None
        first = next(dataset_batches(task.train, 0, 1, 1, batch_size, seed))
        held = next(test_batches(task.test, batch_size))
        check_task(task, spec, (first[0], first[1]), None, (held[0], held[1]))
    else:
        assert sample is not None, "a model without its own data is checked on a sample batch"
        check_task(task, spec, sample, n_classes)
