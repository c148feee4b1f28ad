"""A checkpoint's restore as an update: ``Install`` overwrites a shard's values (and its
optimizer accumulators), ``RowInstall`` replaces a row shard's whole block. They travel in a
replication batch like any push (wire kinds ``"i"`` and ``"j"``, adamps/server/replication/wire.py), so a restore
takes the one write path: validate -> lease -> replicate -> apply, and every replica ends
bit-identical to the checkpoint. Their decoding (the checks of a request and of a replicated
update) is adamps/server/decode/install.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class Install:
    """The values (and accumulator, when the optimizer keeps one) a shard takes, whole."""

    value: np.ndarray
    accum: np.ndarray | None
    #: the version the shard takes (the checkpoint's; issue 39), None: one more than before
    version: int | None = None

    def apply(self, w: np.ndarray, acc: np.ndarray | None, opt: Any = None) -> None:
        np.copyto(w, self.value.reshape(w.shape))
        if acc is not None:
            if self.accum is None:
                # A checkpoint without optimizer state (an SGD tensor's) restored under an
                # optimizer that keeps one: its fresh state (Adagrad's initial accumulator,
                # step 0), as a create would give
                acc.fill(0.0)
                if opt is not None:
                    acc.reshape(-1)[: w.size] = opt.initial_state
            else:
                np.copyto(acc, self.accum.reshape(acc.shape))


@dataclass(frozen=True, slots=True)
class RowInstall:
    """A row shard's whole state as ``RowBlock.tobytes`` wrote it (bytes, or a uint8 array: a
    raw payload of the data plane)."""

    data: bytes | np.ndarray
    version: int | None = None


def has_install(group: Any) -> bool:
    """Whether a shard's batch of (update, ticket) holds an install (rare: a restore)."""
    return any(type(u) in _INSTALLS for u, _t in group)


def version_after(version: int, group: Any) -> int:
    """A shard's version after its batch `group` of (update, ticket) applied in order: one more
    per update, except that an install takes the checkpoint's version when that is higher (a
    restored shard reports the version its checkpoint holds; a version never goes down, so
    within one cluster an equal version stays equal data, which an incremental checkpoint
    relies on)."""
    if not has_install(group):
        return version + len(group)
    for u, _t in group:
        n = getattr(u, "version", None) if isinstance(u, Install | RowInstall) else None
        version = version + 1 if n is None else max(version + 1, n)
    return version


_INSTALLS = (Install, RowInstall)
