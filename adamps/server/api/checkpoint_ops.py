"""The two server ops a checkpoint is made of (issue 24), on ``POST /rpc`` under the cluster
token (an operator's call, not a peer's: the replication ops are peer-only):

- ``ckpt_read``: one bucket's consistent state on its primary (values, optimizer
  accumulators, embedding-table row blocks) at a known (epoch, seq). Taken between rounds the
  way ``repl_snapshot`` takes a joining copy's (the position read and the owner-thread reads
  queued in one loop step, no await between), but it adds no learner: nothing waits for it.
  With ``since {versions}`` (an incremental checkpoint) it leaves out the shards whose version
  is unchanged, and lists them under ``unchanged``.
- ``ckpt_install``: shards and row shards of one bucket restored whole. It is an update (wire
  kinds ``i`` and ``j``, adamps/server/updates/install.py) through the one write path, so every replica gets it by
  the same two-phase commit as a push; ``n`` (optional) is the version the shard had in the
  checkpoint, which it then reports (install.version_after). Its data is decoded like a push's
  (adamps/server/decode/install.py: finite, bounded; issue 39), all of it before anything is
  queued, and every copy decodes the replicated update with the same checks. Refused (``conflict``) for a
  shard that already took an update, unless ``force``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from adamps.server.decode import install
from adamps.server.replication.shell import Replicator
from adamps.server.store.cut_copies import Cut
from adamps.server.store.cut_copies import copy_of as cut_copy
from adamps.server.store.store import Store
from adamps.server.store.tables.rowtables import RowShardState
from adamps.server.store.tickets import owner_future
from adamps.server.writepath import WritePath
from adamps.wire.protocol import ProtocolError, only_fields, require

#: longest write hold a consistent checkpoint may ask for (seconds)
MAX_HOLD = 30.0
#: seconds a cut's copies are kept for their reader
CUT_TTL = 600.0
#: bytes of an install from which its values are bounded on a worker thread, not the loop
#: (min and max over 1 MiB: about 0.5 ms here; a 128 MiB request held the loop ~100 ms)
CHECK_OFF_LOOP = 1 << 20
#: the fields of a ckpt_install's entries: a shard's values, accumulator and version; a row
#: shard's block and version (docs/protocol-ps.md, "Checkpoints")
SHARD_FIELDS = ("v", "a", "n")
ROW_FIELDS = ("b", "n")
OP = "ckpt_install"


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
        #: cut id -> (monotonic time taken, its marks and copies, bucket -> (its position, its
        #: dense and row shards)) of a consistent checkpoint, until read
        self.cuts: dict[str, tuple[float, Cut, dict[int, Any]]] = {}

    def _bucket_shards(self, b: int) -> list[Any]:
        bucket_of = self.store.layout.bucket_of
        return sorted(
            (st for st in self.store.shards.values() if bucket_of.get(st.id) == b),
            key=lambda s: s.id,
        )

    async def op_ckpt_hold(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Holds new writes (``held``, retryable), waits for the admitted ones to be decided,
        then marks every shard of the buckets this server is primary of (values, accumulators,
        rows) for the cut on its owner thread: one instant for all of them. Nothing is copied
        under the hold: a shard is copied before its first write after the cut, or when read
        (adamps/server/store/cut_copies.py). The caller releases the hold as soon as every server answered and
        reads the cut at leisure (``ckpt_read`` with ``cut``)."""
        cut = require(msg, "cut", str)
        seconds = require(msg, "seconds", float, default=5.0)
        if not 0 < seconds <= MAX_HOLD:
            raise ProtocolError("bad_request", f"'seconds' must be in (0, {MAX_HOLD}]")
        t0 = time.monotonic()
        self._expire(t0)
        hold = self.writes.hold
        hold.hold(cut, t0, seconds)
        marks = Cut(cut)
        try:
            while hold.inflight > 0:
                if time.monotonic() - t0 > seconds:
                    raise ProtocolError("timeout", f"pushes under way did not end in {seconds}s")
                await asyncio.sleep(0.001)
            drained = time.monotonic() - t0
            # Every bucket's position read and its marks queued in this one loop step (no
            # await between): the owner threads mark each shard after the batches up to that
            # position and before any later one.
            buckets = {b: self._position(b) for b in self._primary_buckets()}
            states = [st for _pos, sts, rows in buckets.values() for st in (*sts, *rows)]
            await owner_future(lambda cb: self.store.call(states, marks.mark, cb))
        except BaseException:
            hold.release(cut)
            marks.dropped = True
            raise
        self.cuts[cut] = (time.monotonic(), marks, buckets)
        return {
            "cut": cut,
            "positions": {str(b): list(pos) for b, (pos, _s, _r) in buckets.items()},
            "drain_ms": drained * 1e3,
            "copy_ms": (time.monotonic() - t0 - drained) * 1e3,
        }

    async def op_ckpt_release(self, msg: dict[str, Any]) -> dict[str, Any]:
        cut = require(msg, "cut", str)
        drop = require(msg, "drop", bool, default=False)
        released = self.writes.hold.release(cut)
        if drop:
            held = self.cuts.pop(cut, None)
            if held is not None:
                held[1].dropped = True  # its marks left on shards copy nothing now
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
        for cut, (at, marks, _b) in list(self.cuts.items()):
            if now - at > CUT_TTL:
                marks.dropped = True
                del self.cuts[cut]

    def _bucket(self, msg: dict[str, Any]) -> int:
        """The request's bucket, one of the cluster's: -1 or 2^63 was answered `not_primary`,
        which a client takes as "ask the routing table again" and retries."""
        b = require(msg, "bucket", int)
        n = self.store.layout.n_buckets
        if not 0 <= b < n:
            raise ProtocolError("bad_request", f"field 'bucket' must be in [0, {n}), got {b}")
        return b

    def _position(self, b: int) -> tuple[tuple[int, int | None], list[Any], list[Any]]:
        """Bucket b's (epoch, seq) now and its dense and row shards (not_primary: raised)."""
        epoch, seq = 0, None
        if self.replicator is not None:
            # not_primary (also while in doubt) / unavailable: the caller retries
            rep = self.replicator.check_primary(b, read=True)
            epoch, seq = rep.assignment.epoch, rep.committed
        elif self.store.buckets is not None and b not in self.store.buckets:
            raise ProtocolError("not_primary", f"bucket {b} is not held here")
        rows = sorted(self.store.tables.in_bucket(b), key=lambda s: s.id)
        return (epoch, seq), self._bucket_shards(b), rows

    async def op_ckpt_read(self, msg: dict[str, Any]) -> dict[str, Any]:
        b = self._bucket(msg)
        cut = require(msg, "cut", str, default="")
        if not cut:
            return await self._read(b, _since_versions(msg))
        _at, marks, buckets = self.cuts.get(cut, (0.0, None, {}))
        if b not in buckets:
            raise ProtocolError("not_found", f"no copy of bucket {b} in cut {cut} on this server")
        (epoch, seq), states, rows = buckets.pop(b)
        if not buckets:
            self.cuts.pop(cut, None)
        got = await owner_future(lambda cb: self.store.call([*states, *rows], marks.take, cb))
        return self._reply(b, epoch, seq, states, rows, got)

    async def _read(self, b: int, known: dict[str, int]) -> dict[str, Any]:
        # An incremental read skips a shard whose version is the one the previous checkpoint
        # read. A version counts the updates applied to the shard since its creation, and every
        # copy applies the same committed batches, so an equal version is equal data, also on
        # another copy after a failover. (A bucket an operator declared lost restarts its
        # history: the caller then saves everything, adamps/checkpoint/save_restore.py.)

        def read(st: Any) -> tuple[int, Any, Any]:
            if known.get(st.id) == st.version:
                return st.version, None, None
            return cut_copy(st)

        # No await from the position to the reads queued below: every owner thread takes
        # them after the batches up to `seq` and before any later one, so the values are of
        # exactly that position (and so is the version an unchanged shard is judged by).
        (epoch, seq), states, rows = self._position(b)
        got = owner_future(lambda cb: self.store.call([*states, *rows], read, cb))
        return self._reply(b, epoch, seq, states, rows, await got)

    def _reply(
        self, b: int, epoch: int, seq: int | None, states: list[Any], rows: list[Any],
        got: dict[str, tuple[int, Any, Any]],
    ) -> dict[str, Any]:  # fmt: skip
        """A bucket's ckpt_read reply from its shards' (version, values, state) read (values
        None: unchanged since the versions the caller named)."""
        tensors = sorted({st.shard.tensor for st in states})
        row_ids = {st.id for st in rows}
        return {
            "bucket": b,
            "epoch": epoch,
            "seq": seq,
            "tensors": [self.catalog.definition(n) for n in tensors],
            "tables": [st.table.spec.to_dict() for st in rows],
            "shards": {
                sid: {"v": v, "a": a, "version": ver}
                for sid, (ver, v, a) in got.items()
                if v is not None and sid not in row_ids
            },  # fmt: skip
            "rows": {
                sid: {"version": ver, "b": v}
                for sid, (ver, v, _a) in got.items()
                if v is not None and sid in row_ids
            },  # fmt: skip
            "unchanged": {sid: ver for sid, (ver, v, _a) in got.items() if v is None},
        }

    async def op_ckpt_install(self, msg: dict[str, Any]) -> dict[str, Any]:
        return await self.apply_install(await self.prepare_install(msg))

    async def prepare_install(self, msg: dict[str, Any]) -> tuple[Any, ...]:
        """A ckpt_install checked whole, nothing queued yet: its fields on the loop, its values'
        bounds (a pass over up to 128 MiB) on a worker thread (the data plane queues it with
        `apply_install` before it reads the connection's next frame)."""
        b = self._bucket(msg)
        shards = require(msg, "shards", dict, default={})
        rows = require(msg, "rows", dict, default={})
        force = require(msg, "force", bool, default=False)
        if not shards and not rows:
            raise ProtocolError("bad_request", "ckpt_install needs 'shards' or 'rows'")
        wire: list[Any] = []
        parts: list[Any] = []
        busy: list[str] = []
        #: each part's decoding (install.shard / row_shard: what every copy checks of it),
        #: run once every field is known good; its bounds are a pass over up to 128 MiB
        decodes: list[Callable[[], Any]] = []
        size = 0
        # Every field checked before anything is queued: a bad install changes nothing.
        for sid, rec in shards.items():
            if not isinstance(sid, str) or not isinstance(rec, dict):
                raise ProtocolError("bad_request", "'shards' maps shard ids to {v, a}")
            # an accumulator misspelled ("acc") was ignored: the shard restored without it
            only_fields(rec, f"op 'ckpt_install': shard {sid[:130]!r}", SHARD_FIELDS, op=OP)
            st = self.store.shard(sid)
            if self.store.layout.bucket_of[sid] != b:
                raise ProtocolError("bad_request", f"shard {sid} is not in bucket {b}")
            upd = install.update(sid, rec.get("v"), rec.get("a"), install.version_of(rec))
            decodes.append(lambda st=st, u=upd: (st, install.shard(self.store, st, u)))
            size += getattr(upd["v"], "nbytes", 0)
            if st.version > 0:
                busy.append(sid)
            wire.append(([st], lambda sts, u=upd: u))
        for sid, rec in rows.items():
            if not isinstance(sid, str) or not isinstance(rec, dict):
                raise ProtocolError("bad_request", "'rows' maps row shard ids to {b: bytes}")
            only_fields(rec, f"op 'ckpt_install': row shard {sid[:130]!r}", ROW_FIELDS, op=OP)
            data = install.block_bytes(sid, rec.get("b"))
            st = self.store.tables.shard(sid)
            if not isinstance(st, RowShardState) or st.bucket != b:
                raise ProtocolError("bad_request", f"row shard {sid} is not in bucket {b}")
            version = install.version_of(rec)
            decodes.append(lambda st=st, d=data, v=version: (st, install.row_shard(st, d, v)))
            size += len(data)
            if st.version > 0 or st.value.n > 0:
                busy.append(sid)
            upd = install.row_update(sid, data, version)
            wire.append(([st], lambda sts, u=upd: u))
        if busy and not force:
            raise ProtocolError(
                "conflict",
                f"bucket {b} already holds data in {sorted(busy)[:5]} "
                f"({len(busy)} shards); restore with force to overwrite",
            )
        if size >= CHECK_OFF_LOOP:
            parts = await asyncio.to_thread(lambda: [decode() for decode in decodes])
        else:
            parts = [decode() for decode in decodes]
        return msg, b, wire, parts

    async def apply_install(self, prepared: tuple[Any, ...]) -> dict[str, Any]:
        """A prepared install through the one write path (queued in this call's first step)."""
        msg, b, wire, parts = prepared
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
