"""Sparse embedding tables: the pure parts every role shares (issue 23).

A table is named like a tensor, has a row width ``dim`` and no declared size: its rows are keyed
by int64 ids. Each id hashes to one of the layout's buckets (the same fixed buckets as shards),
so the controllers' leases, replication, failover, drain and rebalance apply to rows unchanged:
a bucket's rows of table ``T`` are held, replicated and persisted as one row shard,
``T#rows/<bucket>`` (`row_shard_id`).

Two stable functions, the same in every process, Python version and machine (never Python's
salted ``hash``), both vectorised over an id array:

- `buckets_of(ids, n)`: SplitMix64 of the id, modulo the bucket count;
- `initial_rows(init, ids, dim)`: a row's initial value is a function of (table seed, id) only.
  The generator is counter based: element j of row `id` is SplitMix64 of
  (key(seed, id) + (j + 1) * golden), as Philox is a keyed counter generator, but keyed per
  row in one vectorised pass (numpy's Philox takes one key per generator: one generator per
  new row would cost ~10 us each). So every copy of a bucket creates a row with the same value
  without shipping it, and a pull of a row not created yet returns exactly the value it will
  be created with.

Pure code: no IO, no clock.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adamps import rowdtype

#: separates a table's name from its bucket in a row shard id
ROWS_SEP = "#rows/"
#: widest row a table may have (float32 elements)
MAX_DIM = 4096
#: widest frequency sketch (counters per hash row): 16 * this bytes per bucket, 16 MiB (was
#: 2^24, 256 MiB per bucket: issue 39)
MAX_FILTER_WIDTH = 1 << 20
#: init kinds of a table's rows
ROW_INIT_KINDS = ("zeros", "constant", "uniform", "normal")
#: what a push that would create rows beyond the limit gets (docs/protocol-ps.md, "Tables")
ON_FULL = ("reject", "drop")

_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,128}")  # fullmatch: "$" lets a final "\n" in
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
#: mixed into the id before the bucket hash, so that buckets and init draws are independent
_BUCKET_SALT = np.uint64(0x5BD1E9955BD1E995)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)


class TableError(ValueError):
    """An invalid table definition."""


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of uint64 counters (Steele, Lea, Flood 2014), vectorised.
    uint64 array arithmetic wraps modulo 2^64, as the algorithm needs."""
    # in place on the one new array: a row's create runs it on a few ids, where each
    # temporary's allocation cost as much as its arithmetic (issue 36)
    z = np.add(np.asarray(x, dtype=np.uint64), _GOLDEN)
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


def buckets_of(ids: np.ndarray, n_buckets: int) -> np.ndarray:
    """The bucket of each id (int64 array -> int64 array of the same shape)."""
    u = np.asarray(ids, dtype=np.int64).view(np.uint64)
    return (splitmix64(u ^ _BUCKET_SALT) % np.uint64(n_buckets)).astype(np.int64)


def row_shard_id(table: str, bucket: int) -> str:
    return f"{table}{ROWS_SEP}{bucket}"


def parse_row_shard_id(sid: str) -> tuple[str, int] | None:
    """(table, bucket) of a row shard id, or None for any other id."""
    table, sep, b = sid.rpartition(ROWS_SEP)
    if not sep or not b.isdigit():
        return None
    return table, int(b)


def _uniform01(keys: np.ndarray, dim: int, offset: int) -> np.ndarray:
    """[len(keys), dim] float64 uniforms in [0, 1): counter j + offset of each key."""
    j = np.arange(offset + 1, offset + dim + 1, dtype=np.uint64)
    bits = splitmix64(keys[:, None] + j[None, :] * _GOLDEN)
    bits >>= _S11
    u = bits.astype(np.float64)
    u *= 1.0 / (1 << 53)
    return u


#: rows of `initial_rows` computed at a time: its float64 temporaries (a few per element) stay
#: in the CPU's cache, where whole-array passes over 100,000 rows went through memory (a bulk
#: load's largest cost on every copy: docs/benchmarks-history.md, issue 38)
INIT_CHUNK_ROWS = 4096


def initial_rows(init: Mapping[str, Any], ids: np.ndarray, dim: int) -> np.ndarray:
    """The initial values of rows `ids` ([len(ids), dim] float32) under the canonical `init`
    (`normalize_row_init`): a function of (seed, id) only."""
    ids = np.asarray(ids, dtype=np.int64)
    kind = init["kind"]
    n = len(ids)
    if kind == "zeros":
        return np.zeros((n, dim), np.float32)
    if kind == "constant":
        return np.full((n, dim), init["value"], np.float32)
    out = np.empty((n, dim), np.float32)
    step = max(1, INIT_CHUNK_ROWS * 16 // max(dim, 1))
    for s in range(0, n, step):
        out[s : s + step] = _drawn_rows(init, ids[s : s + step], dim)
    return out


def _drawn_rows(init: Mapping[str, Any], ids: np.ndarray, dim: int) -> np.ndarray:
    """`initial_rows` of a uniform or normal init, for a chunk of ids."""
    seed = np.uint64(int(init["seed"]) & 0xFFFFFFFFFFFFFFFF)
    keys = splitmix64(splitmix64(ids.view(np.uint64)) ^ seed)
    if init["kind"] == "uniform":
        u = _uniform01(keys, dim, 0)
        return (init["low"] + (init["high"] - init["low"]) * u).astype(np.float32)
    # normal: Box-Muller on two independent counter streams, counters 1..dim and dim+1..2dim
    # of each key, drawn in one pass (the same bits as two: issue 36, a row's create is a few
    # ids per bucket, where each numpy call's fixed cost outweighs its arithmetic)
    u = _uniform01(keys, 2 * dim, 0)
    u1, u2 = u[:, :dim], u[:, dim:]
    z = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * math.pi * u2)
    return (init["mean"] + init["std"] * z).astype(np.float32)


def _number(d: Mapping[str, Any], name: str, default: float) -> float:
    v = d.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise TableError(f"init {name} must be a finite number, got {v!r}")
    if abs(v) > 1e6:
        raise TableError(f"init {name} must be at most 1e6 in magnitude, got {v!r}")
    return float(v)


def normalize_row_init(init: Mapping[str, Any]) -> dict[str, Any]:
    """A checked, canonical init description of a table's rows (what create_table compares)."""
    if not isinstance(init, Mapping):
        raise TableError(f"init must be a map, got {type(init).__name__}")
    kind = init.get("kind")
    if kind not in ROW_INIT_KINDS:
        raise TableError(f"init kind must be one of {list(ROW_INIT_KINDS)}, got {kind!r}")
    allowed = {
        "zeros": set(),
        "constant": {"value"},
        "uniform": {"low", "high", "seed"},
        "normal": {"mean", "std", "seed"},
    }[kind]
    unknown = set(init) - allowed - {"kind"}
    if unknown:
        raise TableError(f"unknown field(s) {sorted(unknown)} for init kind {kind!r}")
    out: dict[str, Any] = {"kind": kind}
    defaults = {"value": 0.0, "low": -0.05, "high": 0.05, "mean": 0.0, "std": 0.01}
    for name in sorted(allowed - {"seed"}):
        out[name] = _number(init, name, defaults[name])
    if "seed" in allowed:
        seed = init.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63:
            raise TableError(f"init seed must be an int in [0, 2^63), got {seed!r}")
        out["seed"] = seed
    if kind == "uniform" and not out["low"] < out["high"]:
        raise TableError(f"uniform init needs low < high, got {out['low']} and {out['high']}")
    if kind == "normal" and out["std"] < 0:
        raise TableError(f"normal init needs std >= 0, got {out['std']}")
    return out


@dataclass(frozen=True)
class Admission:
    """Memory and admission of a table (Monolith's): a row limit, a frequency filter, expiry.

    Every decision is made by every copy of a bucket from the same batches (the time of a push
    is the primary's, carried in the batch), so copies agree without coordination."""

    #: most rows of the whole table; each bucket holds at most ceil(max_rows / n_buckets)
    #: (a per-bucket share: a bucket's copies decide alone). None: no limit
    max_rows: int | None = None
    #: at the limit: "reject" (the push gets table_full, nothing changes) or "drop" (the new
    #: ids' gradients are dropped, counted in adamps_table_rows_dropped_total)
    on_full: str = "reject"
    #: an id gets a row only at its admit_after-th push (1: at the first)
    admit_after: int = 1
    #: rows not pushed for this many seconds are removed (None: never)
    expire_after: float | None = None
    #: counters per row of each bucket's frequency sketch (adamps/server/store/tables/freqsketch.py: 4 rows,
    #: 16 * filter_width bytes per bucket, only with admit_after > 1)
    filter_width: int = 4096

    def __post_init__(self) -> None:
        if self.max_rows is not None and (
            isinstance(self.max_rows, bool)
            or not isinstance(self.max_rows, int)
            or not 1 <= self.max_rows <= 1 << 40
        ):
            raise TableError(f"max_rows must be an int in [1, 2^40] or null, got {self.max_rows!r}")
        if self.on_full not in ON_FULL:
            raise TableError(f"on_full must be one of {list(ON_FULL)}, got {self.on_full!r}")
        if (
            isinstance(self.admit_after, bool)
            or not isinstance(self.admit_after, int)
            or not 1 <= self.admit_after <= 1 << 20
        ):
            raise TableError(f"admit_after must be an int in [1, 2^20], got {self.admit_after!r}")
        w = self.filter_width
        if isinstance(w, bool) or not isinstance(w, int) or not 64 <= w <= MAX_FILTER_WIDTH:
            raise TableError(
                f"filter_width must be an int in [64, 2^{MAX_FILTER_WIDTH.bit_length() - 1}], "
                f"got {w!r}"
            )
        e = self.expire_after
        if e is not None and (
            isinstance(e, bool) or not isinstance(e, int | float) or not 0 < e < 1e9
        ):
            raise TableError(f"expire_after must be a number of seconds > 0 or null, got {e!r}")

    def bucket_limit(self, n_buckets: int) -> int | None:
        return None if self.max_rows is None else -(-self.max_rows // n_buckets)

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_rows": self.max_rows,
            "on_full": self.on_full,
            "admit_after": self.admit_after,
            "expire_after": None if self.expire_after is None else float(self.expire_after),
            "filter_width": self.filter_width,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Admission:
        if not isinstance(d, Mapping):
            raise TableError(f"admission must be a map, got {type(d).__name__}")
        unknown = set(d) - {"max_rows", "on_full", "admit_after", "expire_after", "filter_width"}
        if unknown:
            raise TableError(f"unknown admission field(s) {sorted(unknown)}")
        return cls(**dict(d))


@dataclass(frozen=True)
class TableSpec:
    """A table's definition: what create_table compares for idempotence."""

    name: str
    dim: int
    #: canonical row init (normalize_row_init)
    init: dict[str, Any] = field(default_factory=lambda: {"kind": "zeros"})
    #: the optimizer description (adamps.server.updates.optim.Optimizer.to_dict)
    optimizer: dict[str, Any] = field(default_factory=lambda: {"kind": "sgd", "lr": 0.01})
    admission: Admission = field(default_factory=Admission)
    #: how the rows' values are stored (rowdtype.py): float32, float16 or bfloat16
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise TableError(
                f"table name {self.name!r} must be 1-128 characters of letters, digits, '_', '.', '-'"
            )
        if (
            isinstance(self.dim, bool)
            or not isinstance(self.dim, int)
            or not 1 <= self.dim <= MAX_DIM
        ):
            raise TableError(
                f"table {self.name!r}: dim must be an int in [1, {MAX_DIM}], got {self.dim!r}"
            )
        try:
            rowdtype.check(self.dtype)
        except ValueError as exc:
            raise TableError(f"table {self.name!r}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dim": self.dim,
            "init": dict(self.init),
            "optimizer": dict(self.optimizer),
            "admission": self.admission.to_dict(),
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TableSpec:
        try:
            return cls(
                d["name"],
                d["dim"],
                normalize_row_init(d.get("init", {"kind": "zeros"})),
                dict(d.get("optimizer", {"kind": "sgd", "lr": 0.01})),
                Admission.from_dict(d.get("admission", {})),
                d.get("dtype", "float32"),
            )
        except (KeyError, TypeError) as exc:
            raise TableError(f"bad table description: {exc}") from None


def split_by_bucket(ids: np.ndarray, n_buckets: int) -> dict[int, np.ndarray]:
    """bucket -> positions in `ids` of that bucket's ids (in order)."""
    b = buckets_of(ids, n_buckets)
    # numpy's stable sort of 16-bit keys is a radix sort: 5x faster than on int64 here.
    order = np.argsort(b.astype(np.uint16) if n_buckets <= 1 << 16 else b, kind="stable")
    counts = np.bincount(b, minlength=n_buckets)
    ends = np.cumsum(counts).tolist()
    return {
        bucket: order[ends[bucket] - counts[bucket] : ends[bucket]]
        for bucket in np.flatnonzero(counts).tolist()
    }
