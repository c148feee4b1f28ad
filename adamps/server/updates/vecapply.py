"""How a vector operation changes one shard (pure numpy, run on the shard's owner thread):
the update kind of adamps/server/api/vecops.py, kept apart so that the store can apply it without
importing the ops' request handling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from adamps.server.updates import optim
from adamps.server.updates.install import Install

#: write kinds -> (takes a source vector x, takes a scalar alpha)
KINDS: dict[str, tuple[bool, bool]] = {
    "copy": (True, False),  # y = x
    "scale": (False, True),  # y = alpha * y
    "axpy": (True, True),  # y = y + alpha * x
    "mul": (True, False),  # y = y * x, elementwise
    "set": (False, False),  # y[offset : offset + len(values)] = values (small state records)
}


@dataclass(frozen=True, slots=True)
class VecOp:
    """One vector operation on one destination shard; ``src`` is the source vector's shard on
    the same owner thread (None for scale)."""

    kind: str
    alpha: float
    src: Any  # a ShardState (below the store in the layers: not imported here)
    #: set: the values and where they go in the shard (flat index)
    values: np.ndarray | None = None
    offset: int = 0

    def apply(self, w: np.ndarray) -> None:
        x = None if self.src is None else self.src.value
        if self.kind == "copy":
            np.copyto(w, x)
        elif self.kind == "scale":
            w *= np.float32(self.alpha)
        elif self.kind == "axpy":
            w += np.float32(self.alpha) * x
        elif self.kind == "mul":
            w *= x
        elif self.kind == "set":
            assert self.values is not None
            w.reshape(-1)[self.offset : self.offset + self.values.size] = self.values
        else:  # checked when the request was validated
            raise ValueError(f"unknown vector op {self.kind!r}")


def apply_batch(
    opt: optim.Optimizer,
    w: np.ndarray,
    acc: np.ndarray | None,
    updates: Sequence[Any],
    scratch: optim.Scratch,
) -> optim.Optimizer:
    """``optim.apply_batch`` that also takes VecOps and Installs (install.py), applied in their
    place in the order; returns the optimizer of the last push applied (`opt` if none named one)."""
    if not any(isinstance(u, VecOp | Install) for u in updates):
        return optim.apply_batch(opt, w, acc, updates, scratch)
    run: list[Any] = []
    last = opt
    for u in updates:
        if isinstance(u, VecOp | Install):
            if run:
                last = optim.apply_batch(opt, w, acc, run, scratch)
                run = []
            if isinstance(u, Install):  # a checkpoint's restore: values and optimizer state
                u.apply(w, acc, opt)
            else:
                u.apply(w)
        else:
            run.append(u)
    if run:
        last = optim.apply_batch(opt, w, acc, run, scratch)
    return last
