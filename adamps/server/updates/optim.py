"""Server-side optimizers applied in place to one shard: plain SGD (BLAS), the legacy Adagrad
(DistBelief 4.1, ``adagrad_legacy``) and, through :mod:`adamps.server.updates.torchoptim`, torch.optim's
rules (``sgd`` with momentum or weight decay, ``adagrad``, ``adam``, ``adamw``, ``rmsprop``). The
definitions and the layout of their state: :mod:`adamps.optspec`.

Pure numpy/BLAS, no threads and no IO: the store's owner thread calls :func:`apply_batch` with the
shard's arrays and the ordered list of updates queued for it. The result is a deterministic
function of (values, accumulators, ordered updates), so replicas that apply the same batches end
bit-identical.

Conventions (docs/protocol-ps.md repeats them):

- a dense delta ``d`` is a gradient: ``w -= lr * d``; ``lr = -1`` therefore adds ``d`` exactly;
- a fully connected push carries activations ``a`` (k x N) and errors ``e`` (k x M) of a layer
  ``y = W @ x`` with W of M x N; the gradient is ``e.T @ a`` and the update ``W -= lr * e.T @ a``;
- the legacy Adagrad: ``acc += g * g; w -= lr * g / sqrt(acc + eps)`` per element, one step per
  push; every optimizer takes one step per push, in order (a batch
  only amortises the queueing and keeps the shard hot in cache; it does not change the result).
- a compressed push (Strom 2.5, :class:`Signs`) is the sparse gradient ``g`` that is ``+tau`` or
  ``-tau`` on the sent elements and 0 elsewhere. torch's rules take it dense (:func:`signs_dense`,
  as torch would see it). Plain SGD and the legacy Adagrad apply exactly what they would
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from adamps import blas
from adamps.optspec import KINDS, OptimError, Optimizer
from adamps.server.updates import kernels, torchoptim

__all__ = ["KINDS", "OptimError", "Optimizer"]


@dataclass(frozen=True, slots=True)
class Dense:
    """A dense delta for a whole shard (any shape with the shard's element count, float32)."""

    delta: np.ndarray
    #: the optimizer its push named (hyper.py: a scheduler's lr); None: the tensor's own
    opt: Optimizer | None = None


@dataclass(frozen=True, slots=True)
class Fc:
    """Activation/error vectors for a row block: a is k x N, e is k x rows (this shard's columns of e)."""

    a: np.ndarray
    e: np.ndarray
    opt: Optimizer | None = None


@dataclass(frozen=True, slots=True)
class Signs:
    """A compressed update of a whole shard (Strom 2.5): uint32 words ``index << 1 | negative``,
    strictly increasing (unique indices, checked when the push was validated), each element
    moved by ``+tau`` or ``-tau`` (as a gradient: SGD subtracts ``lr * (+-tau)``)."""

    words: np.ndarray
    tau: float
    opt: Optimizer | None = None


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


def state_shape(opt: Optimizer, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the state array of a shard of `shape`: the shard's own for the legacy
    Adagrad (its records are unchanged), else flat (adamps/optspec.py: arrays, then the step count)."""
    if opt.legacy_layout:
        return shape
    return (opt.state_size(math.prod(shape)),)


#: the kinds whose dense step is a fused kernel (kernels.py): torch's Adagrad and the legacy one
FUSED_KINDS = frozenset({"adagrad", "adagrad_legacy"})


def warm_kernels(opt: Optimizer) -> None:
    """A shard under `opt` is created or reloaded: its kernels start loading now (kernels.warm)."""
    if opt.kind in FUSED_KINDS:
        kernels.warm()


def initial_state(opt: Optimizer, n: int) -> np.ndarray:
    """A new shard's state (flat): the first array at the kind's initial value, the rest and
    the step count 0."""
    st = np.zeros(opt.state_size(n), np.float32)
    st[:n] = opt.initial_state
    return st


def state_array(opt: Optimizer, shard: Any, a: np.ndarray) -> np.ndarray:
    """`a` (a saved or sent state) as the C-contiguous float32 state of `shard`, or ValueError.
    Every shard's state is built here (created, reloaded, installed): its kernels start loading."""
    warm_kernels(opt)
    want = opt.state_size(shard.size)
    if a.size != want:
        raise ValueError(
            f"shard {shard.id}: a {opt.kind} state of {a.size} elements, expected {want}"
        )
    return np.array(a, dtype=np.float32, order="C").reshape(state_shape(opt, shard.shape))


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

    One fused pass (numba) or the numpy reference, bit-identical: see :mod:`adamps.server.updates.kernels`.
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
    if opt.kind == "sgd":  # plain SGD (apply_batch sends the other kinds a dense gradient)
        flat[idx] = flat[idx] - lr * g
        return
    assert acc is not None
    a = acc.reshape(-1)
    touched = a[idx] + g * g
    a[idx] = touched
    flat[idx] = flat[idx] - lr * (g / np.sqrt(touched + np.float32(opt.eps)))


# -- batches ----------------------------------------------------------------------------------


def plain_sgd(opt: Optimizer) -> bool:
    """SGD without momentum or weight decay: linear, stateless, applied with BLAS."""
    return opt.kind == "sgd" and opt.slots == 0 and opt.params["weight_decay"] == 0


def apply_batch(
    opt: Optimizer,
    w: np.ndarray,
    acc: np.ndarray | None,
    updates: Sequence[Update],
    scratch: Scratch,
) -> Optimizer:
    """Applies the ordered updates of one shard, in place, each with the optimizer its push
    named (``u.opt``) or else `opt`, the tensor's; returns the last one used. Deterministic in
    (w, acc, updates)."""
    if all(u.opt is None for u in updates):
        _apply_run(opt, w, acc, updates, scratch)
        return opt
    i, n = 0, len(updates)
    while i < n:  # runs of consecutive updates under one rule (a batch of pushes stays one)
        o = updates[i].opt or opt
        j = i + 1
        while j < n and (updates[j].opt or opt) == o:
            j += 1
        _apply_run(o, w, acc, updates[i:j], scratch)
        i = j
    return o


def _apply_run(
    opt: Optimizer,
    w: np.ndarray,
    acc: np.ndarray | None,
    updates: Sequence[Update],
    scratch: Scratch,
) -> None:
    if plain_sgd(opt):
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
    g_buf, tmp = scratch.views(w.shape)
    if not opt.legacy_layout:
        # torch.optim's rules: every push is one step of the dense gradient (a compressed push
        # is the dense gradient that is +-tau on its elements and 0 elsewhere, as torch sees it)
        if not w.flags.c_contiguous or (acc is not None and not acc.flags.c_contiguous):
            raise ValueError(f"{opt.kind}: the shard and its state must be C-contiguous")
        wf, gb, tf = w.reshape(-1), g_buf.reshape(-1), tmp.reshape(-1)
        state = np.empty(0, np.float32) if acc is None else acc.reshape(-1)
        sparse_ok = opt.kind == "adagrad" and opt.params["weight_decay"] == 0
        for u in updates:
            if isinstance(u, Signs) and sparse_ok:  # only the sent elements move
                idx = (u.words >> np.uint32(1)).astype(np.intp)
                t = np.float32(u.tau)
                sg = np.where((u.words & np.uint32(1)).astype(bool), -t, t)
                torchoptim.sparse_adagrad(opt, wf, state, idx, sg)
                continue
            if isinstance(u, Signs):
                g = signs_dense(u, gb)
            elif isinstance(u, Dense):
                g = u.delta.reshape(-1)
                if g.size != wf.size:
                    raise ValueError(f"gradient of {g.size} elements for a shard of {wf.size}")
            else:
                g = fc_grad(u.a, u.e, g_buf).reshape(-1)
            torchoptim.dense_step(opt, wf, state, g, gb, tf)
        return
    assert acc is not None
    for u in updates:
        if isinstance(u, Signs):
            sparse_step(opt, w, acc, u)
            continue
        if isinstance(u, Dense):
            g = u.delta
        else:
            g = fc_grad(u.a, u.e, g_buf)
        adagrad(w, acc, g, opt.lr, opt.eps, tmp)


def signs_dense(u: Signs, out: np.ndarray) -> np.ndarray:
    """out (flat) = the dense gradient of a compressed push: +-tau on its elements, 0 elsewhere."""
    out.fill(0.0)
    words = u.words
    if words.size:
        idx = (words >> np.uint32(1)).astype(np.intp)
        t = np.float32(u.tau)
        out[idx] = np.where((words & np.uint32(1)).astype(bool), -t, t)
    return out


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
