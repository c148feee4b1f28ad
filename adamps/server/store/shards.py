"""What the store holds, as plain state: a tensor's definition and held shards, one shard's
values, a flush's copy of one shard, and the error a request the store cannot serve raises.

Who may mutate them is the store's rule (``store.py``): a ``ShardState``'s values, accumulator,
version and dirty mark only on its owner thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adamps.layout import Shard, TensorSpec
from adamps.server.updates.optim import Fc, Optimizer


class StoreError(ValueError):
    """A request the store cannot serve; ``code`` is a protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(eq=False)
class ShardState:
    """One shard held by this server. Mutated only by its owner thread (after creation)."""

    shard: Shard
    owner: int
    value: np.ndarray
    accum: np.ndarray | None
    #: number of updates applied since the tensor was created
    version: int = 0
    #: monotonic time of the first update not yet taken by a flush snapshot (None: clean)
    dirty_since: float | None = None
    #: the optimizer of the last update applied here (a push's ``hyper`` or the tensor's own;
    #: None: none since this server started): what ``describe`` shows, for operators and tests
    applied: Optimizer | None = None
    #: consistent checkpoints' cuts that want this shard as it is now: copied before the next
    #: write (adamps/server/store/cut_copies.py), then None
    cuts: tuple[Any, ...] | None = None

    @property
    def id(self) -> str:
        return self.shard.id


@dataclass(eq=False)
class TensorState:
    spec: TensorSpec
    optimizer: Optimizer
    init: dict[str, Any]
    #: shard index -> state, only for shards in buckets this server holds
    shards: dict[int, ShardState] = field(default_factory=dict)
    #: all shards of the tensor, held or not, in order
    layout_shards: list[Shard] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        """Plain data of the definition (what `create` compares for idempotence)."""
        return {
            "name": self.spec.name,
            "shape": list(self.spec.shape),
            "dtype": self.spec.dtype,
            "optimizer": self.optimizer.to_dict(),
            "init": self.init,
        }

    @property
    def held_all(self) -> bool:
        return len(self.shards) == len(self.layout_shards)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A consistent copy of one shard, taken on its owner thread for a flush."""

    shard_id: str
    version: int
    #: the shard's sealed LMDB record (adamps.server.store.shardrecord: uint8): values and accumulator
    record: np.ndarray
    dirty_since: float
    #: the bucket the shard belongs to (a flush chunk is made of whole buckets)
    bucket: int = -1
    #: a row shard's rows to write (adamps.server.store.tables.rowdelta; its `record` is the block's header)
    rows: Any = None


def fc_parts(
    t: TensorState,
    a: np.ndarray,
    e: np.ndarray,
    states: Sequence[ShardState],
    opt: Optimizer | None = None,
) -> list[tuple[ShardState, Fc]]:
    """Splits activation/error vectors of a whole M x N layer into per-shard updates (row
    blocks), applied with `opt` (a push's hyper; None: the tensor's optimizer)."""
    parts = []
    for st in states:
        s = st.shard
        # e's columns for this row block; a small k x rows copy so BLAS gets contiguous input.
        parts.append((st, Fc(a, np.ascontiguousarray(e[:, s.row_start : s.row_stop]), opt)))
    return parts
