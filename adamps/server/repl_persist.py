"""A server's replicated copies as LMDB holds them: the copies reloaded at start, the positions
a flush writes beside its values, and a transferred copy written before it may count as a member
(issue 29). Converts between the core's form (adamps.core.repl_copies: batches, exactly-once
pairs) and the persister's (persist.Position, batches in wire form), and runs the flusher's
blocking write off the event loop. Persistence, not replication: the replication shell
(adamps.server.replicate) decides nothing about it and the core (adamps.core.repl_core) reads
no disk; the flush's cut (``ParameterServer._cut``) calls ``positions`` and ``held_copies``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Container, Iterable

from adamps.core import repl_copies
from adamps.core.repl_core import ReplCore
from adamps.server.persist import DEDUP_PER_FLUSH, Position
from adamps.server.repl_wire import batch_from_wire, batch_to_wire

log = logging.getLogger("adamps.server.replicate")


def restore(core: ReplCore, positions: dict[int, Position]) -> None:
    """Copies reloaded from LMDB at start: held as standby until the controllers decide."""
    for b, p in positions.items():
        prepared = map(batch_from_wire, p.prepared)
        repl_copies.restore(core, b, p.seq, p.epoch, p.dedup, prepared)
    log.info("reloaded %d copies: %s", len(positions), repl_copies.copies(core))


def positions(core: ReplCore, buckets: Container[int] | None = None) -> dict[int, Position]:
    """Per held copy (of `buckets`; None: all), its position and the exactly-once pairs
    recorded since the last cut. Called on the event loop in the same step as the flush's
    copies are queued: they describe exactly the values the flush writes."""
    return repl_copies.positions(
        core,
        buckets,
        DEDUP_PER_FLUSH,
        lambda e, s, d, f, p: Position(e, s, d, f, [batch_to_wire(x) for x in p]),
    )


def held_copies(core: ReplCore) -> set[int]:
    """The buckets whose copy a flush persists (and whose records it keeps)."""
    return repl_copies.held_copies(core)


async def persist_installed(
    installing: Iterable[asyncio.Future], persist_now: Callable[[set[int]], object], b: int
) -> None:
    """A transferred copy of bucket `b` on disk: once its values are applied (`installing`, the
    owner threads' futures), they and its position are written now by `persist_now` (the
    flusher's blocking write, in a thread; raises if they cannot be written). The flush holds
    the copy meanwhile (the core's ``installed``), so no cut writes it half installed."""
    await asyncio.gather(*installing)
    await asyncio.to_thread(persist_now, {b})
