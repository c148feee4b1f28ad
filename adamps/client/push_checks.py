"""A push checked whole before any part of it is sent (issue 39).

``PSClient`` splits a push by primary server (and by bucket, adamps/client/parts.py). The servers
check what they receive, but each only its own part: a NaN row refused by one server while the
others applied theirs left a push applied in part behind a 4xx that says "nothing applied"
(docs/protocol-ps.md, "A push split over servers"). So the client refuses the whole push first,
with the code a server would have answered (``non_finite``, ``bad_shape``, ``bad_dtype``,
``unknown_tensor``, ``bad_request``), as an ``RpcError`` with that code's 4xx status that no
server sent: nothing was sent, nothing applied. What is left to a server after this (a lease moved, a server
gone, a run's quota, a table full) is reported by parts (adamps/client/partial.py).

Cost: one min and one max over each array pushed (they propagate NaN and Inf, and bound the
magnitude like the servers' ``bounds.check_dense``), no temporary; compressed words are checked
as the servers check them (sorted, unique, in range), Rice streams only for their types. These
are the checks of the servers' write path (adamps/server/writepath.py, tableops.py, bounds.py)
that need no server state; the servers still run theirs on every part (a client is not trusted).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from adamps.client.rpc import RpcError
from adamps.compression import codec
from adamps.layout import Layout
from adamps.wire.protocol import ERRORS, MAX_FC_K, MAX_GRAD


def refused(code: str, message: str) -> RpcError:
    """The error of a push refused before sending: a 4xx whose part was nothing at all."""
    return RpcError(code, message + " (refused by the client: nothing was sent)", ERRORS[code][0])


def bounded(name: str, arr: np.ndarray) -> float:
    """max |arr|, which must be finite and at most MAX_GRAD (the servers' bound on one push's
    gradient)."""
    if arr.size == 0:
        return 0.0
    lo, hi = float(arr.min()), float(arr.max())
    if not (math.isfinite(lo) and math.isfinite(hi)):
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        raise refused("non_finite", f"{name} holds {bad} NaN/Inf values")
    m = max(hi, -lo)
    if m > MAX_GRAD:
        raise refused(
            "bad_request",
            f"{name} holds a value of magnitude {m:.3g}, beyond {MAX_GRAD:.0e}: values this "
            "large could overflow float32 (docs/protocol-ps.md, 'Finite values')",
        )
    return m


def _float32(name: str, value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind not in "fiu":  # (integers are exact in float32 up to 2^24, as numpy casts)
        raise refused("bad_dtype", f"{name} must be an array of numbers, got {arr.dtype.name}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def dense(layout: Layout, name: str, delta: Any) -> np.ndarray:
    """A whole tensor's delta, checked: float32, the tensor's shape, bounded."""
    spec = layout.tensors.get(name)
    if spec is None:
        raise refused("unknown_tensor", f"tensor {name!r} is not in the client's layout")
    arr = _float32(f"the delta of {name!r}", delta)
    if arr.shape != spec.shape:
        raise refused(
            "bad_shape",
            f"the delta of {name!r} must have shape {list(spec.shape)}, got {list(arr.shape)}",
        )
    bounded(f"the delta of {name!r}", arr)
    return arr


def shards(layout: Layout, deltas: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Shard deltas, checked: known shard ids, float32 of each shard's shape, bounded."""
    out: dict[str, np.ndarray] = {}
    for sid, delta in deltas.items():
        s = layout.shards.get(sid)
        if s is None:
            raise refused("unknown_tensor", f"shard {sid!r} is not in the client's layout")
        arr = _float32(f"the delta of shard {sid!r}", delta)
        if arr.size != s.size:
            raise refused(
                "bad_shape",
                f"the delta of shard {sid!r} must have {s.size} values {list(s.shape)}, "
                f"got {list(arr.shape)}",
            )
        bounded(f"the delta of shard {sid!r}", arr)
        out[sid] = arr.reshape(s.shape)
    return out


def fc(layout: Layout, name: str, a: Any, e: Any) -> tuple[np.ndarray, np.ndarray]:
    """One layer's activation (k x N) and error (k x M) vectors, checked as a server checks
    them: a 2-D tensor, 1 <= k <= MAX_FC_K, finite, k * max|a| * max|e| <= MAX_GRAD."""
    spec = layout.tensors.get(name)
    if spec is None:
        raise refused("unknown_tensor", f"tensor {name!r} is not in the client's layout")
    if len(spec.shape) != 2:
        raise refused("bad_request", f"push_fc needs a 2-D tensor; {name!r} is {list(spec.shape)}")
    m, n = spec.shape
    a32 = _float32(f"a of {name!r}", a)
    e32 = _float32(f"e of {name!r}", e)
    k = a32.shape[0] if a32.ndim == 2 else -1
    if a32.shape != (k, n) or e32.shape != (k, m) or not 1 <= k <= MAX_FC_K:
        raise refused(
            "bad_shape",
            f"{name!r} ({m} x {n}) needs a [k, {n}] and e [k, {m}] with 1 <= k <= {MAX_FC_K}, "
            f"got {list(a32.shape)} and {list(e32.shape)}",
        )
    bound = k * bounded(f"a of {name!r}", a32) * bounded(f"e of {name!r}", e32)
    if bound > MAX_GRAD:
        raise refused(
            "bad_request",
            f"{name!r}: k * max|a| * max|e| = {bound:.3g} exceeds {MAX_GRAD:.0e}: values this "
            "large could overflow float32 (docs/protocol-ps.md, 'Finite values')",
        )
    return a32, e32


def compressed(layout: Layout, updates: Mapping[str, Any]) -> None:
    """Compressed shard updates (``{"tau", "words"}`` or ``{"tau", "n", "k", "rice"}``)."""
    for sid, d in updates.items():
        s = layout.shards.get(sid)
        if s is None:
            raise refused("unknown_tensor", f"shard {sid!r} is not in the client's layout")
        where = f"the compressed update of shard {sid!r}"
        if not isinstance(d, Mapping):
            raise refused("bad_request", f"{where} must be a map")
        tau = d.get("tau")
        if isinstance(tau, bool) or not isinstance(tau, int | float | np.floating):
            raise refused("bad_request", f"{where}: tau must be a number")
        if not math.isfinite(float(tau)):
            raise refused("non_finite", f"{where}: tau is {tau}")
        if not 0 < float(tau) <= MAX_GRAD:
            raise refused("bad_request", f"{where}: tau must be in (0, {MAX_GRAD:.0e}], got {tau}")
        if "words" in d and "rice" in d:  # the servers refuse it: never a part of a split push
            raise refused("bad_request", f"{where}: names both 'words' and 'rice'; send one")
        if "words" in d:
            words = d["words"]
            if not isinstance(words, np.ndarray) or words.dtype != np.uint32 or words.ndim != 1:
                raise refused("bad_dtype", f"{where}: words must be a 1-D uint32 array")
            try:
                codec.unpack_words(words, s.size)
            except codec.CodecError as exc:
                raise refused("bad_request", f"{where}: {exc}") from None
        elif "rice" in d:
            rice = d["rice"]
            if not isinstance(rice, np.ndarray) or rice.dtype != np.uint8 or rice.ndim != 1:
                raise refused("bad_dtype", f"{where}: rice must be a 1-D uint8 array")
            for f in ("n", "k"):
                v = d.get(f)
                if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
                    raise refused("bad_request", f"{where}: {f} must be an int >= 0")
            if d["n"] > s.size:
                raise refused("bad_request", f"{where}: {d['n']} elements for a shard of {s.size}")
        else:
            raise refused("bad_request", f"{where} needs 'words' or 'rice' (+ 'n', 'k')")


def rows(ids: np.ndarray, grads: Any, dim: int | None) -> np.ndarray:
    """Row gradients for `ids` (already as_ids), checked: float32 [len(ids), dim], bounded."""
    g = _float32("grads", grads)
    if g.ndim != 2 or g.shape[0] != len(ids) or (dim is not None and g.shape[1] != dim):
        want = f"[{len(ids)}, {'dim' if dim is None else dim}]"
        raise refused("bad_shape", f"grads must be {want} = [len(ids), dim], got {list(g.shape)}")
    bounded("grads", g)
    return g
