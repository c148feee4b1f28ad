"""In-place float32 updates of the parameter server and the trainers: scipy's BLAS when scipy is
installed (``pip install 'adamps[fast]'``: one pass, no temporary), else numpy.

- ``axpy(w, d, alpha)``: w += alpha * d (BLAS saxpy);
- ``outer_acc(w, a, e, alpha)``: W (rows x N, C order) += alpha * e.T @ a (sgemm with beta = 1:
  the C-ordered W is the F-ordered N x rows matrix W.T, written straight into W's memory);
- ``outer(out, a, e)``: out = e.T @ a.

The two paths compute the same sums; they may differ in the last bit (BLAS fuses the scaling
into the update, numpy rounds the product first). scipy is looked up once, on first use: a
trainer that never installs a fetch never imports it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np


@functools.cache
def _blas() -> Any:
    try:
        from scipy.linalg import blas
    except ImportError:
        return None
    return blas


def have_scipy() -> bool:
    return _blas() is not None


def _check_in_place(result: np.ndarray, target: np.ndarray) -> None:
    # f2py writes into its output argument only when that is contiguous float32 in the order
    # BLAS wants; otherwise it silently works on a copy and the update would be lost.
    if result.__array_interface__["data"][0] != target.__array_interface__["data"][0]:
        raise RuntimeError("BLAS did not write in place (non-contiguous or non-float32 target)")


def axpy(w: np.ndarray, d: np.ndarray, alpha: float) -> None:
    """w += alpha * d in place (w C-contiguous float32; d of w's element count)."""
    if d.size != w.size:  # saxpy would silently update only the first d.size elements
        raise ValueError(f"delta of {d.size} elements for a shard of {w.size}")
    blas = _blas()
    if blas is not None:
        _check_in_place(blas.saxpy(d.reshape(-1), w.reshape(-1), a=alpha), w)
        return
    wf = w.reshape(-1)
    if not np.shares_memory(wf, w):
        raise RuntimeError("axpy: the target is not contiguous (the update would be lost)")
    wf += np.float32(alpha) * d.reshape(-1).astype(np.float32, copy=False)


def outer_acc(w: np.ndarray, a: np.ndarray, e: np.ndarray, alpha: float) -> None:
    """W (rows x N, C order) += alpha * e.T @ a in place; a (k x N), e (k x rows) C-contiguous."""
    blas = _blas()
    if blas is not None:
        out = blas.sgemm(alpha, a.T, e.T, beta=1.0, c=w.T, trans_b=1, overwrite_c=1)
        _check_in_place(out, w)
        return
    prod = e.T @ a
    if alpha != 1.0:
        prod *= np.float32(alpha)
    w += prod


def outer(out: np.ndarray, a: np.ndarray, e: np.ndarray) -> np.ndarray:
    """out (rows x N, C order) = e.T @ a, written in place."""
    blas = _blas()
    if blas is not None:
        res = blas.sgemm(1.0, a.T, e.T, beta=0.0, c=out.T, trans_b=1, overwrite_c=1)
        _check_in_place(res, out)
        return out
    np.matmul(e.T, a, out=out)
    return out
