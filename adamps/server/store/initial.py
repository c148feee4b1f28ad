"""Initial values of a tensor: the kinds of init, their canonical description (what `create`
compares), and the values themselves, the same in every process for the same description."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from adamps.server.store.shards import StoreError

INIT_KINDS = ("zeros", "constant", "uniform", "normal", "xavier", "values")


def fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight of `shape` = (out, in, *receptive field) as in y = W @ x."""
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def normalize_init(init: Mapping[str, Any] | None, shape: tuple[int, ...]) -> dict[str, Any]:
    """A checked, canonical init description (given values replaced by their digest)."""
    init = dict(init or {"kind": "zeros"})
    kind = init.get("kind", "zeros")
    if kind not in INIT_KINDS:
        raise StoreError(
            "bad_request", f"init kind must be one of {list(INIT_KINDS)}, got {kind!r}"
        )
    allowed = {
        "zeros": set(),
        "constant": {"value"},
        "uniform": {"low", "high", "seed"},
        "normal": {"mean", "std", "seed"},
        "xavier": {"gain", "seed"},
        "values": {"values"},
    }[kind]
    unknown = set(init) - allowed - {"kind"}
    if unknown:
        raise StoreError(
            "bad_request", f"init {kind!r} takes {sorted(allowed)}, got unknown {sorted(unknown)}"
        )
    out: dict[str, Any] = {"kind": kind}
    defaults = {"value": 0.0, "low": -0.05, "high": 0.05, "mean": 0.0, "std": 0.01, "gain": 1.0}
    for name in sorted(allowed - {"seed", "values"}):
        v = init.get(name, defaults[name])
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise StoreError("bad_request", f"init {name} must be a finite number, got {v!r}")
        out[name] = float(v)
    if "seed" in allowed:
        seed = init.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise StoreError("bad_request", f"init seed must be an int >= 0, got {seed!r}")
        out["seed"] = seed
    if kind == "uniform" and not out["low"] <= out["high"]:
        raise StoreError("bad_request", "init uniform needs low <= high")
    if kind == "normal" and out["std"] < 0:
        raise StoreError("bad_request", "init normal needs std >= 0")
    if kind == "values":
        values = init.get("values")
        if not isinstance(values, np.ndarray):
            raise StoreError("bad_request", "init values must be an array")
        if values.dtype != np.float32:
            raise StoreError("bad_dtype", f"init values must be float32, got {values.dtype.name}")
        if tuple(values.shape) != shape:
            raise StoreError(
                "bad_shape", f"init values must have shape {list(shape)}, got {list(values.shape)}"
            )
        if not np.isfinite(values).all():
            raise StoreError("non_finite", "init values hold NaN or Inf")
        out["sha256"] = hashlib.sha256(np.ascontiguousarray(values).data).hexdigest()
    return out


def initial_values(
    shape: tuple[int, ...], init: Mapping[str, Any], values: np.ndarray | None = None
) -> np.ndarray:
    """The whole tensor's initial values: the same in every process for the same description."""
    kind = init["kind"]
    if kind == "values":
        assert values is not None
        return np.array(values, dtype=np.float32, order="C")
    if kind in ("zeros", "constant"):
        return np.full(shape, init.get("value", 0.0), dtype=np.float32)
    rng = np.random.default_rng(init["seed"])
    if kind == "uniform":
        return rng.uniform(init["low"], init["high"], size=shape).astype(np.float32)
    if kind == "normal":
        return rng.normal(init["mean"], init["std"], size=shape).astype(np.float32)
    # Glorot & Bengio (2010) uniform: limit = gain * sqrt(6 / (fan_in + fan_out))
    fan_in, fan_out = fans(shape)
    limit = init["gain"] * math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)
