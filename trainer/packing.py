"""What one Downpour round produces and what a push sends (Adam 3.2.6).

The workers (inside Hogwild worker processes or threads) leave a round's updates in shared
buffers laid out by a ``PackPlan``: the summed delta of every convolution weight and bias, and
the activation and error vectors of every fully connected weight. ``collect_round`` takes them
out as a ``PushItem``; ``push_parts`` decides per tensor what goes on the wire: the k vector
pairs while ``k * (M + N) < M * N`` (the server computes ``e.T @ a``), else the dense delta.
Pure numpy: no threads, sockets or clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from adamps.client.round import use_act_err
from trainer.layers import Dense
from trainer.model import Model

#: send k activation/error vector pairs instead of the M x N delta (Adam 3.2.6)? The one rule of
#: both engines, the round client's
use_vectors = use_act_err


# -- what a round produces, and the coalescing push queue -------------------------------------


@dataclass
class PushItem:
    """Updates of one or more rounds, in the workers' units (scale * gradient)."""

    #: tensor -> summed flat delta: conv weights, biases, and fc weights whose vectors were
    #: folded (too many rows to be worth sending as vectors)
    dense: dict[str, np.ndarray]
    #: fc weight -> list of (a [k,N], e [k,M]) blocks, stacked when sent
    vectors: dict[str, list[tuple[np.ndarray, np.ndarray]]]
    steps: int = 0  #: minibatches it covers

    def merge(self, other: PushItem) -> None:
        """Adds another item's updates (the other item is consumed). Stacks of vectors that
        would no longer be smaller than the matrix are folded into a dense delta at once, so
        a long backlog costs bounded memory."""
        for name, d in other.dense.items():
            if name in self.dense:
                self.dense[name] += d
            else:
                self.dense[name] = d
        for name, blocks in other.vectors.items():
            mine = self.vectors.setdefault(name, [])
            mine.extend(blocks)
            if mine:
                k = sum(b[0].shape[0] for b in mine)
                if not use_vectors(k, mine[0][1].shape[1], mine[0][0].shape[1]):
                    self.fold(name)
        self.steps += other.steps

    def fold(self, name: str) -> None:
        """Replaces the vectors of fc weight ``name`` by their dense delta e.T @ a."""
        a, e = stack(self.vectors.pop(name, []))
        if a is None:
            return
        g = (e.T @ a).reshape(-1)
        if name in self.dense:
            self.dense[name] += g
        else:
            self.dense[name] = g


def stack(blocks: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[Any, Any]:
    """The blocks' activation and error vectors as two matrices ((None, None) if empty)."""
    if not blocks:
        return None, None
    if len(blocks) == 1:
        return blocks[0]
    return np.concatenate([b[0] for b in blocks]), np.concatenate([b[1] for b in blocks])


def add_outer(w: np.ndarray, a: np.ndarray, e: np.ndarray) -> None:
    """W (M x N, C order) += e.T @ a in place with one sgemm (beta = 1): no M x N temporary.

    The C-ordered W is the F-ordered N x M matrix W.T, so BLAS computes W.T += a.T @ e straight
    into W's memory (the server's ``sgd_fc`` with lr = -1). Not imported from adamps.server:
    that module loads the server's numba kernels, about a CPU second in every trainer and in
    every spawned Hogwild worker (which import this module for their factory), and none of
    them runs a server kernel (issue 27). scipy's BLAS is imported here, on first use, for the
    same reason: only the replica's main thread installs fetches; the workers never do.
    """
    from adamps import blas

    a = np.ascontiguousarray(a, np.float32)
    e = np.ascontiguousarray(e, np.float32)
    blas.outer_acc(w, a, e, 1.0)


def add_pending(
    params: np.ndarray,
    items: Sequence[PushItem],
    slices: Mapping[str, slice],
    shapes: Mapping[str, tuple[int, ...]],
) -> None:
    """Adds the updates of queued items to the flat parameters in place. The activation and
    error vectors of one fc weight, over every item, are stacked into one in-place sgemm
    (W += e.T @ a with beta = 1): no M x N temporary per item, one pass over W instead of one
    per item (the py-spy profile of issue 16 found the replica's main thread re-expanding each
    queued item). Equal to adding the items one by one up to float rounding."""
    blocks: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for item in items:
        for name, d in item.dense.items():
            params[slices[name]] += d
        for name, bl in item.vectors.items():
            blocks.setdefault(name, []).extend(bl)
    for name, bl in blocks.items():
        a, e = stack(bl)
        if a is not None:
            add_outer(params[slices[name]].reshape(shapes[name]), a, e)


# -- the workers (run inside Hogwild worker processes or threads) ----------------------------


@dataclass(frozen=True)
class PackPlan:
    """Where each worker leaves its updates in the shared buffers."""

    #: (tensor, slice of the flat parameters, offset in the accumulator)
    dense: tuple[tuple[str, slice, int], ...]
    n_dense: int
    #: (fc weight, M, N, offset of its a block, offset of its e block) in the vector buffer
    fc: tuple[tuple[str, int, int, int, int], ...]
    max_rows: int
    n_vec: int

    @classmethod
    def of(cls, model: Model, max_rows: int) -> PackPlan:
        fc_names = {f"{layer.name}.w" for layer in model.layers if isinstance(layer, Dense)}
        slices = model.slices()
        dense, off = [], 0
        fc, voff = [], 0
        for name, shape in model.tensors():
            if name in fc_names:
                m, n = shape
                fc.append((name, m, n, voff, voff + max_rows * n))
                voff += max_rows * (m + n)
            else:
                dense.append((name, slices[name], off))
                off += int(np.prod(shape))
        return cls(tuple(dense), off, tuple(fc), max_rows, voff)

    def buffers(self, n_workers: int) -> dict[str, int]:
        out = {}
        for w in range(n_workers):
            out[f"acc{w}"] = self.n_dense
            out[f"vec{w}"] = self.n_vec
        return out


class DownpourWorker:
    """A worker's step function: SGD on the shared local weights (no locks) for the minibatches
    of one round, leaving the accumulated conv/bias deltas and the fc vectors in its buffers."""

    def __init__(
        self,
        spec: dict[str, Any],
        local_lr: float,
        plan: PackPlan,
        worker_id: int,
        params: np.ndarray,
        buffers: dict[str, np.ndarray],
    ) -> None:
        self.model = Model(spec, params=params)
        self.scale = -local_lr
        self.plan = plan
        self.acc = buffers[f"acc{worker_id}"]
        vec = buffers[f"vec{worker_id}"]
        self.vec = {
            name: (
                vec[ao : ao + plan.max_rows * n].reshape(plan.max_rows, n),
                vec[eo : eo + plan.max_rows * m].reshape(plan.max_rows, m),
            )
            for name, m, n, ao, eo in plan.fc
        }
        self.dense = [
            (self.model.grads[sl], self.acc[off : off + (sl.stop - sl.start)])
            for _name, sl, off in plan.dense
        ]

    def __call__(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, int, int]:
        """Train on the batches; return (sum of batch losses, batches, rows of vectors)."""
        model = self.model
        total = 0.0
        rows = 0
        for x, y in batches:
            total += model.loss_and_grad(model.prepare(x), y, scale=self.scale)
            model.params += model.grads  # the local step (scale already holds -lr)
            for g, acc in self.dense:
                acc += g
            k = len(y)
            for name, (a, e) in model.fc_vectors().items():
                abuf, ebuf = self.vec[name]
                abuf[rows : rows + k] = a
                ebuf[rows : rows + k] = e
            rows += k
        return total, len(batches), rows


def downpour_worker_factory(
    spec: dict[str, Any],
    local_lr: float,
    plan: PackPlan,
    worker_id: int,
    params: np.ndarray,
    buffers: dict[str, np.ndarray],
) -> DownpourWorker:
    """Hogwild factory (module level, so picklable through functools.partial)."""
    return DownpourWorker(spec, local_lr, plan, worker_id, params, buffers)


def collect_round(
    buffers: Mapping[str, np.ndarray], plan: PackPlan, outs: Sequence[tuple[float, int, int]]
) -> PushItem:
    """Takes a round's updates out of the workers' buffers (while the workers are idle) and
    clears the accumulators. ``outs`` are the workers' (loss, batches, rows) replies."""
    dense: dict[str, np.ndarray] = {}
    vectors: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for w, (_loss, n_batches, rows) in enumerate(outs):
        if n_batches == 0:
            continue
        acc = buffers[f"acc{w}"]
        for name, sl, off in plan.dense:
            part = acc[off : off + (sl.stop - sl.start)]
            if name in dense:
                dense[name] += part
            else:
                dense[name] = part.copy()
        acc[...] = 0.0
        vec = buffers[f"vec{w}"]
        for name, m, n, ao, eo in plan.fc:
            a = vec[ao : ao + rows * n].reshape(rows, n).copy()
            e = vec[eo : eo + rows * m].reshape(rows, m).copy()
            vectors.setdefault(name, []).append((a, e))
    return PushItem(dense, vectors, sum(o[1] for o in outs))


def push_parts(
    item: PushItem, inv: float, shapes: Mapping[str, tuple[int, ...]]
) -> list[tuple[Any, ...]]:
    """What the push thread sends for one item: ("fc", tensor, a, e) or ("dense", tensor,
    gradient), gradients rescaled from the workers' units by ``inv`` (= -1 / local_lr). A fully
    connected weight goes as vectors while k * (M + N) < M * N, else as e.T @ a."""
    parts: list[tuple[Any, ...]] = []
    dense = dict(item.dense)
    for name, blocks in item.vectors.items():
        a, e = stack(blocks)
        if a is None:
            continue
        m, n = shapes[name]
        if name not in dense and use_vectors(a.shape[0], m, n):
            parts.append(("fc", name, a, e * inv))
        else:
            g = (e.T @ a).reshape(-1)
            dense[name] = dense[name] + g if name in dense else g
    for name, d in dense.items():
        parts.append(("dense", name, (d * inv).reshape(shapes[name])))
    return parts
