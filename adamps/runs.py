"""Runs (issue 25): a training run's namespace, token and quotas. Pure: no IO, no clock.

A run is a record the controllers hold (``controller/run_ops.py``); its token is shown once, at
create, and only its SHA-256 is kept (in the Raft state, and on the servers that learn it): a
copy of the state, a dump or a ``/runs`` reply never lets anyone act as the run. The token is 32
random bytes, so a plain hash is enough (nothing to brute-force, unlike a password).

Every tensor, table and board key of run ``R`` is named ``R..<name>``: the separator of
``adamps.torch.params``. A run's name has no ``.``, so ``R..`` is never the start of another run's
namespace (``a..x`` cannot belong to run ``a.``, which cannot exist).

Who may do what: the cluster token is the operator's (everything); a run's token reads and writes
names in its namespace only, and calls no admin endpoint. The helpers here decide; the shells
(``adamps/server/api/tenancy.py``, ``controller/runs_http.py``) answer.
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

SEP = ".."
#: a run's name: no '.', so that one namespace never starts another's
NAME_RE = re.compile(r"[A-Za-z0-9_\-]{1,64}")
#: the quotas a run may have; None (or absent): no limit
QUOTAS = ("param_elems", "table_rows", "memory_bytes", "push_bytes_per_s")
#: the quotas on what a run's definitions hold: counted by the controllers across servers
SIZE_QUOTAS = ("param_elems", "table_rows", "memory_bytes")
#: most tensors and tables one run may define (a bound on its usage record in the Raft state)
MAX_RUN_NAMES = 4096
#: consistency modes a run may name (the elastic helper's servers enforce them)
CONSISTENCY_RE = re.compile(r"async|sync|ssp:[0-9]{1,6}")
#: most runs the controllers keep (a bound on the Raft state and on every server's table)
MAX_RUNS = 1024


class RunError(ValueError):
    """A bad run name, quota or consistency mode (the message names the value and what is
    expected)."""


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise RunError(f"a run's name must be 1-64 letters, digits, '_' or '-', got {name!r}")
    return name


def namespace(run: str) -> str:
    """The prefix of every name of run `run`."""
    return f"{run}{SEP}"


def in_namespace(name: str, run: str) -> bool:
    return name.startswith(namespace(run)) and len(name) > len(namespace(run))


def run_of(name: str) -> str | None:
    """The run whose namespace holds `name` (None: no run's; the operator's). A shard id
    ``tensor/i`` and a vector ``tensor@v`` belong to their tensor's run."""
    head, sep, _rest = name.partition(SEP)
    return head if sep and NAME_RE.fullmatch(head) else None


def new_token(run: str) -> str:
    """A fresh token for `run` (shown once; the controllers keep only its hash)."""
    return f"adamps-run-{run}-{secrets.token_hex(32)}"


def token_hash(token: str) -> str:
    return hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).hexdigest()


def check_quotas(raw: Any) -> dict[str, float | int]:
    """The quotas of a create request: a map of some of QUOTAS to positive numbers."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RunError(f"quotas must be a map of {list(QUOTAS)} to numbers, got {raw!r:.80}")
    out: dict[str, float | int] = {}
    for k, v in raw.items():
        if k not in QUOTAS:
            raise RunError(f"unknown quota {k!r}; expected one of {list(QUOTAS)}")
        if v is None:
            continue
        integral = k != "push_bytes_per_s"
        ok_type = isinstance(v, int) if integral else isinstance(v, int | float)
        if isinstance(v, bool) or not ok_type or not math.isfinite(v) or not 0 < v <= 1 << 50:
            kind = "an integer" if integral else "a number"
            raise RunError(f"quota {k} must be {kind} in (0, 2^50], got {v!r}")
        out[k] = int(v) if integral else float(v)
    return out


def tensor_cost(n_elems: int, state_elems: int) -> dict[str, int]:
    """What a tensor of `n_elems` float32 elements holds on each server with a copy: its
    values and its optimizer's `state_elems` float32 (Optimizer.state_size: none for SGD,
    as many for Adagrad, three times as many for Adam with amsgrad)."""
    return {"param_elems": n_elems, "memory_bytes": 4 * (n_elems + state_elems)}


#: bytes a table row holds besides its values and accumulators: its id and last push time
ROW_OVERHEAD = 16
#: bytes per bucket of a frequency sketch, per unit of filter_width (4 rows of uint32)
SKETCH_BYTES_PER_WIDTH = 16


def table_cost(
    max_rows: int | None,
    dim: int,
    state_width: int,
    filter_width: int | None,
    n_buckets: int,
    value_bytes: int = 4,
) -> dict[str, int] | None:
    """What a table holds at most on a server with a copy of every bucket: `max_rows` rows
    (values, the optimizer's `state_width` float32 per row (Optimizer.row_state_width), id and
    time) and, with a frequency filter (`filter_width`, None
    without), one sketch per bucket. `value_bytes`: 2 for a 16-bit table's values (its ``dtype``,
    adamps/rowdtype.py). None: unbounded (no max_rows)."""
    if max_rows is None:
        return None
    per_row = value_bytes * dim + 4 * state_width + ROW_OVERHEAD
    sketch = 0 if filter_width is None else n_buckets * SKETCH_BYTES_PER_WIDTH * filter_width
    return {"table_rows": max_rows, "memory_bytes": max_rows * per_row + sketch}


def over_quota(
    usage: dict[str, dict[str, int]], name: str, cost: dict[str, int], quotas: dict[str, Any]
) -> tuple[str, int, int] | None:
    """(quota, limit, total asked) of the first size quota that `name` at `cost` would exceed,
    beside the run's other definitions in `usage` (name -> cost); None if it fits."""
    for q in SIZE_QUOTAS:
        limit = quotas.get(q)
        if limit is None:
            continue
        total = cost.get(q, 0) + sum(c.get(q, 0) for n, c in usage.items() if n != name)
        if total > limit:
            return q, int(limit), total
    return None


def check_consistency(mode: Any) -> str:
    if mode is None:
        return "async"
    if not isinstance(mode, str) or not CONSISTENCY_RE.fullmatch(mode):
        raise RunError(
            f"consistency must be 'async', 'sync' or 'ssp:S' (S an integer >= 0), got {mode!r}"
        )
    return mode


@dataclass(frozen=True)
class Principal:
    """Who a request is: the operator (run None: the cluster token) or a run's token."""

    run: str | None = None

    @property
    def operator(self) -> bool:
        return self.run is None

    def outside(self, names: list[str]) -> str | None:
        """The first of `names` outside this principal's namespace (None: all inside)."""
        if self.run is None:
            return None
        for n in names:
            if not isinstance(n, str) or run_of(n) != self.run:
                return n if isinstance(n, str) else repr(n)
        return None


@dataclass
class PushRate:
    """A push-bytes-per-second quota: a token bucket in debt form. A push is admitted while the
    balance is not negative, and its bytes are then taken (the balance may go below zero), so a
    push larger than one second's allowance still passes, and the long-run rate stays at
    `rate` plus one second's burst. Time is an argument (monotonic seconds)."""

    rate: float
    #: bytes that may be spent now (at most one second's worth)
    balance: float = 0.0
    at: float | None = None

    def take(self, nbytes: int, now: float) -> float:
        """0.0 if the push is admitted (its bytes are spent), else the seconds until one is."""
        if self.at is None:
            self.balance, self.at = self.rate, now
        self.balance = min(self.rate, self.balance + (now - self.at) * self.rate)
        self.at = max(self.at, now)
        if self.balance < 0:
            return -self.balance / self.rate
        self.balance -= nbytes
        return 0.0
