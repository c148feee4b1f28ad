"""Server-side optimizers applied in place to one shard: plain SGD and Adagrad (DistBelief 4.1).

Pure numpy/BLAS, no threads and no IO: the store's owner thread calls :func:`apply_batch` with the
shard's arrays and the ordered list of updates queued for it. The result is a deterministic
function of (values, accumulators, ordered updates), so replicas that apply the same batches end
bit-identical.

Conventions (docs/protocol-ps.md repeats them):

- a dense delta ``d`` is a gradient: ``w -= lr * d``; ``lr = -1`` therefore adds ``d`` exactly;
- a fully connected push carries activations ``a`` (k x N) and errors ``e`` (k x M) of a layer
  ``y = W @ x`` with W of M x N; the gradient is ``e.T @ a`` and the update ``W -= lr * e.T @ a``;
- Adagrad: ``acc += g * g; w -= lr * g / sqrt(acc + eps)`` per element, one step per push (a batch
  only amortises the queueing and keeps the shard hot in cache; it does not change the result).
- a compressed push (Strom 2.5, :class:`Signs`) is the sparse gradient ``g`` that is ``+tau`` or
  ``-tau`` on the sent elements and 0 elsewhere. Both optimizers apply exactly what they would
  apply to that dense ``g``, touching only the sent elements (unique indices: a gather, the
  arithmetic, a scatter; no ``np.add.at``): SGD ``w[i] -= lr * (+-tau)``; Adagrad accumulates
  ``tau**2`` on the sent elements only (``acc[i] += tau**2; w[i] -= lr * (+-tau) / sqrt(acc[i] +
  eps)``), so the elements not sent keep their accumulator and value, as a dense step with a
  zero gradient there would leave them. One Adagrad step per compressed push, like any push.

SGD updates are linear, so a batch of activation/error pushes is stacked into one in-place sgemm
with k1 + k2 + ... rows. Dense SGD uses BLAS saxpy (``y = a*x + y`` in one pass, in place).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from adamps import blas
from adamps.server import kernels

KINDS = ("sgd", "adagrad")


class OptimError(ValueError):
    """An invalid optimizer description."""


@dataclass(frozen=True)
class Optimizer:
    """How a tensor's shards are updated; fixed when the tensor is created."""

    kind: str = "sgd"
    #: learning rate; any finite value for SGD (negative adds), > 0 for Adagrad
    lr: float = 0.01
    #: Adagrad: added under the square root, keeps the first steps finite
    eps: float = 1e-8
    #: Adagrad: starting value of every accumulator element
    initial_accumulator: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise OptimError(f"optimizer must be one of {list(KINDS)}, got {self.kind!r}")
        for name in ("lr", "eps", "initial_accumulator"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise OptimError(f"optimizer {name} must be a finite number, got {v!r}")
            object.__setattr__(self, name, float(v))
        if self.kind == "adagrad":
            if self.lr <= 0:
                raise OptimError(f"adagrad lr must be > 0, got {self.lr}")
            if self.eps <= 0:
                raise OptimError(f"adagrad eps must be > 0, got {self.eps}")
            if self.initial_accumulator < 0:
                raise OptimError("adagrad initial_accumulator must be >= 0")

    @property
    def has_accumulator(self) -> bool:
        return self.kind == "adagrad"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "lr": self.lr}
        if self.kind == "adagrad":
            d.update(eps=self.eps, initial_accumulator=self.initial_accumulator)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Optimizer:
        if not isinstance(d, Mapping):
            raise OptimError(f"optimizer must be a map, got {type(d).__name__}")
        unknown = set(d) - {"kind", "lr", "eps", "initial_accumulator"}
        if unknown:
            raise OptimError(f"unknown optimizer field(s) {sorted(unknown)}")
        return cls(**dict(d))


@dataclass(frozen=True, slots=True)
class Dense:
    """A dense delta for a whole shard (any shape with the shard's element count, float32)."""

    delta: np.ndarray


@dataclass(frozen=True, slots=True)
class Fc:
    """Activation/error vectors for a row block: a is k x N, e is k x rows (this shard's columns of e)."""

    a: np.ndarray
    e: np.ndarray


@dataclass(frozen=True, slots=True)
class Signs:
    """A compressed update of a whole shard (Strom 2.5): uint32 words ``index << 1 | negative``,
    strictly increasing (unique indices, checked when the push was validated), each element
    moved by ``+tau`` or ``-tau`` (as a gradient: SGD subtracts ``lr * (+-tau)``)."""

    words: np.ndarray
    tau: float


Update = Dense | Fc | Signs


class Scratch:
    """Per-thread temporary buffers, allocated once (no allocation on the update path)."""

    def __init__(self, max_elems: int) -> None:
        self.t1 = np.empty(max_elems, dtype=np.float32)
        self.t2 = np.empty(max_elems, dtype=np.float32)

    def views(self, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        n = math.prod(shape)
        if n > self.t1.size:  # a larger shard than configured: grow once
            self.t1 = np.empty(n, dtype=np.float32)
            self.t2 = np.empty(n, dtype=np.float32)
        return self.t1[:n].reshape(shape), self.t2[:n].reshape(shape)


# -- kernels ----------------------------------------------------------------------------------


def sgd_dense(w: np.ndarray, d: np.ndarray, lr: float) -> None:
    """w -= lr * d in place, one pass (BLAS saxpy; adamps/blas.py)."""
    blas.axpy(w, d, -lr)


def sgd_fc(w: np.ndarray, a: np.ndarray, e: np.ndarray, lr: float) -> None:
    """W (rows x N, C order) -= lr * e.T @ a in place with one sgemm (beta=1).

    The C-ordered W is the F-ordered N x rows matrix W.T, so BLAS computes
    W.T += (-lr) * a.T @ e writing straight into W's memory. a (k x N) and e (k x rows) are
    C-contiguous, so a.T and e.T are F-contiguous and reach BLAS without a copy.
    """
    blas.outer_acc(w, a, e, -lr)


def fc_grad(a: np.ndarray, e: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out (rows x N, C order) = e.T @ a, written in place."""
    return blas.outer(out, a, e)


def adagrad(
    w: np.ndarray, acc: np.ndarray, g: np.ndarray, lr: float, eps: float, tmp: np.ndarray
) -> None:
    """acc += g*g; w -= lr * (g / sqrt(acc + eps)), in place; tmp is scratch of w's shape.

    One fused pass (numba) or the numpy reference, bit-identical: see :mod:`adamps.server.kernels`.
    """
    kernels.adagrad(w, acc, g, lr, eps, tmp)


def sparse_step(opt: Optimizer, w: np.ndarray, acc: np.ndarray | None, u: Signs) -> None:
    """One optimizer step with the sparse gradient of a compressed update, on the sent elements
    only (the indices are unique: gather, compute, scatter; the same result as the dense step
    with zeros elsewhere, up to float rounding of the fused multiply-add in BLAS)."""
    words = u.words
    if words.size == 0:
        return
    idx = (words >> np.uint32(1)).astype(np.intp)
    t = np.float32(u.tau)
    g = np.where((words & np.uint32(1)).astype(bool), -t, t)
    flat = w.reshape(-1)
    lr = np.float32(opt.lr)
    if opt.kind == "sgd":
        flat[idx] = flat[idx] - lr * g
        return
    assert acc is not None
    a = acc.reshape(-1)
    touched = a[idx] + g * g
    a[idx] = touched
    flat[idx] = flat[idx] - lr * (g / np.sqrt(touched + np.float32(opt.eps)))


# -- batches ----------------------------------------------------------------------------------


def apply_batch(
    opt: Optimizer,
    w: np.ndarray,
    acc: np.ndarray | None,
    updates: Sequence[Update],
    scratch: Scratch,
) -> None:
    """Applies the ordered updates of one shard, in place. Deterministic in (w, acc, updates)."""
    if opt.kind == "sgd":
        i = 0
        n = len(updates)
        while i < n:
            u = updates[i]
            if isinstance(u, Dense):
                sgd_dense(w, u.delta, opt.lr)
                i += 1
                continue
            if isinstance(u, Signs):
                sparse_step(opt, w, acc, u)
                i += 1
                continue
            # A run of consecutive Fc pushes: stack them into one rank-(k1+k2+...) update.
            j = i + 1
            while j < n and isinstance(updates[j], Fc):
                j += 1
            if j - i == 1:
                a, e = u.a, u.e
            else:
                run = updates[i:j]
                a = np.concatenate([x.a for x in run])  # type: ignore[union-attr]
                e = np.concatenate([x.e for x in run])  # type: ignore[union-attr]
            sgd_fc(w, a, e, opt.lr)
            i = j
        return
    assert acc is not None
    g_buf, tmp = scratch.views(w.shape)
    for u in updates:
        if isinstance(u, Signs):
            sparse_step(opt, w, acc, u)
            continue
        if isinstance(u, Dense):
            g = u.delta
        else:
            g = fc_grad(u.a, u.e, g_buf)
        adagrad(w, acc, g, opt.lr, opt.eps, tmp)


def reference_apply(opt: Optimizer, w: np.ndarray, acc: np.ndarray | None, g: np.ndarray) -> None:
    """The textbook update in float64 numpy, for tests: one step with gradient g."""
    g64 = g.astype(np.float64)
    if opt.kind == "sgd":
        w[...] = (w.astype(np.float64) - opt.lr * g64).astype(np.float32)
        return
    assert acc is not None
    acc64 = acc.astype(np.float64) + g64 * g64
    acc[...] = acc64.astype(np.float32)
    w[...] = (w.astype(np.float64) - opt.lr * g64 / np.sqrt(acc64 + opt.eps)).astype(np.float32)
