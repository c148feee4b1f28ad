"""A tensor's or table's optimizer as data: its kind, hyperparameters and the layout of its state.

Pure Python (no numpy kernels), so the checkpoint tools read a state's layout without loading the
server. The kinds carry torch.optim's names, hyperparameter names and defaults, so a torch script
ports unchanged (docs/training.md, "Optimizers"):

- ``sgd`` (torch.optim.SGD: momentum, dampening, nesterov, weight_decay);
- ``adagrad`` (torch.optim.Adagrad: lr_decay, weight_decay, initial_accumulator_value, eps 1e-10
  added outside the square root);
- ``adam`` and ``adamw`` (betas, eps, weight_decay, amsgrad; bias correction by the shard's step);
- ``rmsprop`` (alpha, eps, weight_decay, momentum, centered);
- ``rowwise_adagrad`` (tables only: one accumulator per row, the mean of the squared gradient over
  the row, as TorchRec's and FBGEMM's row-wise Adagrad);
- ``sparse_adam`` (tables only: torch.optim.SparseAdam's lazy Adam, betas, eps; a row's first and
  second moments move only when the row is pushed; the bias correction counts the row's own
  pushes, kept per row, where torch counts the table's steps: the same when every step touches
  the row, see docs/training.md);
- ``adagrad_legacy``: adamps' Adagrad before torch's rule (``acc += g*g; w -= lr * g / sqrt(acc +
  eps)``, fields ``eps`` and ``initial_accumulator``). A definition of kind ``adagrad`` that names
  ``initial_accumulator`` (every definition written before the torch kinds, in LMDB or a
  checkpoint, and every create of a client of that time) is this one, so existing runs keep it.

State of a dense shard of n elements (one float32 array beside the values, replicated, flushed and
checkpointed as the accumulator always was): ``adagrad_legacy`` n elements shaped like the shard
(the old record, unchanged); the torch kinds ``slots * n`` elements (the per-element arrays one
after the other) and 2 more holding the shard's step count, a little-endian uint64 stored in their
bits (a finite float32 pattern below 2^31 steps). Plain SGD (no momentum) keeps no state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: kind -> {field: torch's default}; lr first
FIELDS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 0.01, "momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0},
    "adagrad": {
        "lr": 0.01,
        "lr_decay": 0.0,
        "weight_decay": 0.0,
        "initial_accumulator_value": 0.0,
        "eps": 1e-10,
    },
    "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False},
    "adamw": {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 1e-2,
        "amsgrad": False,
    },
    "rmsprop": {
        "lr": 0.01,
        "alpha": 0.99,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "momentum": 0.0,
        "centered": False,
    },
    "rowwise_adagrad": {"lr": 0.01, "eps": 1e-8, "weight_decay": 0.0},
    "sparse_adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8},
    "adagrad_legacy": {"lr": 0.01, "eps": 1e-8, "initial_accumulator": 0.0},
}
KINDS = tuple(FIELDS)
#: the kinds an embedding table's rows take (per row: no step count is kept)
TABLE_KINDS = ("sgd", "adagrad", "rowwise_adagrad", "sparse_adam", "adagrad_legacy")
#: the kinds only tables take (their state is per row)
ROW_ONLY_KINDS = ("rowwise_adagrad", "sparse_adam")
#: float32 elements after the per-element arrays that hold the step count (uint64)
STEP_SLOTS = 2
_BOOLS = ("nesterov", "amsgrad", "centered")


class OptimError(ValueError):
    """An invalid optimizer description."""


def _num(kind: str, name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise OptimError(f"{kind} {name} must be a finite number, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class Optimizer:
    """How a tensor's shards (or a table's rows) are updated; fixed when it is created."""

    kind: str = "sgd"
    lr: float | None = None
    #: the kind's other hyperparameters (torch's names), defaults filled in
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in FIELDS:
            raise OptimError(f"optimizer must be one of {list(KINDS)}, got {self.kind!r}")
        defaults = FIELDS[self.kind]
        unknown = set(self.params) - set(defaults)
        if unknown:
            raise OptimError(
                f"unknown field(s) {sorted(unknown)} for optimizer {self.kind!r}; "
                f"it takes {sorted(defaults)}"
            )
        p: dict[str, Any] = {}
        for name, default in defaults.items():
            if name == "lr":
                continue
            v = self.params.get(name, default)
            if name in _BOOLS:
                if not isinstance(v, bool):
                    raise OptimError(f"{self.kind} {name} must be true or false, got {v!r}")
            elif name == "betas":
                if not isinstance(v, list | tuple) or len(v) != 2:
                    raise OptimError(f"{self.kind} betas must be two numbers, got {v!r}")
                v = tuple(_num(self.kind, "betas", b) for b in v)
                if not all(0.0 <= b < 1.0 for b in v):
                    raise OptimError(f"{self.kind} betas must be in [0, 1), got {list(v)}")
            else:
                v = _num(self.kind, name, v)
            p[name] = v
        lr = _num(self.kind, "lr", defaults["lr"] if self.lr is None else self.lr)
        object.__setattr__(self, "lr", lr)
        object.__setattr__(self, "params", p)
        self._check()

    def _check(self) -> None:
        k, p = self.kind, self.params
        if k != "sgd" and self.lr < 0:  # SGD: any lr (lr = -1 adds a delta exactly)
            # 0 is torch.optim's too: a warmup or a decay schedule starts or ends at lr 0
            raise OptimError(f"{k} lr must be >= 0, got {self.lr}")
        for name in ("eps", "weight_decay", "lr_decay", "initial_accumulator_value"):
            if name in p and p[name] < 0:
                raise OptimError(f"{k} {name} must be >= 0, got {p[name]}")
        if "eps" in p and p["eps"] <= 0 and not (k == "adagrad" and p["initial_accumulator_value"]):
            # a zero eps divides 0 by 0 (a zero gradient at the first step): NaN in a shard
            raise OptimError(f"{k} eps must be > 0, got {p['eps']}")
        if k == "adagrad_legacy" and p["initial_accumulator"] < 0:
            raise OptimError("adagrad_legacy initial_accumulator must be >= 0")
        for name in ("momentum", "dampening", "alpha"):
            if name in p and not 0.0 <= p[name] <= 1.0:
                raise OptimError(f"{k} {name} must be in [0, 1], got {p[name]}")
        if k == "sgd" and p["nesterov"] and (p["momentum"] <= 0 or p["dampening"] != 0):
            raise OptimError("sgd nesterov needs a momentum > 0 and dampening 0 (as torch.optim)")
        if k == "rmsprop" and p["alpha"] >= 1:
            raise OptimError(
                f"rmsprop alpha must be < 1 (1 never learns square_avg), got {p['alpha']}"
            )

    def __getattr__(self, name: str) -> Any:  # opt.eps, opt.momentum, ...
        try:
            return self.__dict__["params"][name]
        except KeyError:
            raise AttributeError(name) from None

    # -- state layout -----------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        """Per-element state arrays of a dense shard (torch kinds; the legacy Adagrad has 1)."""
        k, p = self.kind, self.params
        if k == "sgd":
            return 1 if p["momentum"] > 0 else 0
        if k in ("adagrad", "adagrad_legacy"):
            return 1
        if k in ("adam", "adamw"):
            return 3 if p["amsgrad"] else 2
        if k == "rmsprop":
            return 1 + (p["momentum"] > 0) + p["centered"]
        return 0  # rowwise_adagrad, sparse_adam: rows only

    @property
    def has_accumulator(self) -> bool:
        """Whether a shard keeps a state array beside its values."""
        return self.slots > 0

    @property
    def legacy_layout(self) -> bool:
        """The state is shaped like the shard, without a step count (adagrad_legacy)."""
        return self.kind == "adagrad_legacy"

    def state_size(self, n: int) -> int:
        """float32 elements of the state of a dense shard of n elements (0: none)."""
        if not self.has_accumulator:
            return 0
        return n if self.legacy_layout else self.slots * n + STEP_SLOTS

    @property
    def signed_state(self) -> bool:
        """Whether the state may hold negative values (Adam's first moment, momentum buffers,
        RMSprop's centered average): only Adagrad's accumulators are sums of squares."""
        return self.kind not in ("adagrad", "adagrad_legacy", "rowwise_adagrad")

    @property
    def initial_state(self) -> float:
        """The starting value of the first state array (Adagrad's accumulator)."""
        if self.kind == "adagrad":
            return self.params["initial_accumulator_value"]
        if self.kind == "adagrad_legacy":
            return self.params["initial_accumulator"]
        return 0.0

    def row_state_width(self, dim: int) -> int:
        """float32 state elements per row of a table of `dim`: Adagrad's accumulator (dim, or 1
        row-wise); sparse_adam's exp_avg and exp_avg_sq (dim each) and the row's step count (1,
        its value: exact to 2^24 steps, after which its bias correction is 1 anyway)."""
        if self.kind in ("adagrad", "adagrad_legacy"):
            return dim
        if self.kind == "sparse_adam":
            return 2 * dim + 1
        return 1 if self.kind == "rowwise_adagrad" else 0

    def check_for_table(self) -> None:
        if self.kind not in TABLE_KINDS or (self.kind == "sgd" and self.slots):
            raise OptimError(
                f"a table's optimizer must be one of {list(TABLE_KINDS)} (sgd without momentum), "
                f"got {self.kind!r}"
            )
        if self.kind == "adagrad" and self.params["lr_decay"] != 0:
            raise OptimError("a table's adagrad takes no lr_decay (its rows keep no step count)")

    def check_for_tensor(self) -> None:
        if self.kind == "rowwise_adagrad":
            raise OptimError("rowwise_adagrad is for tables; a dense tensor takes 'adagrad'")
        if self.kind == "sparse_adam":
            raise OptimError("sparse_adam is for tables; a dense tensor takes 'adam'")

    # -- wire -------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "lr": self.lr}
        for name, v in self.params.items():
            d[name] = list(v) if name == "betas" else v
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Optimizer:
        if not isinstance(d, Mapping):
            raise OptimError(f"optimizer must be a map, got {type(d).__name__}")
        rest = dict(d)
        kind = rest.pop("kind", "sgd")
        if kind == "adagrad" and "initial_accumulator" in rest:
            # written before the torch kinds (LMDB, checkpoints, old clients): the old rule
            kind = "adagrad_legacy"
        lr = rest.pop("lr", None)
        return cls(kind, lr, rest)


def state_ranges(opt: Optimizer, shards: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Where each shard's state lies in a tensor's whole state (a checkpoint's ``<name>/accum``):
    the shards' states one after the other in the order of their start. For the legacy Adagrad
    that is the shard's own [start, stop) (the accumulator shaped like the tensor, as before)."""
    if opt.legacy_layout:
        return list(shards)
    order = sorted(range(len(shards)), key=lambda i: shards[i][0])
    out: list[tuple[int, int]] = [(0, 0)] * len(shards)
    at = 0
    for i in order:
        start, stop = shards[i]
        size = opt.state_size(stop - start)
        out[i] = (at, at + size)
        at += size
    return out


def spec_of(
    kind: str, lr: float, adagrad_initial: float = 0.0, args: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A client's definition of its tensors' optimizer (adamps train, adamps.torch): `kind` at
    `lr` with `args` (torch's names), Adagrad's initial accumulator from `adagrad_initial`
    (``initial_accumulator_value`` of ``adagrad``; ``initial_accumulator`` of
    ``adagrad_legacy``). Checked here (OptimError), so a bad one fails before any create."""
    d: dict[str, Any] = {"kind": kind, "lr": lr, **dict(args or {})}
    if kind == "adagrad":
        d.setdefault("initial_accumulator_value", adagrad_initial)
    elif kind == "adagrad_legacy":
        d.setdefault("initial_accumulator", adagrad_initial)
    return Optimizer.from_dict(d).to_dict()
