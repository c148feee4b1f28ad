"""The field checks every update kind's decoder shares: a replicated update's strings and
float32 arrays, the optimizer its push named (``"o"``), and the finite bounds' passes that a
round defers to a worker thread. Pure: reads the store, changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from adamps.server.store.store import Store
from adamps.server.updates.hyper import of_update
from adamps.wire.protocol import ProtocolError, only_fields

#: a round's deferred checks: (bytes the check reads, the check), run before anything is queued
Later = list[tuple[int, Callable[[], None]]]


def bad(message: str) -> ProtocolError:
    """A malformed replicated update (a peer's batch is checked like a client's request)."""
    return ProtocolError("bad_request", f"replicated batch: {message}")


def only(u: dict[str, Any], takes: frozenset[str]) -> None:
    """Refuses a replicated update naming a field its kind does not take (400 bad_request naming
    it, as every replication op answers): read by nothing, a misspelled field (a forged frame's,
    a buggy primary's) was silently ignored. Every kind's ``replicated`` calls it first, so a
    PREPARE on /rpc, in a repl_multi on either port, and a batch read back from disk or a state
    transfer are held to the same fields. `takes`: exactly what the kind's encoder (its
    ``update``) may write; no field was ever dropped from an encoder, so every record an earlier
    version wrote still loads (docs/protocol-ps.md, "Replicated update kinds")."""
    only_fields(u, f"replicated batch: a {u.get('k')!r} update", takes)


def string(u: dict[str, Any], name: str) -> str:
    v = u.get(name)
    if not isinstance(v, str):
        raise bad(f"field {name!r} of a {u.get('k')!r} update must be a string")
    return v


def strings(u: dict[str, Any], name: str, what: str) -> list[str]:
    v = u.get(name)
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad(f"field {name!r} of {what} must be a list of shard ids")
    return v


def f32(u: dict[str, Any], name: str, ndim: int) -> np.ndarray:
    v = u.get(name)
    if not isinstance(v, np.ndarray) or v.dtype != np.float32 or v.ndim != ndim:
        raise ProtocolError(
            "bad_shape", f"replicated batch: field {name!r} must be a {ndim}-D float32 array"
        )
    return v


def named_optimizer(store: Store, u: dict[str, Any], tensor: str) -> Any:
    """The optimizer update `u` names (``"o"``) for `tensor`, checked; None: the tensor's."""
    return None if "o" not in u else of_update(store.tensor(tensor).optimizer, u, tensor)


def run(later: Later | None, nbytes: int, check: Callable[[], None]) -> None:
    """Runs a bounds check now, or appends it to `later` (with the bytes it reads)."""
    if later is None:
        check()
    else:
        later.append((nbytes, check))
