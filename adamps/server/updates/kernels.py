"""Fused element-wise optimizer kernels: one pass over a shard instead of one numpy pass per operation.

Adagrad in numpy is five passes over memory (g*g, acc+=, +eps, sqrt, g/, then the saxpy): on a
shard beyond the caches each pass streams the whole shard again, and the apply ran at 0.23 of
``np.copyto`` bandwidth (issue 27). The numba kernel reads g, acc and w once and writes acc and w
once.

Two implementations of the same arithmetic, selected by ``ADAMPS_KERNELS`` (read once, when this
module is imported):

- ``numba`` (the default when numba is installed: ``pip install 'adamps[fast]'``): compiled with ``cache=True`` (the machine code is stored next to this file,
  or in numba's per-user cache where that is read-only, so a process after the first does not
  compile again) and an explicit signature. It is loaded in a background thread when the process
  creates or reloads a shard under Adagrad (:func:`warm`) or first applies an Adagrad update
  (:func:`load`), never at import and never on the update path:
  numba and its load cost about 0.6 CPU-s, half a server's start, and a server that applies
  no Adagrad (a controller, a restore, an SGD-only cluster) never needs it. Until it is loaded
  the updates run the numpy reference, which is bit-identical (below), so the switch changes no
  value;
- ``numpy`` (the default without numba): the reference, in-place ufuncs over preallocated
  scratch.

Both do the same IEEE float32 operations in the same order (no fastmath, so LLVM neither fuses a
multiply-add nor reassociates), and are bit-identical; tests/core/test_kernels.py checks that. A
cluster whose servers were started with different settings therefore still keeps equal
(epoch, seq) -> equal values.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np

log = logging.getLogger(__name__)

KERNELS_ENV = "ADAMPS_KERNELS"
CHOICES = ("numba", "numpy")


def _have_numba() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("numba") is not None
    except (ImportError, ValueError):  # ValueError: a module without a spec in sys.modules
        return False


def _choice() -> str:
    """ADAMPS_KERNELS, else numba when it is installed (``pip install 'adamps[fast]'``), else
    numpy: the same float32 arithmetic, one pass instead of five."""
    default = "numba" if _have_numba() else "numpy"
    v = os.environ.get(KERNELS_ENV, default).strip().lower() or default
    if v not in CHOICES:
        raise ValueError(f"{KERNELS_ENV} must be one of {list(CHOICES)}, got {v!r}")
    if v == "numba" and not _have_numba():
        raise ValueError(
            f"{KERNELS_ENV}=numba needs numba: pip install 'adamps[fast]' (or {KERNELS_ENV}=numpy)"
        )
    return v


SELECTED = _choice()


def adagrad_numpy(
    w: np.ndarray, acc: np.ndarray, g: np.ndarray, lr: float, eps: float, tmp: np.ndarray
) -> None:
    """The reference: acc += g*g; w -= lr * (g / sqrt(acc + eps)), float32, in place.

    All arrays are flat float32 of one length; tmp is scratch. Each step is one correctly rounded
    float32 operation, in the order the compiled kernel does them.
    """
    np.multiply(g, g, out=tmp)
    np.add(acc, tmp, out=acc)
    np.add(acc, np.float32(eps), out=tmp)
    np.sqrt(tmp, out=tmp)
    np.divide(g, tmp, out=tmp)
    np.multiply(tmp, np.float32(lr), out=tmp)
    np.subtract(w, tmp, out=w)


def adagrad_torch_numpy(
    w: np.ndarray, acc: np.ndarray, g: np.ndarray, clr: float, eps: float, tmp: np.ndarray
) -> None:
    """torch.optim.Adagrad's step (eps outside the square root), float32, in place:
    acc += g*g; w -= (g / (sqrt(acc) + eps)) * clr. The reference of the fused kernel."""
    np.multiply(g, g, out=tmp)
    np.add(acc, tmp, out=acc)
    np.sqrt(acc, out=tmp)
    np.add(tmp, np.float32(eps), out=tmp)
    np.divide(g, tmp, out=tmp)
    np.multiply(tmp, np.float32(clr), out=tmp)
    np.subtract(w, tmp, out=w)


def _compile_numba(cache: bool = True):  # type: ignore[no-untyped-def]
    import numba

    f32 = numba.float32
    rw = numba.types.Array(f32, 1, "C")
    ro = numba.types.Array(f32, 1, "C", readonly=True)  # a gradient decoded from the wire

    @numba.njit(
        # explicit signatures: compiled (or loaded from the cache) by load(), never on the update
        # path; a writable gradient (an fc gradient in scratch) is passed through the read-only one
        [numba.void(rw, rw, ro, f32, f32)],
        cache=cache,
        nogil=True,  # the owner threads apply shards in parallel
        # numpy's error model: x / 0 is inf, as in numpy. The default ("python") tests every
        # divisor to raise ZeroDivisionError, which keeps LLVM from vectorising the loop (several
        # times slower).
        error_model="numpy",
        boundscheck=False,
    )
    def adagrad_fused(w, acc, g, lr, eps):  # type: ignore[no-untyped-def]
        for i in range(w.shape[0]):
            gi = g[i]
            a = acc[i] + gi * gi
            acc[i] = a
            w[i] = w[i] - lr * (gi / np.sqrt(a + eps))

    @numba.njit(
        [numba.void(rw, rw, ro, f32, f32)],
        cache=cache,
        nogil=True,
        error_model="numpy",
        boundscheck=False,
    )
    def adagrad_torch_fused(w, acc, g, clr, eps):  # type: ignore[no-untyped-def]
        for i in range(w.shape[0]):
            gi = g[i]
            a = acc[i] + gi * gi
            acc[i] = a
            w[i] = w[i] - (gi / (np.sqrt(a) + eps)) * clr

    return adagrad_fused, adagrad_torch_fused


def _load_numba():  # type: ignore[no-untyped-def]
    try:
        return _compile_numba()
    except RuntimeError as e:
        # numba found no writable cache directory (a read-only install and a read-only home):
        # compile in memory at every start rather than not start
        if "cannot cache" not in str(e):
            raise
        return _compile_numba(cache=False)


#: (adagrad_fused, adagrad_torch_fused) once loaded; None before (or with the numpy kernels)
_fused: tuple | None = None  # type: ignore[type-arg]
#: held while the kernels load, so that they load once
_load_lock = threading.Lock()
#: the background thread loading them (started by warm() or the first Adagrad update), else None
_loader: threading.Thread | None = None
#: held while that thread is started, so that one is
_start_lock = threading.Lock()


def load():  # type: ignore[no-untyped-def]
    """Loads (or compiles, the first time on a machine) the numba kernels and returns them;
    (None, None) with the numpy kernels. Blocks: the update path calls :func:`_ready` instead."""
    global _fused
    if SELECTED != "numba":
        return None, None
    with _load_lock:
        if _fused is None:
            _fused = _load_numba()
    return _fused


def _load_in_background() -> None:
    try:
        load()
    except Exception:  # noqa: BLE001 - a kernel that cannot load leaves the (identical) numpy one
        log.exception("the numba kernels did not load; Adagrad keeps the numpy kernels")


def _ready():  # type: ignore[no-untyped-def]
    """The loaded kernels, or None while they load (started here on the first call): the caller
    then runs the numpy reference, bit-identical, rather than wait for a compile."""
    global _loader
    if _fused is not None or SELECTED != "numba":
        return _fused
    if _loader is None:
        with _start_lock:
            if _loader is None:
                _loader = threading.Thread(
                    target=_load_in_background, name="numba-kernels", daemon=True
                )
                _loader.start()
    return None


def warm() -> None:
    """Starts loading the kernels in the background now, if they are not loaded: a tensor whose
    optimizer applies them was created or reloaded, so its first updates find them loaded,
    rather than each copy paying the load (0.6-0.8 CPU-s) inside the first steps of training
    (issue 36's practitioner benchmark counts the servers' CPU over the training loop)."""
    _ready()


def _fusable(*arrays: np.ndarray) -> bool:
    return all(a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)


def adagrad(
    w: np.ndarray, acc: np.ndarray, g: np.ndarray, lr: float, eps: float, tmp: np.ndarray
) -> None:
    """One Adagrad step in place with the selected kernel; w and acc are the shard's arrays (any
    shape, C-contiguous), g has their element count, tmp is scratch of at least that size."""
    if not (w.flags.c_contiguous and acc.flags.c_contiguous):
        # reshape(-1) would return a copy and the update would be lost
        raise ValueError("adagrad: the shard and its accumulator must be C-contiguous")
    if g.size != w.size:
        raise ValueError(f"gradient of {g.size} elements for a shard of {w.size}")
    wf, af, gf = w.reshape(-1), acc.reshape(-1), g.reshape(-1)
    fused = _ready()
    if fused is not None and _fusable(wf, af, gf):
        fused[0](wf, af, gf, np.float32(lr), np.float32(eps))
        return
    adagrad_numpy(wf, af, gf, lr, eps, tmp.reshape(-1)[: wf.size])


def adagrad_torch(
    w: np.ndarray, acc: np.ndarray, g: np.ndarray, clr: float, eps: float, tmp: np.ndarray
) -> None:
    """One step of torch's Adagrad in place with the selected kernel: flat float32 arrays of one
    length (acc is the shard's accumulator, the state's first slot), tmp scratch of that size."""
    fused = _ready()
    if fused is not None and _fusable(w, acc, g):
        fused[1](w, acc, g, np.float32(clr), np.float32(eps))
        return
    adagrad_torch_numpy(w, acc, g, clr, eps, tmp)
