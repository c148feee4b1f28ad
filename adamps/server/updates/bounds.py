"""Finite stays finite: magnitude bounds that keep every stored float32 finite (issue 12).

Issue 12 stored +-inf from finite inputs: init std 1e300, constant init 1e39, SGD lr 1e30, two
pushes of 3e38. Checking each stored shard after every apply would cost a pass over it per batch
and would come too late (the shard is already changed, on every replica). Instead each input is
bounded on its own, before it is queued or replicated, so that no sequence of accepted inputs of
realistic length can overflow:

- initial values (constant, uniform bounds, normal mean + 64 std, xavier gain, given values) and
  Adagrad's initial accumulator and eps: at most ``MAX_VALUE`` = 1e24 in magnitude;
- learning rate: ``|lr| <= MAX_LR`` = 1e12;
- the gradient of one push: ``max|d| <= MAX_GRAD`` = 1e12 for a dense delta; for activation and
  error vectors ``k * max|a| * max|e| <= MAX_GRAD``, which bounds every element of ``e.T @ a``
  and every partial sum BLAS forms on the way.

Then one update moves an element by at most ``|lr| * MAX_GRAD <= 1e24`` (SGD) or ``lr`` (Adagrad:
``|g| / sqrt(acc + eps) <= 1`` because ``acc >= g*g`` after the step), and an Adagrad accumulator
grows by at most ``MAX_GRAD**2 = 1e24`` per update. Starting from at most 1e24, an element or
accumulator reaches float32's 3.4e38 only after more than 3e14 updates to the same shard (ten
years at a million pushes per second). The cost is one min and one max over each pushed array,
which also replaces the separate NaN/Inf check (min/max propagate NaN and Inf).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from adamps.wire.protocol import MAX_GRAD, ProtocolError

if TYPE_CHECKING:
    # A type only: the optimizers' module and its imports cost a restore's client, checking a
    # checkpoint's bounds, CPU it never needs
    from adamps.server.updates.optim import Optimizer

MAX_VALUE = 1e24
MAX_LR = 1e12
#: the magnitude a checkpoint's installed value or accumulator may have (check_state)
MAX_STATE = 1e36
#: normal init: samples beyond mean +- 64 std never occur (numpy's ziggurat tops out near 14)
NORMAL_SIGMAS = 64.0


def max_abs(name: str, arr: np.ndarray) -> float:
    """max |arr| in two passes without a temporary; non_finite if arr holds NaN or Inf."""
    if arr.size == 0:
        return 0.0
    lo, hi = float(arr.min()), float(arr.max())
    if not (math.isfinite(lo) and math.isfinite(hi)):
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        raise ProtocolError("non_finite", f"field {name!r} holds {bad} NaN/Inf values")
    return max(hi, -lo)


def _too_big(what: str, value: float, limit: float) -> ProtocolError:
    return ProtocolError(
        "bad_request",
        f"{what} {value:.3g} exceeds {limit:.0e}: values this large could overflow float32 "
        "(docs/protocol-ps.md, 'Finite values')",
        limit=limit,
    )


def check_optimizer(opt: Optimizer) -> None:
    if abs(opt.lr) > MAX_LR:
        raise _too_big("optimizer lr of magnitude", abs(opt.lr), MAX_LR)
    for name in ("eps", "initial_accumulator", "initial_accumulator_value", "weight_decay"):
        if name not in opt.params:
            continue
        v = abs(opt.params[name])
        if v > MAX_VALUE:
            raise _too_big(f"optimizer {name} of magnitude", v, MAX_VALUE)


def check_init(init: Mapping[str, Any], values: Any = None) -> None:
    """`init` is normalize_init's output (finite numbers); `values` the given array, if any."""
    kind = init["kind"]
    if kind == "constant":
        m = abs(init["value"])
    elif kind == "uniform":
        m = max(abs(init["low"]), abs(init["high"]))
    elif kind == "normal":
        m = abs(init["mean"]) + NORMAL_SIGMAS * init["std"]
    elif kind == "xavier":
        m = abs(init["gain"])  # times sqrt(6 / (fan_in + fan_out)) <= sqrt(3) < 2
    elif kind == "values" and isinstance(values, np.ndarray):
        m = max_abs("init values", values)
    else:
        return
    if m > MAX_VALUE:
        raise _too_big(f"init {kind} reaching", m, MAX_VALUE)


def check_dense(name: str, delta: np.ndarray) -> None:
    m = max_abs(name, delta)
    if m > MAX_GRAD:
        raise _too_big(f"field {name!r} holds a value of magnitude", m, MAX_GRAD)


def within(delta: np.ndarray) -> bool:
    """Whether every element of `delta` passes check_dense: finite, magnitude <= MAX_GRAD. The
    same min and max, with no error built: the data port's reader thread runs it over a whole
    push payload while it is still in the cache (adamps/server/api/dp_reader.py), and the event loop
    then skips check_dense on that payload's shards (a bound over the whole payload holds for
    every slice of it). False sends the payload through check_dense, which names the shard."""
    if delta.size == 0:
        return True
    lo, hi = float(delta.min()), float(delta.max())
    # NaN fails both comparisons; +-inf fails the bound
    return -MAX_GRAD <= lo and hi <= MAX_GRAD


def check_state(
    what: str, values: np.ndarray, accum: np.ndarray | None = None, signed: bool = False
) -> None:
    """A checkpoint's state for one shard (``ckpt_install``): finite, magnitude at most
    ``MAX_STATE``, and unless `signed` (an optimizer whose state holds signed moments or
    momentum buffers: Optimizer.signed_state) the accumulator non-negative (Adagrad's square
    root is taken of it). Trained state may have left ``MAX_VALUE`` behind (each update moves it
    by up to 1e24), so the bound is wider, yet from it an element still needs over 3e14 updates
    to reach float32's 3.4e38. `what` names the shard in the error (``non_finite`` or
    ``bad_request``)."""
    m = max_abs(f"{what}: values", values)
    if m > MAX_STATE:
        raise _too_big(f"{what}: a value of magnitude", m, MAX_STATE)
    if accum is not None and accum.size:
        m = max_abs(f"{what}: accumulator", accum)
        if m > MAX_STATE:
            raise _too_big(f"{what}: an accumulator of magnitude", m, MAX_STATE)
        if not signed and float(accum.min()) < 0:
            raise ProtocolError("bad_request", f"{what}: an Adagrad accumulator is negative")


def check_fc(a: np.ndarray, e: np.ndarray) -> None:
    bound = a.shape[0] * max_abs("a", a) * max_abs("e", e)
    if bound > MAX_GRAD:
        raise _too_big("k * max|a| * max|e| =", bound, MAX_GRAD)
