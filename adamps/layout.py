"""Tensors -> shards -> buckets: the one mapping every role shares (Project Adam 3.3.1).

A model is an ordered list of named float32 tensors. Each tensor is cut into contiguous shards of at
most ``max_shard_elems`` elements (1 MB of float32 by default). A tensor of two or more dimensions is
cut on whole slices of its first axis ("rows"), so that the server holding a shard of a fully
connected layer's M x N weight holds whole rows and can compute its row block of ``e.T @ a`` from
activation and error vectors. Only when one row alone exceeds the limit is the flat array cut, and
such shards are flagged ``rows_aligned = False``.

Shards are hashed with a stable hash (blake2b of the shard id, never Python's salted ``hash``) into
a fixed number of buckets, so every process derives the same buckets. Pure code: no IO, no clock.

Placement groups (tensor fusion placed like Redis Cluster's hash tags): a tensor named
``PREFIX{TAG}REST`` belongs to group ``PREFIX{TAG}``, and every shard of every tensor of that
group is hashed by the group's name, so the group shares one bucket (and one owner thread on its
servers). A small model's tensors packed into few groups (:func:`pack_groups`, which
``adamps.torch`` applies) make a push round a few bucket rounds of two-phase commit instead of
one per tensor. The group is part of the name, so every role derives the bucket from the shard
id alone; a name without braces is placed exactly as before groups existed.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_SHARD_ELEMS = 262_144  # 1 MB of float32 (Adam 3.3.1)
DEFAULT_BUCKETS = 64

#: a tensor name: an optional placement group "PREFIX{TAG}" (the tag without '.', so that a run's
#: ".." stays unambiguous), then 1-128 characters; a vector's "@v" after it. Fullmatch, not "$".
_NAME_RE = re.compile(
    r"(?:[A-Za-z0-9_.\-]{0,128}\{[A-Za-z0-9_\-]{1,32}\})?"
    r"[A-Za-z0-9_.\-]{1,128}(@[A-Za-z0-9_.\-]{1,64})?"
)
#: separates a tensor's name from the name of a vector stored beside it: tensor "w@g" is vector
#: "g" of tensor "w" (Sandblaster, adamps/server/api/vecops.py), placed shard by shard with "w"
VECTOR_SEP = "@"


class LayoutError(ValueError):
    """An invalid tensor spec or layout argument."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if (
            not isinstance(self.name, str)
            or not _NAME_RE.fullmatch(self.name)
            or len(ungrouped(self.name).partition(VECTOR_SEP)[0]) > 128  # as without a group
        ):
            raise LayoutError(
                f"tensor name {self.name!r:.300} must be 1-128 characters of letters, digits, "
                "'_', '.', '-', optionally after a placement group 'PREFIX{TAG}' (TAG: 1-32 "
                "letters, digits, '_', '-')"
            )
        shape = tuple(self.shape)
        if not shape or not all(isinstance(s, int) and s > 0 for s in shape):
            raise LayoutError(
                f"tensor {self.name!r}: shape must be positive ints, got {self.shape!r}"
            )
        object.__setattr__(self, "shape", shape)
        if self.dtype != "float32":
            raise LayoutError(f"tensor {self.name!r}: only float32 tensors are supported")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def row_size(self) -> int:
        """Elements per slice of the first axis (1 for a vector)."""
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorSpec:
        return cls(d["name"], tuple(d["shape"]), d.get("dtype", "float32"))


@dataclass(frozen=True)
class Shard:
    """A contiguous range [start, stop) of a tensor's flattened (C-order) elements."""

    tensor: str
    index: int
    start: int
    stop: int
    #: the shard covers whole rows [row_start, row_stop) of the first axis
    rows_aligned: bool
    row_start: int
    row_stop: int
    #: shape of the shard's values: (rows, *shape[1:]) when rows_aligned, else (size,)
    shape: tuple[int, ...] = field(compare=False)

    @functools.cached_property
    def id(self) -> str:
        # Cached (in the instance's __dict__, which a frozen dataclass still has): clients and
        # servers ask for it dozens of times per push (issue 27).
        return shard_id(self.tensor, self.index)

    @property
    def size(self) -> int:
        return self.stop - self.start


def shard_id(tensor: str, index: int) -> str:
    return f"{tensor}/{index}"


def parse_shard_id(sid: str) -> tuple[str, int]:
    tensor, sep, idx = sid.rpartition("/")
    if not sep or not idx.isdigit():
        raise LayoutError(f"shard id {sid!r} must look like '<tensor>/<index>'")
    return tensor, int(idx)


#: a shard of partition k of K of a model (trainer/partition.py names its tensors so)
_PARTITION_RE = re.compile(r"-p([0-9]+)of([0-9]+)\.[^/]*/[0-9]+\Z")


def _vector_base(sid: str) -> str:
    """A vector's shard "w@v/i" stands for the base tensor's shard "w/i"."""
    if VECTOR_SEP not in sid:  # most ids: one scan, no partition (a layout holds millions)
        return sid
    tensor, sep, rest = sid.partition(VECTOR_SEP)
    if not sep:
        return sid
    return tensor + rest[rest.rfind("/") :] if "/" in rest else tensor


def group_of(name: str) -> str | None:
    """The placement group of a tensor name or shard id ("PREFIX{TAG}"), None without one."""
    close = name.find("}")
    if close < 0:
        return None
    opened = name.rfind("{", 0, close)
    return name[: close + 1] if opened >= 0 else None


def ungrouped(name: str) -> str:
    """`name` without its group's tag: "run..{0}fc.weight" -> "run..fc.weight"."""
    group = group_of(name)
    if group is None:
        return name
    return group[: group.rfind("{")] + name[len(group) :]


def grouped(name: str, tag: str, prefix_len: int = 0) -> str:
    """`name` with the group tag `tag` inserted after its first `prefix_len` characters (a
    run's namespace "RUN..", whose tensors the group then stays within)."""
    return f"{name[:prefix_len]}{{{tag}}}{name[prefix_len:]}"


def placement_key(sid: str) -> str:
    """What a shard id is hashed by: itself, except that a vector's shard "w@v/i" goes with the
    base tensor's shard "w/i" (same bucket, same owner thread), so that vector operations are
    local to one thread of one server; and a shard of a grouped tensor ("P{T}w/i", also as a
    vector's base) is hashed by its group "P{T}", so that the group shares one bucket."""
    key = _vector_base(sid)
    if "}" not in key:
        return key
    group = group_of(key)
    return key if group is None else group


def stable_bucket(key: str, n_buckets: int) -> int:
    """The bucket of a shard id: the same in every process, Python version and machine.

    A vector's shard goes with its base tensor's shard, a grouped tensor's shard with its group
    (`placement_key`). The shards of a model partition's tensors (``<layer>-p<k>of<K>.<w|b>``)
    go to buckets congruent to k modulo K, so each partition of a replica has buckets of its own
    (Adam 4.4.2: a machine talks only to its partition's parameter-server shards); with fewer
    buckets than partitions they hash like any other shard. A group within one partition stays
    in one of its buckets (the partition from the name, the hash from the group)."""
    base = _vector_base(key)
    key = base if "}" not in base else placement_key(base)
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    m = _PARTITION_RE.search(base)
    if m is not None:
        k, parts = int(m[1]), int(m[2])
        if 0 <= k < parts <= n_buckets:
            return k + parts * (h % (n_buckets // parts))
    return h % n_buckets


def pack_groups(
    sizes: Sequence[int],
    max_elems: int = MAX_SHARD_ELEMS,
    tensors: Sequence[int] | None = None,
) -> list[int | None]:
    """Placement groups for tensors of `sizes` (elements, in model order): each tensor's group
    number, or None to leave it ungrouped. Deterministic from the sizes and their order alone,
    so every replica (restarted, resumed) derives the same groups.

    First fit in order: a tensor of at most `max_elems` (one shard) joins the first group with
    room for it, else opens the next, so no group holds more than one shard's elements (a
    bucket's load stays what one shard is today). Larger tensors span several shards, already
    spread over buckets: they stay ungrouped, as does a group of one tensor (alone it gains
    nothing and would only change its name). `tensors`: how many tensors each item is (the
    numpy engine packs layers, a weight and a bias each); default one."""
    room: list[int] = []
    group: list[int | None] = []
    for n in sizes:
        if n > max_elems:
            group.append(None)
            continue
        g = next((i for i, r in enumerate(room) if r >= n), len(room))
        if g == len(room):
            room.append(max_elems)
        room[g] -= n
        group.append(g)
    counts = [1] * len(sizes) if tensors is None else list(tensors)
    members = [0] * len(room)
    for g, c in zip(group, counts, strict=True):
        if g is not None:
            members[g] += c
    kept = [g for g in range(len(room)) if members[g] > 1]
    renumber = {g: i for i, g in enumerate(kept)}
    return [renumber.get(g) if g is not None else None for g in group]


def split_tensor(spec: TensorSpec, max_elems: int = MAX_SHARD_ELEMS) -> list[Shard]:
    """The shards of one tensor, in order; together they cover every element exactly once."""
    if max_elems <= 0:
        raise LayoutError(f"max_shard_elems must be > 0, got {max_elems}")
    shards: list[Shard] = []
    rest = spec.shape[1:]
    if len(spec.shape) > 1 and spec.row_size <= max_elems:
        rows_per = max(1, max_elems // spec.row_size)
        n_rows = spec.shape[0]
        for i, r0 in enumerate(range(0, n_rows, rows_per)):
            r1 = min(n_rows, r0 + rows_per)
            shards.append(
                Shard(
                    spec.name,
                    i,
                    r0 * spec.row_size,
                    r1 * spec.row_size,
                    True,
                    r0,
                    r1,
                    (r1 - r0, *rest),
                )
            )
        return shards
    # A vector, or rows too long for one shard: cut the flat array.
    for i, s0 in enumerate(range(0, spec.size, max_elems)):
        s1 = min(spec.size, s0 + max_elems)
        if len(spec.shape) == 1:
            shards.append(Shard(spec.name, i, s0, s1, True, s0, s1, (s1 - s0,)))
        else:
            r0, r1 = s0 // spec.row_size, -(-s1 // spec.row_size)
            shards.append(Shard(spec.name, i, s0, s1, False, r0, r1, (s1 - s0,)))
    return shards


class Layout:
    """The shards and buckets of a model. Immutable after construction."""

    def __init__(
        self,
        tensors: Iterable[TensorSpec],
        n_buckets: int = DEFAULT_BUCKETS,
        max_shard_elems: int = MAX_SHARD_ELEMS,
    ) -> None:
        if not isinstance(n_buckets, int) or n_buckets <= 0:
            raise LayoutError(f"n_buckets must be a positive int, got {n_buckets!r}")
        self.n_buckets = n_buckets
        self.max_shard_elems = max_shard_elems
        #: name -> spec, in model order
        self.tensors: dict[str, TensorSpec] = {}
        #: name -> its shards in order
        self.shards_of: dict[str, list[Shard]] = {}
        #: shard id -> shard
        self.shards: dict[str, Shard] = {}
        #: shard id -> bucket
        self.bucket_of: dict[str, int] = {}
        for spec in tensors:
            self._add(spec)

    def _add(self, spec: TensorSpec) -> None:
        if spec.name in self.tensors:
            raise LayoutError(f"duplicate tensor name {spec.name!r}")
        self.tensors[spec.name] = spec
        shards = split_tensor(spec, self.max_shard_elems)
        self.shards_of[spec.name] = shards
        for s in shards:
            self.shards[s.id] = s
            self.bucket_of[s.id] = stable_bucket(s.id, self.n_buckets)

    def with_tensor(self, spec: TensorSpec) -> Layout:
        """A new layout with one more tensor (same bucket count and shard size); this one if
        it holds `spec` already (another tensor of that name is a LayoutError)."""
        return self.with_tensors([spec])

    def with_tensors(self, specs: Iterable[TensorSpec]) -> Layout:
        """`with_tensor` of several, built once: a layout per tensor rebuilt the whole model
        each time (500 tensors one by one: 2.7 s; at once: 0.01 s)."""
        new = [s for s in specs if self.tensors.get(s.name) != s]
        if not new:
            return self
        return Layout([*self.tensors.values(), *new], self.n_buckets, self.max_shard_elems)

    def shards_in_bucket(self, bucket: int) -> list[Shard]:
        return [self.shards[sid] for sid, b in self.bucket_of.items() if b == bucket]

    def buckets_of_tensor(self, name: str) -> set[int]:
        return {self.bucket_of[s.id] for s in self.shards_of[name]}

    # -- values ------------------------------------------------------------------------------

    def split(self, name: str, values: np.ndarray) -> list[np.ndarray]:
        """Views of `values` (the whole tensor) per shard, in shard order. No copy."""
        spec = self.tensors[name]
        if values.shape != spec.shape:
            raise LayoutError(
                f"tensor {name!r} has shape {list(spec.shape)}, got {list(values.shape)}"
            )
        flat = values.reshape(-1)
        return [flat[s.start : s.stop].reshape(s.shape) for s in self.shards_of[name]]

    def join(
        self, name: str, parts: Sequence[np.ndarray], out: np.ndarray | None = None
    ) -> np.ndarray:
        """The whole tensor from its shards' values (in shard order)."""
        spec = self.tensors[name]
        shards = self.shards_of[name]
        if len(parts) != len(shards):
            raise LayoutError(f"tensor {name!r} has {len(shards)} shards, got {len(parts)} parts")
        if out is None:
            out = np.empty(spec.shape, dtype=np.float32)
        flat = out.reshape(-1)
        for s, p in zip(shards, parts, strict=True):
            if p.size != s.size:
                raise LayoutError(f"shard {s.id} has {s.size} elements, got {p.size}")
            flat[s.start : s.stop] = p.reshape(-1)
        return out

    # -- serialisation (the controller replicates this) --------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_buckets": self.n_buckets,
            "max_shard_elems": self.max_shard_elems,
            "tensors": [t.to_dict() for t in self.tensors.values()],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Layout:
        try:
            return cls(
                [TensorSpec.from_dict(t) for t in d["tensors"]],
                int(d.get("n_buckets", DEFAULT_BUCKETS)),
                int(d.get("max_shard_elems", MAX_SHARD_ELEMS)),
            )
        except (KeyError, TypeError) as exc:
            raise LayoutError(f"bad layout description: {exc}") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"Layout({len(self.tensors)} tensors, {len(self.shards)} shards, {self.n_buckets} buckets)"
