"""Checking compressed shard updates (``push_compressed``, docs/protocol-ps.md) into optimizer
updates: the one place that turns a shard's wire map (words or Golomb-Rice bytes) into
:class:`adamps.server.optim.Signs`, for the push op and for replicated batches alike."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from adamps import codec
from adamps.protocol import ALLOWED_DTYPES, ProtocolError
from adamps.server.bounds import MAX_GRAD
from adamps.server.optim import Signs


def _tau(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError("bad_request", f"{where}: tau must be a number")
    tau = float(value)
    if not math.isfinite(tau):
        raise ProtocolError("non_finite", f"{where}: tau is {tau}")
    if tau <= 0:
        raise ProtocolError("bad_request", f"{where}: tau must be > 0, got {tau}")
    # Every sent element is +-tau: the gradient bound of a dense push applies to tau itself
    # (issue 28: tau = 1e39 is finite as a double but inf as float32; 1e30 overflowed later).
    if tau > MAX_GRAD:
        raise ProtocolError(
            "bad_request",
            f"{where}: tau {tau:.3g} exceeds {MAX_GRAD:.0e}: values this large could overflow "
            "float32 (docs/protocol-ps.md, 'Finite values')",
            limit=MAX_GRAD,
        )
    return tau


def _int(d: Mapping[str, Any], name: str, where: str) -> int:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError("bad_request", f"{where}: field {name!r} must be an int")
    return v


def _array(d: Mapping[str, Any], name: str, dtype: str, where: str) -> np.ndarray:
    arr = d.get(name)
    if not isinstance(arr, np.ndarray):
        raise ProtocolError("bad_request", f"{where}: field {name!r} must be an array")
    if arr.dtype != ALLOWED_DTYPES[dtype]:
        raise ProtocolError(
            "bad_dtype", f"{where}: field {name!r} must be {dtype}, got {arr.dtype.name}"
        )
    if arr.ndim != 1:
        raise ProtocolError("bad_shape", f"{where}: field {name!r} must be 1-D")
    return arr


def words_of(d: Any, size: int, where: str) -> tuple[np.ndarray, float]:
    """(checked uint32 words, tau) of one shard's compressed update in its client form
    ``{"tau", "words"}`` or ``{"tau", "n", "k", "rice"}``; ProtocolError if malformed."""
    if not isinstance(d, Mapping):
        raise ProtocolError("bad_request", f"{where}: a compressed update must be a map")
    tau = _tau(d.get("tau"), where)
    try:
        if "words" in d:
            words = _array(d, "words", "uint32", where)
            codec.unpack_words(words, size)  # checks sorted, unique, in range
            return words, tau
        if "rice" in d:
            data = _array(d, "rice", "uint8", where)
            idx, neg = codec.rice_decode(data, _int(d, "n", where), _int(d, "k", where), size)
            return codec.pack_words(idx, neg), tau
    except codec.CodecError as exc:
        raise ProtocolError("bad_request", f"{where}: {exc}") from None
    raise ProtocolError("bad_request", f"{where}: needs 'words' or 'rice' (+ 'n', 'k')")


def wire_form(d: Mapping[str, Any]) -> dict[str, Any]:
    """The compact encoding a replicated batch carries (what the client sent, checked):
    ``{"w": words}`` or ``{"r": rice bytes, "n": n, "b": k}``."""
    if "words" in d:
        return {"w": d["words"]}
    return {"r": d["rice"], "n": d["n"], "b": d["k"]}


def signs_of_wire(u: Mapping[str, Any], size: int) -> Signs:
    """The optimizer update of a replicated compressed entry ``{"k": "c", "s", "t", "w" | "r"...}``
    (checked again: a secondary trusts nothing it did not validate)."""
    client_form: dict[str, Any] = {"tau": u.get("t")}
    if "w" in u:
        client_form["words"] = u["w"]
    else:
        client_form.update(rice=u.get("r"), n=u.get("n"), k=u.get("b"))
    words, tau = words_of(client_form, size, f"shard {u.get('s')!r}")
    return Signs(words, tau)
