"""A checkpoint's restore as an update: ``Install`` overwrites a shard's values (and its
optimizer accumulators), ``RowInstall`` replaces a row shard's whole block. They travel in a
replication batch like any push (wire kinds ``"i"`` and ``"j"``, repl_wire.py), so a restore
takes the one write path: validate -> lease -> replicate -> apply, and every replica ends
bit-identical to the checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from adamps.protocol import ProtocolError


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
    """A row shard's whole state as ``RowBlock.tobytes`` wrote it."""

    data: bytes
    version: int | None = None


def version_of(u: dict[str, Any]) -> int | None:
    """An install update's ``n``: the version the checkpoint read the shard at, or None."""
    n = u.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise ProtocolError("bad_request", f"an install's version must be an int >= 0, got {n!r}")
    return n


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


def install_of(u: dict[str, Any], st: Any) -> Install:
    """The checked store form of an install update: float32 arrays of the shard's size, and
    an accumulator exactly when given (a peer's batch is checked like a client's request)."""
    arrays = [u.get("v"), u.get("a")]
    # the optimizer's state (adamps/optspec.py) may be larger than the shard: slots and a step count
    sizes = [st.shard.size, st.shard.size if st.accum is None else st.accum.size]
    for name, a, size in zip(("values", "accumulator"), arrays, sizes, strict=True):
        if a is None and name == "accumulator":
            continue
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.size != size:
            raise ProtocolError(
                "bad_shape", f"install of shard {st.id}: {name} must be float32 of {size} elements"
            )
    return Install(arrays[0], arrays[1], version_of(u))


_INSTALLS = (Install, RowInstall)
