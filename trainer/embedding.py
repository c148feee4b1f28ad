"""Embedding layers of the numpy engine, backed by a parameter server's table (issue 23): the
equivalent of ``torch.nn.Embedding`` / ``EmbeddingBag(mode="sum" | "mean")`` for a model
written with trainer/layers.py.

``forward`` pulls the rows of the batch's **distinct** ids (one ``pull_rows``), and ``backward``
sums the output gradient of each distinct id (``np.add.at``) and pushes one row gradient per
distinct id (one ``push_rows``), which the servers apply with the table's per-row optimizer.
Only the rows a batch touches move, never the table.

The pure parts (`lookup`, `row_grads`, `pool`) take arrays and return arrays; the layer adds the
client calls. The client is anything with ``pull_rows(table, ids)`` and ``push_rows(table, ids,
grads)`` (adamps.client.ps.PSClient).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def lookup(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct ids, index of each id of `ids` in them), `ids` of any shape (int64)."""
    uniq, inv = np.unique(np.asarray(ids, np.int64).reshape(-1), return_inverse=True)
    return uniq, inv.reshape(np.shape(ids))


def row_grads(inv: np.ndarray, grad: np.ndarray, n_rows: int) -> np.ndarray:
    """The gradient of each distinct row: `grad` [..., dim] (one per looked-up id) summed over
    the ids that map to the row (`inv`, the shape of grad without its last axis)."""
    dim = grad.shape[-1]
    out = np.zeros((n_rows, dim), np.float32)
    np.add.at(out, inv.reshape(-1), grad.reshape(-1, dim))
    return out


def pool(rows: np.ndarray, mode: str) -> np.ndarray:
    """[batch, bag, dim] -> [batch, dim]: a bag's rows summed or averaged."""
    return rows.sum(axis=1) if mode == "sum" else rows.mean(axis=1)


class Embedding:
    """``ids [batch, ...] -> rows [batch, ..., dim]`` from table `table` (dim rows)."""

    def __init__(self, client: Any, table: str, dim: int) -> None:
        self.client = client
        self.table = table
        self.dim = dim
        self._uniq: np.ndarray | None = None
        self._inv: np.ndarray | None = None
        #: bytes sent and received by the layer's pulls and pushes (ids, rows, gradients)
        self.bytes_moved = 0

    def forward(self, ids: np.ndarray) -> np.ndarray:
        uniq, inv = lookup(ids)
        rows = self.client.pull_rows(self.table, uniq)
        self._uniq, self._inv = uniq, inv
        self.bytes_moved += uniq.nbytes + rows.nbytes
        return rows[inv]

    def backward(self, grad: np.ndarray, scale: float = 1.0) -> None:
        """Pushes the row gradients of the last forward's ids (`grad` the shape of its output)."""
        assert self._uniq is not None and self._inv is not None, "backward before forward"
        g = row_grads(self._inv, grad, len(self._uniq))
        if scale != 1.0:
            g *= np.float32(scale)
        if len(self._uniq):  # a batch without ids has no row to push (an empty push is refused)
            self.client.push_rows(self.table, self._uniq, g)
        self.bytes_moved += self._uniq.nbytes + g.nbytes


class EmbeddingBag(Embedding):
    """``ids [batch, bag] -> pooled rows [batch, dim]`` (``mode`` "sum" or "mean")."""

    def __init__(self, client: Any, table: str, dim: int, mode: str = "sum") -> None:
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
        super().__init__(client, table, dim)
        self.mode = mode
        self._bag = 0

    def forward(self, ids: np.ndarray) -> np.ndarray:
        self._bag = np.shape(ids)[1]
        return pool(super().forward(ids), self.mode)

    def backward(self, grad: np.ndarray, scale: float = 1.0) -> None:
        per = grad if self.mode == "sum" else grad / np.float32(self._bag)
        super().backward(np.repeat(per[:, None, :], self._bag, axis=1), scale)
