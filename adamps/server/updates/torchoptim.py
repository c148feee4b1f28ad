"""torch.optim's update rules applied in place to one shard (dense) or to gathered rows (tables).

Each dense step follows torch.optim's single-tensor code (torch 2.x, ``foreach=False``,
``maximize=False``) operation by operation, in float32 with in-place numpy ufuncs (``out=``)
over two preallocated scratch buffers: no full-size temporary per step. The order of the float32
operations is fixed, so replicas that apply the same pushes end bit-identical.

A shard's state (adamps/optspec.py) is one flat float32 array: the per-element arrays one after the
other, then the step count in the last two elements (uint64 bits). Per kind, in order:

- ``sgd`` (momentum > 0): momentum_buffer (torch's first step sets it to the gradient);
- ``adagrad``: sum;
- ``adam``/``adamw``: exp_avg, exp_avg_sq (, max_exp_avg_sq with amsgrad);
- ``rmsprop``: square_avg (, grad_avg when centered) (, momentum_buffer when momentum > 0).
"""

from __future__ import annotations

import numpy as np

from adamps.optspec import STEP_SLOTS, Optimizer
from adamps.server.updates import kernels, rowoptim

F32 = np.float32


def step_count(state: np.ndarray) -> int:
    """The number of steps a torch-kind state has taken."""
    return int(state.reshape(-1)[-STEP_SLOTS:].view("<u8")[0])


def _next_step(state: np.ndarray) -> int:
    cell = state[-STEP_SLOTS:].view("<u8")
    step = int(cell[0]) + 1
    cell[0] = step
    return step


def _decayed(
    g: np.ndarray, w: np.ndarray, wd: float, gbuf: np.ndarray, tmp: np.ndarray
) -> np.ndarray:
    """gbuf = g + wd * w (torch: ``grad.add(param, alpha=weight_decay)``); g may be gbuf."""
    np.multiply(w, F32(wd), out=tmp)
    np.add(g, tmp, out=gbuf)
    return gbuf


def _lerp(a: np.ndarray, end: np.ndarray, weight: float, tmp: np.ndarray) -> None:
    """a.lerp_(end, weight) as torch computes it (two formulas, split at weight 0.5)."""
    np.subtract(end, a, out=tmp)
    if weight < 0.5:
        tmp *= F32(weight)
        a += tmp
    else:
        tmp *= F32(1.0 - weight)
        np.subtract(end, tmp, out=a)


def dense_step(
    opt: Optimizer, w: np.ndarray, state: np.ndarray, g: np.ndarray, gbuf: np.ndarray,
    tmp: np.ndarray,
) -> None:  # fmt: skip
    """One step of a torch kind on a flat shard `w` with gradient `g` (read-only, or `gbuf`
    itself); `gbuf` and `tmp` are scratch of w's size; `state` is the shard's flat state."""
    n = w.size
    p = opt.params
    step = _next_step(state) if state.size else 0  # plain SGD with weight decay keeps none
    kind = opt.kind
    wd = p["weight_decay"]
    lr = opt.lr
    if wd != 0 and kind != "adamw":
        g = _decayed(g, w, wd, gbuf, tmp)
    if kind == "sgd":
        m = p["momentum"]
        if m > 0:
            buf = state[:n]
            if step == 1:
                np.copyto(buf, g)
            else:
                buf *= F32(m)
                if p["dampening"] != 0:
                    np.multiply(g, F32(1.0 - p["dampening"]), out=tmp)
                    buf += tmp
                else:
                    buf += g
            if p["nesterov"]:
                np.multiply(buf, F32(m), out=tmp)
                np.add(g, tmp, out=gbuf)
                g = gbuf
            else:
                g = buf
        np.multiply(g, F32(lr), out=tmp)
        w -= tmp
    elif kind == "adagrad":
        clr = lr / (1.0 + (step - 1) * p["lr_decay"])
        kernels.adagrad_torch(w, state[:n], g, clr, p["eps"], tmp)  # one fused pass (numba)
    elif kind in ("adam", "adamw"):
        b1, b2 = p["betas"]
        if wd != 0 and kind == "adamw":
            w *= F32(1.0 - lr * wd)
        m, v = state[:n], state[n : 2 * n]
        _lerp(m, g, 1.0 - b1, tmp)
        v *= F32(b2)
        np.multiply(g, g, out=tmp)
        tmp *= F32(1.0 - b2)
        v += tmp
        step_size = lr / (1.0 - b1**step)
        bc2_sqrt = (1.0 - b2**step) ** 0.5
        src = v
        if p["amsgrad"]:
            src = state[2 * n : 3 * n]
            np.maximum(src, v, out=src)
        np.sqrt(src, out=tmp)
        tmp /= F32(bc2_sqrt)
        tmp += F32(p["eps"])
        np.divide(m, tmp, out=tmp)
        tmp *= F32(step_size)
        w -= tmp
    elif kind == "rmsprop":
        alpha = p["alpha"]
        sq = state[:n]
        sq *= F32(alpha)
        np.multiply(g, g, out=tmp)
        tmp *= F32(1.0 - alpha)
        sq += tmp
        at = n
        if p["centered"]:
            ga = state[at : at + n]
            at += n
            _lerp(ga, g, 1.0 - alpha, tmp)
            np.multiply(ga, ga, out=tmp)
            np.subtract(sq, tmp, out=tmp)
            np.sqrt(tmp, out=tmp)
        else:
            np.sqrt(sq, out=tmp)
        tmp += F32(p["eps"])
        np.divide(g, tmp, out=tmp)
        if p["momentum"] > 0:
            buf = state[at : at + n]
            buf *= F32(p["momentum"])
            buf += tmp
            np.multiply(buf, F32(lr), out=tmp)
        else:
            tmp *= F32(lr)
        w -= tmp
    else:
        raise ValueError(f"optimizer {kind!r} has no dense step")


def sparse_adagrad(
    opt: Optimizer, w: np.ndarray, state: np.ndarray, idx: np.ndarray, g: np.ndarray
) -> None:
    """torch's Adagrad step (no weight decay) with a gradient that is `g` at the unique flat
    indices `idx` and 0 elsewhere (a compressed push), touching only those elements: a zero
    gradient leaves an element's sum and value as they are, so this is the dense step, bit for
    bit, in one gather and one scatter instead of a pass over the shard."""
    n = w.size
    step = _next_step(state)
    clr = F32(opt.lr / (1.0 + (step - 1) * opt.params["lr_decay"]))
    acc = state[:n]
    a = acc[idx] + g * g
    acc[idx] = a
    w[idx] = w[idx] - (g / (np.sqrt(a) + F32(opt.params["eps"]))) * clr


def row_step(opt: Optimizer, w: np.ndarray, acc: np.ndarray | None, g: np.ndarray) -> None:
    """One step on gathered rows: w (k x dim), their state acc (k x width) and gradients g,
    all updated in place (the caller scatters them back)."""
    kind = opt.kind
    lr = F32(opt.lr)
    if kind == "sgd":
        w -= lr * g
        return
    assert acc is not None
    if kind == "sparse_adam":
        rowoptim.sparse_adam(opt, w, acc, g)
        return
    eps = F32(opt.params["eps"])
    if kind == "adagrad_legacy":
        acc += g * g
        w -= lr * g / np.sqrt(acc + eps)
        return
    wd = opt.params["weight_decay"]
    if wd != 0:
        g = g + F32(wd) * w
    if kind == "adagrad":
        acc += g * g
        w -= lr * g / (np.sqrt(acc) + eps)
    elif kind == "rowwise_adagrad":
        # one accumulator per row: the mean of the squared gradient over the row (TorchRec)
        acc += np.mean(g * g, axis=1, dtype=np.float32, keepdims=True)
        w -= (lr / (np.sqrt(acc) + eps)) * g
    else:
        raise ValueError(f"optimizer {kind!r} has no row step")
