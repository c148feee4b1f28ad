"""A checkpoint's restore as an update: ``Install`` overwrites a shard's values (and its
optimizer accumulators), ``RowInstall`` replaces a row shard's whole block. They travel in a
replication batch like any push (wire kinds ``"i"`` and ``"j"``, repl_wire.py), so a restore
takes the one write path: validate -> lease -> replicate -> apply, and every replica ends
bit-identical to the checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Install:
    """The values (and accumulator, when the optimizer keeps one) a shard takes, whole."""

    value: np.ndarray
    accum: np.ndarray | None

    def apply(self, w: np.ndarray, acc: np.ndarray | None) -> None:
        np.copyto(w, self.value.reshape(w.shape))
        if acc is not None:
            # A checkpoint of an SGD tensor restored under Adagrad starts the accumulator at 0.
            if self.accum is None:
                acc.fill(0.0)
            else:
                np.copyto(acc, self.accum.reshape(acc.shape))


@dataclass(frozen=True, slots=True)
class RowInstall:
    """A row shard's whole state as ``RowBlock.tobytes`` wrote it."""

    data: bytes
