"""The two server ops a checkpoint is made of (issue 24), on ``POST /rpc`` under the cluster
token (an operator's call, not a peer's: the replication ops are peer-only):

- ``ckpt_read``: one bucket's consistent state on its primary (values, optimizer
  accumulators, embedding-table row blocks) at a known (epoch, seq). Taken between rounds the
  way ``repl_snapshot`` takes a joining copy's (the position read and the owner-thread reads
  queued in one loop step, no await between), but it adds no learner: nothing waits for it.
  With ``since {versions}`` (an incremental checkpoint) it leaves out the shards whose version
  is unchanged, and lists them under ``unchanged``.
- ``ckpt_install``: shards and row shards of one bucket restored whole. It is an update (wire
  kinds ``i`` and ``j``, install.py) through the one write path, so every replica gets it by
  the same two-phase commit as a push; ``n`` (optional) is the version the shard had in the
  checkpoint, which it then reports (install.version_after). Its data is decoded like a push's
  (adamps/server/decode/install.py: finite, bounded; issue 39), all of it before anything is
  queued, and every copy decodes the replicated update with the same checks. Refused (``conflict``) for a
  shard that already took an update, unless ``force``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from adamps.protocol import ProtocolError, require
from adamps.server.decode import install
from adamps.server.replicate import Replicator
from adamps.server.rowtables import RowShardState
from adamps.server.store import Store
from adamps.server.tickets import owner_future
from adamps.server.writepath import WritePath

#: longest write hold a consistent checkpoint may ask for (seconds)
MAX_HOLD = 30.0
#: seconds a cut's copies are kept for their reader
CUT_TTL = 600.0


class CheckpointOps:
    """``ckpt_read`` and ``ckpt_install`` (event-loop thread)."""

    def __init__(
        self, store: Store, catalog: Any, writes: WritePath, replicator: Replicator | None
    ) -> None:
        self.store = store
        self.catalog = catalog
        self.writes = writes
        #: None on a standalone server: its cut has no (epoch, seq), only shard versions
        self.replicator = replicator
        #: cut id -> (monotonic time taken, bucket -> its ckpt_read reply) of a consistent
        #: checkpoint, until read
        self.cuts: dict[str, tuple[float, dict[int, dict[str, Any]]]] = {}

    def _bucket_shards(self, b: int) -> list[Any]:
        bucket_of = self.store.layout.bucket_of
        return sorted(
            (st for st in self.store.shards.values() if bucket_of.get(st.id) == b),
            key=lambda s: s.id,
        )

    async def op_ckpt_hold(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Holds new writes (``held``, retryable), waits for the admitted ones to be decided,
        then copies every bucket this server is primary of (values, accumulators, rows) into
        memory under the cut's id: one instant for all of them. The caller releases the hold
        as soon as every server answered and reads the copies at leisure (``ckpt_read`` with
        ``cut``): the writes stall for the copy, not for the transfer."""
        cut = require(msg, "cut", str)
        seconds = require(msg, "seconds", float, default=5.0)
        if not 0 < seconds <= MAX_HOLD:
            raise ProtocolError("bad_request", f"'seconds' must be in (0, {MAX_HOLD}]")
        t0 = time.monotonic()
        self._expire(t0)
        hold = self.writes.hold
        hold.hold(cut, t0, seconds)
        try:
            while hold.inflight > 0:
                if time.monotonic() - t0 > seconds:
                    raise ProtocolError("timeout", f"pushes under way did not end in {seconds}s")
                await asyncio.sleep(0.001)
            drained = time.monotonic() - t0
            snaps = {}
            for b in self._primary_buckets():
                snaps[b] = await self._read(b, {})
        except BaseException:
            hold.release(cut)
            raise
        self.cuts[cut] = (time.monotonic(), snaps)
        return {
            "cut": cut,
            "positions": {str(b): [sn["epoch"], sn["seq"]] for b, sn in snaps.items()},
            "drain_ms": drained * 1e3,
            "copy_ms": (time.monotonic() - t0 - drained) * 1e3,
        }

    async def op_ckpt_release(self, msg: dict[str, Any]) -> dict[str, Any]:
        cut = require(msg, "cut", str)
        drop = require(msg, "drop", bool, default=False)
        released = self.writes.hold.release(cut)
        if drop:
            self.cuts.pop(cut, None)
        return {"cut": cut, "released": released}

    def _primary_buckets(self) -> list[int]:
        if self.replicator is None:
            held = self.store.buckets
            n = self.store.layout.n_buckets
            return [b for b in range(n) if held is None or b in held]
        out = []
        for b in sorted(self.replicator.core.buckets):
            try:
                self.replicator.check_primary(b, read=True)
            except ProtocolError:
                continue
            out.append(b)
        return out

    def _expire(self, now: float) -> None:
        """Forgets cuts nobody read within CUT_TTL (a save tool that died)."""
        for cut, (at, _snaps) in list(self.cuts.items()):
            if now - at > CUT_TTL:
                del self.cuts[cut]

    async def op_ckpt_read(self, msg: dict[str, Any]) -> dict[str, Any]:
        b = require(msg, "bucket", int)
        cut = require(msg, "cut", str, default="")
        if cut:
            snaps = self.cuts.get(cut, (0.0, {}))[1]
            if b not in snaps:
                raise ProtocolError(
                    "not_found", f"no copy of bucket {b} in cut {cut} on this server"
                )
            snap = snaps.pop(b)
            if not snaps:
                self.cuts.pop(cut, None)
            return snap
        return await self._read(b, _since_versions(msg))

    async def _read(self, b: int, known: dict[str, int]) -> dict[str, Any]:
        epoch, seq = 0, None
        if self.replicator is not None:
            # not_primary (also while in doubt) / unavailable: the caller retries
            rep = self.replicator.check_primary(b, read=True)
            epoch, seq = rep.assignment.epoch, rep.committed
        elif self.store.buckets is not None and b not in self.store.buckets:
            raise ProtocolError("not_primary", f"bucket {b} is not held here")
        # An incremental read skips a shard whose version is the one the previous checkpoint
        # read. A version counts the updates applied to the shard since its creation, and every
        # copy applies the same committed batches, so an equal version is equal data, also on
        # another copy after a failover. (A bucket an operator declared lost restarts its
        # history: the caller then saves everything, adamps/checkpoint.py.)

        def dense(st: Any) -> tuple[int, Any, Any]:
            if known.get(st.id) == st.version:
                return st.version, None, None
            acc = None if st.accum is None else st.accum.reshape(-1).copy()
            return st.version, st.value.reshape(-1).copy(), acc

        def row(st: Any) -> tuple[int, bytes | None]:
            if known.get(st.id) == st.version:
                return st.version, None
            return st.version, st.value.tobytes()

        # No await from the position above to the reads queued below: every owner thread takes
        # them after the batches up to `seq` and before any later one, so the values are of
        # exactly that position (and so is the version an unchanged shard is judged by).
        states = self._bucket_shards(b)
        read = owner_future(lambda cb: self.store.call(states, dense, cb))
        rows = sorted(self.store.tables.in_bucket(b), key=lambda s: s.id)
        row_read = owner_future(lambda cb: self.store.call(rows, row, cb))
        got = await read
        row_states = await row_read
        tensors = sorted({st.shard.tensor for st in states})
        return {
            "bucket": b,
            "epoch": epoch,
            "seq": seq,
            "tensors": [self.catalog.definition(n) for n in tensors],
            "tables": [st.table.spec.to_dict() for st in rows],
            "shards": {
                sid: {"v": v, "a": a, "version": ver}
                for sid, (ver, v, a) in got.items()
                if v is not None
            },
            "rows": {
                sid: {"version": v, "b": d} for sid, (v, d) in row_states.items() if d is not None
            },
            "unchanged": {
                sid: ver for sid, (ver, v, *_r) in {**got, **row_states}.items() if v is None
            },  # fmt: skip
        }

    async def op_ckpt_install(self, msg: dict[str, Any]) -> dict[str, Any]:
        b = require(msg, "bucket", int)
        shards = require(msg, "shards", dict, default={})
        rows = require(msg, "rows", dict, default={})
        force = require(msg, "force", bool, default=False)
        if not shards and not rows:
            raise ProtocolError("bad_request", "ckpt_install needs 'shards' or 'rows'")
        wire: list[Any] = []
        parts: list[Any] = []
        busy: list[str] = []
        # Every field checked before anything is queued: a bad install changes nothing.
        for sid, rec in shards.items():
            if not isinstance(sid, str) or not isinstance(rec, dict):
                raise ProtocolError("bad_request", "'shards' maps shard ids to {v, a}")
            st = self.store.shard(sid)
            if self.store.layout.bucket_of[sid] != b:
                raise ProtocolError("bad_request", f"shard {sid} is not in bucket {b}")
            upd = install.update(sid, rec.get("v"), rec.get("a"), install.version_of(rec))
            inst = install.shard(self.store, st, upd)  # what every copy checks of `upd`
            if st.version > 0:
                busy.append(sid)
            wire.append(([st], lambda sts, u=upd: u))
            parts.append((st, inst))
        for sid, rec in rows.items():
            data = rec.get("b") if isinstance(rec, dict) else None
            if not isinstance(sid, str) or not isinstance(data, bytes):
                raise ProtocolError("bad_request", "'rows' maps row shard ids to {b: bytes}")
            st = self.store.tables.shard(sid)
            if not isinstance(st, RowShardState) or st.bucket != b:
                raise ProtocolError("bad_request", f"row shard {sid} is not in bucket {b}")
            version = install.version_of(rec)
            row = install.row_shard(st, data, version)  # what every copy checks
            if st.version > 0 or st.value.n > 0:
                busy.append(sid)
            upd = install.row_update(sid, data, version)
            wire.append(([st], lambda sts, u=upd: u))
            parts.append((st, row))
        if busy and not force:
            raise ProtocolError(
                "conflict",
                f"bucket {b} already holds data in {sorted(busy)[:5]} "
                f"({len(busy)} shards); restore with force to overwrite",
            )
        await self.writes.replicate_or_apply(msg, wire, lambda: parts)
        return {"bucket": b, "installed": len(parts)}


def _since_versions(msg: dict[str, Any]) -> dict[str, int]:
    """ckpt_read's `since: {versions: {shard or row shard id: version}}`, checked whole: a
    malformed one was ignored, and the read then silently saved everything (issue 39 #15)."""
    since = require(msg, "since", dict, default={})
    extra = sorted(str(k) for k in since if k != "versions")
    if extra:
        raise ProtocolError("bad_request", f"field 'since' takes only 'versions', got {extra}")
    versions = since.get("versions", {})
    if not isinstance(versions, dict) or not all(
        isinstance(k, str) and type(v) is int for k, v in versions.items()
    ):
        raise ProtocolError(
            "bad_request",
            "field 'since.versions' must map shard or row shard ids to versions (ints)",
        )
    return versions
