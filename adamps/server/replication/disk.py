"""A server's replicated copies as LMDB holds them: the copies reloaded at start, the positions
a flush writes beside its values, and a transferred copy written before it may count as a member
(issue 29). Converts between the core's form (adamps.core.replication.copies: batches, exactly-once
pairs) and the persister's (persist.Position, batches in wire form), runs the flusher's blocking
write off the event loop, and tells the core while a transferred copy cannot be persisted; the
disk's answers reach replication through ``Disk``.
Persistence, not replication: the replication shell (adamps.server.replication.shell) decides nothing
about it and the core (adamps.core.replication.node) reads no disk; the flush's cut
(``ParameterServer._cut``) calls ``positions`` and ``held_copies``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass

from adamps.core.replication import copies as repl_copies
from adamps.core.replication.node import ReplCore
from adamps.server.replication.wire import batch_from_wire, batch_to_wire
from adamps.server.storage.persist import DEDUP_PER_FLUSH, Position

log = logging.getLogger("adamps.server.replication.shell")


@dataclass
class Disk:
    """What replication asks of this server's disk, set by the server from its flusher (the
    defaults: a disk that always persists, for a server without one)."""

    #: why this server cannot persist now, or None: reported in every heartbeat so the
    #: controllers move its buckets (issue 29)
    not_durable: Callable[[], str | None] = lambda: None
    #: why a write to LMDB would not reach the disk now, or None: no state transfer is asked
    #: for while it cannot be persisted (``tell_blocked``)
    can_persist: Callable[[], str | None] = lambda: None
    #: writes the named buckets' copies and positions to LMDB now, blocking (raises if they
    #: cannot be written). A state transfer persists the installed copy with it before the copy
    #: may count as a member (issue 29, ``persist_installed``).
    persist_now: Callable[[set[int]], object] = lambda buckets: None
    #: called with where ("transfer") for every received record that fails its checksum
    on_corrupt: Callable[[str], None] = lambda where: None


def restore(core: ReplCore, positions: dict[int, Position]) -> None:
    """Copies reloaded from LMDB at start: held as standby until the controllers decide."""
    for b, p in positions.items():
        prepared = map(batch_from_wire, p.prepared)
        core.reloaded(b, p.seq, p.epoch, p.dedup, prepared)
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


def cut_unchanged(core: ReplCore, on_disk: Mapping[int, tuple[int, int]]) -> bool:
    """Whether a flush's cut now would write no position (the flush's turn, Flusher.offer)."""
    return repl_copies.cut_unchanged(core, on_disk)


def held_copies(core: ReplCore) -> set[int]:
    """The buckets whose copy a flush persists (and whose records it keeps)."""
    return repl_copies.held_copies(core)


async def persist_installed(
    installing: Iterable[asyncio.Future],
    persist_now: Callable[[set[int]], object],
    b: int,
    seq: int,
    source: str | None,
) -> bool:
    """A transferred copy of bucket `b` (at `seq`, from `source`) on disk: once its values are
    applied (`installing`, the owner threads' futures), they and its position are written now
    by `persist_now` (the flusher's blocking write, in a thread). The flush holds the copy
    meanwhile (the core's ``installed``), so no cut writes it half installed. False (logged)
    when they could not be written: the copy is then in memory only, no member and not
    learning."""
    try:
        await asyncio.gather(*installing)
        await asyncio.to_thread(persist_now, {b})
    except Exception as exc:
        log.warning(
            "bucket %d: snapshot at seq %d from %s could not be persisted: %s: %s; not "
            "joining until this server can persist",
            b, seq, source, type(exc).__name__, exc,
        )  # fmt: skip
        return False
    return True


def tell_blocked(core: ReplCore, can_persist: Callable[[], str | None]) -> None:
    """Tells the core why this server cannot persist a transferred copy now, or None: it asks
    for no snapshot meanwhile (issue 29). `can_persist` (the flusher's) scans the dirty shards,
    so it is asked only while a copy joins."""
    blocked = can_persist() if "joining" in core.roles.values() else None
    if blocked is not None and core.persist_blocked is None:
        log.info("no state transfer is asked for while this server cannot persist: %s", blocked)
    core.cannot_persist(blocked)
