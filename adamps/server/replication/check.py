"""What a copy does with a PREPARE before the replica state machine sees it (issue 28, item 1;
issue 41, item 2): every update of a batch of a bucket held here is decoded by its kind's
decoder (adamps/server/decode/), the same checks the primary ran on the push it came from
(shapes, dtypes, finiteness, the bounds of adamps/server/updates/bounds.py), whoever sent it. A batch
that fails is refused as a whole (ProtocolError, a 4xx). The parts each update was decoded into
ride with it (decode.Checked) and are applied as they are when the round commits: nothing is
decoded twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container
from typing import Any

import numpy as np

from adamps.server import decode
from adamps.server.replication.wire import message_from_wire
from adamps.server.store.store import Store

#: array bytes of a PREPARE from which it is decoded on a worker thread: its digest (xxh3 of
#: every byte) and the finite bounds of its arrays (a min and a max pass) held a secondary's
#: event loop 20-100 ms for a 64 MiB batch (issue 39); below, the hop costs more than the work
CHECK_OFF_LOOP = 4 << 20


def _array_bytes(msg: dict[str, Any]) -> int:
    """The bytes of the arrays a PREPARE's batches carry (an estimate: their updates' fields);
    0 for anything malformed (checked on the loop then, and refused there)."""
    total = 0
    try:
        for e in msg.get("entries") or ():
            for push in e.get("updates") or ():
                for u in push:
                    total += sum(v.nbytes for v in u.values() if isinstance(v, np.ndarray))
    except (AttributeError, TypeError):
        return 0
    return total


def decoder(store: Store, buckets: Container[int]) -> Callable[[int], Any]:
    """The decoder of a PREPARE's updates for bucket `b`: decode.decoded for a bucket held
    here (every copy re-checks what it will apply), none for another (refused by the core)."""

    def of_bucket(b: int) -> Callable[[Any], Any] | None:
        return (lambda u: decode.decoded(store, u)) if b in buckets else None

    return of_bucket


def _checked(store: Store, buckets: Container[int], op: str, msg: dict[str, Any]) -> Any:
    return message_from_wire(op, msg, decoder(store, buckets) if op == "repl_prepare" else None)


async def checked_message(
    store: Store, buckets: Container[int], op: str, msg: dict[str, Any]
) -> dict[str, Any]:
    """A peer's replication message decoded (repl_wire.message_from_wire, its batches'
    checksums verified) and, for a PREPARE of a bucket this server holds, every update decoded
    (decode.decoded): on a worker thread when its arrays are large. Only reads the store."""
    if op == "repl_prepare" and _array_bytes(msg) >= CHECK_OFF_LOOP:
        return await asyncio.to_thread(_checked, store, buckets, op, msg)
    return _checked(store, buckets, op, msg)
