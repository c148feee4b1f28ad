"""Bounds on what one request may make a process allocate, checked before anything is built.

Issue 12: ``PUT /layout`` with a tensor of shape [2^60] hung the controller's leader (it cut the
tensor into 2^42 shards), ``create`` of shape [2^32] tried to allocate 32 GiB. Everything here
is arithmetic on the request's numbers: no shard list, no array is built to find out that it is
too large. The limits themselves are fields of each role's config.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from adamps.layout import MAX_SHARD_ELEMS, TensorSpec
from adamps.wire.protocol import ProtocolError

#: most dimensions of a tensor
MAX_DIMS = 8

#: the highest version a restore may give a shard (``ckpt_install``'s ``n``, a manifest's
#: ``version``). A version counts updates and is a uint64 in a shard's LMDB record: an install
#: of n = 2^64 - 1 was taken, the next push made it 2^64, and the server could neither persist
#: the shard again nor answer ``describe`` (500). 2^62 updates are out of reach of any run.
MAX_VERSION = 2**62


def check_shape(shape: Any, max_elems: int, what: str = "tensor") -> tuple[int, ...]:
    """`shape` as a tuple of ints > 0 (not bool) with at most `max_elems` elements."""
    if (
        not isinstance(shape, list | tuple)
        or not 1 <= len(shape) <= MAX_DIMS
        or not all(type(s) is int and s > 0 for s in shape)
    ):
        raise ProtocolError(
            "bad_shape",
            f"{what} shape must be a list of 1..{MAX_DIMS} ints > 0, got {str(shape)[:200]}",
        )
    n = math.prod(shape)
    if n > max_elems:
        raise ProtocolError(
            "too_large",
            f"{what} of shape {list(shape)} has {n} elements; the limit is {max_elems}",
            limit=max_elems,
        )
    return tuple(shape)


def shard_count(shape: tuple[int, ...], max_shard_elems: int) -> int:
    """How many shards `layout.split_tensor` cuts a tensor of `shape` into (without cutting it)."""
    size = math.prod(shape)
    if len(shape) > 1:
        row = math.prod(shape[1:])
        if row <= max_shard_elems:
            return -(-shape[0] // max(1, max_shard_elems // row))
    return -(-size // max_shard_elems)


def check_layout(
    raw: Any,
    *,
    n_buckets: int,
    max_tensors: int,
    max_tensor_elems: int,
    max_total_elems: int,
    max_shards: int,
) -> dict[str, Any]:
    """A layout description (Layout.to_dict form) checked for types and size, not yet built."""
    if not isinstance(raw, Mapping):
        raise ProtocolError("bad_request", "layout must be an object")
    unknown = set(raw) - {"n_buckets", "max_shard_elems", "tensors"}
    if unknown:
        raise ProtocolError("bad_request", f"layout has unknown field(s) {sorted(unknown)[:10]}")
    nb = raw.get("n_buckets", n_buckets)
    mse = raw.get("max_shard_elems", MAX_SHARD_ELEMS)
    for name, v in (("n_buckets", nb), ("max_shard_elems", mse)):
        if type(v) is not int or not 1 <= v <= 1 << 31:
            raise ProtocolError("bad_request", f"layout {name} must be an int in 1..2^31")
    if nb != n_buckets:
        raise ProtocolError("conflict", f"layout has {nb} buckets, the cluster {n_buckets}")
    tensors = raw.get("tensors")
    if not isinstance(tensors, list):
        raise ProtocolError("bad_request", "layout tensors must be a list")
    if len(tensors) > max_tensors:
        raise ProtocolError(
            "too_large", f"layout has {len(tensors)} tensors; the limit is {max_tensors}"
        )
    total = shards = 0
    out = []
    for t in tensors:
        if not isinstance(t, Mapping) or set(t) - {"name", "shape", "dtype"}:
            raise ProtocolError("bad_request", "a layout tensor is {name, shape, dtype}")
        name = t.get("name")
        shape = check_shape(t.get("shape"), max_tensor_elems, f"tensor {str(name)[:130]!r}")
        try:
            spec = TensorSpec(name, shape, t.get("dtype", "float32"))  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            raise ProtocolError("bad_request", f"invalid layout: {exc}") from None
        total += spec.size
        shards += shard_count(shape, mse)
        out.append(spec.to_dict())
    if total > max_total_elems:
        raise ProtocolError(
            "too_large", f"layout holds {total} elements; the limit is {max_total_elems}"
        )
    if shards > max_shards:
        raise ProtocolError("too_large", f"layout has {shards} shards; the limit is {max_shards}")
    return {"n_buckets": nb, "max_shard_elems": mse, "tensors": out}
