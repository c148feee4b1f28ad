"""Optimizer steps whose state is per row of a table (not per element of a dense shard): the
lazy Adam of torch.optim.SparseAdam (``sparse_adam``). Row-wise Adagrad and the per-element kinds
on rows are torchoptim.row_step's; it calls `sparse_adam` here.

``sparse_adam`` follows torch.optim.SparseAdam (torch 2.x, ``_functional.sparse_adam``) operation
by operation in float32, on the rows a push carries (their gradients already summed per id, as
torch's ``coalesce``); a row not pushed keeps its moments, as torch leaves the rows a sparse
gradient does not name:

    m_upd = (g - m) * (1 - beta1);        m += m_upd
    v_upd = (g * g - v) * (1 - beta2);    v += v_upd
    numer = m_upd + m_old;  denom = sqrt(v_upd + v_old) + eps
    w += -(lr * sqrt(1 - beta2^t) / (1 - beta1^t)) * (numer / denom)

One difference, forced by where the state lives: torch's ``t`` is the table's step count (every
``step()``), while each bucket's copies of a row see only the pushes that name it, so ``t`` is
the row's own count of pushes, kept in its state. The two agree for a row that every step
pushes; a row pushed for the first time at step 1000 takes a first step of about ``lr`` here
(bias-corrected as Adam's first step) instead of torch's about ``2.5 * lr``.

A row's state is ``[m (dim), v (dim), t (1)]`` float32 (optspec.Optimizer.row_state_width):
``t`` is stored as its value, exact to 2^24 pushes of the row; past that it stays 2^24, where
both bias corrections are 1 in float64 already.

Pure numpy, no IO: the same pushes in the same order give bit-identical rows on every copy.
"""

from __future__ import annotations

import numpy as np

from adamps.optspec import Optimizer

F32 = np.float32
#: the largest step count a float32 holds exactly (t + 1 is then t)
MAX_STEP = float(1 << 24)


def sparse_adam(opt: Optimizer, w: np.ndarray, state: np.ndarray, g: np.ndarray) -> None:
    """One step on gathered rows: `w` [k, dim], their `state` [k, 2 * dim + 1] and gradients
    `g` [k, dim] (one per distinct id), `w` and `state` updated in place."""
    dim = w.shape[1]
    b1, b2 = opt.params["betas"]
    m_old = state[:, :dim].copy()
    v_old = state[:, dim : 2 * dim].copy()
    t = np.minimum(state[:, 2 * dim].astype(np.float64) + 1.0, MAX_STEP)
    state[:, 2 * dim] = t
    m_upd = (g - m_old) * F32(1.0 - b1)
    state[:, :dim] = m_old + m_upd
    v_upd = (g * g - v_old) * F32(1.0 - b2)
    state[:, dim : 2 * dim] = v_old + v_upd
    numer = m_upd + m_old
    denom = np.sqrt(v_upd + v_old) + F32(opt.params["eps"])
    # torch's step size is a Python float (float64), applied to float32 rows as float32
    step_size = (opt.lr * np.sqrt(1.0 - b2**t) / (1.0 - b1**t)).astype(F32)
    w += (-step_size)[:, None] * (numer / denom)
