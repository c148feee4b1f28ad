"""State transfer between copies of a bucket: the primary's consistent snapshot for a joining
copy (values, accumulators, versions, position and deduplication table), the joining copy's
fetch and install, and the digests that show replicas bit-identical."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

import numpy as np

from adamps.core.repl_types import Reject
from adamps.protocol import ProtocolError, require
from adamps.rpc import RpcError
from adamps.server import checksum
from adamps.server.tickets import owner_future

log = logging.getLogger("adamps.server.replicate")


def shard_digest(value: np.ndarray, accum: np.ndarray | None) -> int:
    """xxh3 of a shard's values and accumulator as a snapshot carries them."""
    parts = [memoryview(np.ascontiguousarray(value)).cast("B")]
    if accum is not None:
        parts.append(memoryview(np.ascontiguousarray(accum)).cast("B"))
    return checksum.digest(*parts)


class StateTransfer:
    """Snapshots of a bucket (sent and installed) and digests.

    A part of :class:`adamps.server.replicate.Replicator`, which holds the state its methods
    use (``core``, ``buckets``, ``peers``, ``store``, ``m``). The decisions (who may have a
    snapshot, whether a fetched one is installed, when to transfer again) are the core's."""

    async def op_repl_snapshot(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A consistent copy of a bucket for a joining copy: taken between rounds, no await between
        reading the position and queueing the reads, so values match `committed` exactly."""
        b = require(msg, "bucket", int)
        joiner = require(msg, "joiner", str)
        join = require(msg, "join", int, default=0)
        meta = self.core.snapshot_for(b, joiner, join, time.monotonic())
        self.drain()
        if isinstance(meta, Reject):
            if meta.code == "bucket_unavailable":
                raise ProtocolError(meta.code, meta.message, bucket=b)
            raise self.refusal(b, meta)
        # From here (no await since the core made the joiner a learner) every round waits for
        # it: the batches after `committed` reach it through the rounds, the ones up to it
        # through this copy.
        states = [
            st for st in self.store.shards.values() if self.store.layout.bucket_of[st.id] == b
        ]
        outs = [np.empty(st.shard.shape, np.float32) for st in states]
        accs = [
            np.empty(st.shard.shape, np.float32) if st.accum is not None else None for st in states
        ]
        read = owner_future(lambda cb: self.store.read(states, outs, cb, accums=accs))
        # Queued in the same loop step as the shards' reads: the rows are of the same position.
        rows = self.store.tables.in_bucket(b)
        row_states = await owner_future(
            lambda cb: self.store.call(rows, lambda st: (st.version, st.value.tobytes()), cb)
        )
        versions = await read
        tensors = {st.shard.tensor for st in states}
        self.m.snapshots.labels("sent").inc()
        return {
            "bucket": b,
            **meta,
            "tensors": [self.catalog.definition(name) for name in sorted(tensors)],
            "tables": [st.table.spec.to_dict() for st in rows],
            "rows": {sid: {"version": v, "state": data} for sid, (v, data) in row_states.items()},
            "shards": {
                st.id: {
                    "value": out,
                    "accum": acc,
                    "version": versions[st.id],
                    "x": shard_digest(out, acc),
                }
                for st, out, acc in zip(states, outs, accs, strict=True)
            },
        }

    async def join(self, b: int) -> None:
        """Transfers bucket b from its primary and takes its rounds as a learner until the
        controller makes it a member; transfers again if the primary changes or goes silent
        (it forgot this learner)."""
        while not self.closing and (target := self.core.join_target(b)) is not None:
            primary, epoch, join = target
            try:
                snap = (
                    await self.peers.call(
                        primary, "repl_snapshot", bucket=b, joiner=self.server_id, join=join
                    )
                    if primary
                    else None
                )
            except (RpcError, ConnectionError, TimeoutError, OSError) as exc:
                log.info("bucket %d: snapshot from %s failed: %s; retrying", b, primary, exc)
                snap = None
            if snap is None or not self.core.snapshot_fits(b, (primary, epoch), int(snap["epoch"])):
                await asyncio.sleep(0.3)
                self.request_heartbeat()
                continue
            try:
                await self._install(b, snap)
            except ValueError as exc:  # damaged on the way: nothing installed; fetch it again
                log.error("bucket %d: CORRUPT snapshot from %s: %s; again", b, primary, exc)
                await asyncio.sleep(0.3)
                continue
            log.info(
                "bucket %d: snapshot at seq %d from %s installed", b, snap["committed"], primary
            )
            # Takes the primary's rounds until the controllers make it a member; the core's tick
            # ends the learning when the primary stays silent (it forgot this learner).
            while not self.closing and self.core.learning(b):
                await asyncio.sleep(0.1)
            if self.core.join_target(b) is not None:
                log.info("bucket %d: primary %s silent while joining; again", b, primary)

    async def _install(self, b: int, snap: dict[str, Any]) -> None:
        for sid, rec in snap["shards"].items():  # before anything changes here
            want = rec.get("x")  # absent from a primary of the previous version
            if want is not None and shard_digest(rec["value"], rec.get("accum")) != want:
                self.on_corrupt("transfer")
                raise ValueError(f"shard {sid} of the snapshot of bucket {b} fails its checksum")
        for d in snap["tensors"]:
            self.catalog.ensure(d)
        for d in snap.get("tables", []):
            self.catalog.tables.ensure(d)
        rows = {sid: self.store.tables.shard(sid) for sid in snap.get("rows", {})}

        def put_rows(st: Any) -> int:
            rec = snap["rows"][st.id]
            st.value.load_bytes(rec["state"])
            return int(rec["version"])

        rows_done = owner_future(lambda cb: self.store.replace(list(rows.values()), put_rows, cb))
        states, values, accums, versions = [], [], [], []
        for sid, rec in snap["shards"].items():
            st = self.store.shard(sid)
            states.append(st)
            values.append(rec["value"])
            accums.append(rec.get("accum"))
            versions.append(int(rec["version"]))
        done = owner_future(lambda cb: self.store.overwrite(states, values, accums, versions, cb))
        # The position moves in the same loop step as the values are queued: a flush cut sees
        # both or neither.
        self.core.installed(
            b,
            int(snap["committed"]),
            snap["dedup"],
            int(snap.get("committed_epoch", 0)),
            time.monotonic(),
        )
        await done
        await rows_done
        self.m.snapshots.labels("received").inc()

    async def offers(self) -> dict[int, list[Any]]:
        """The copies this server offers the controllers, each [epoch, seq, committed, digest]:
        the digest (xxh3 of every shard's values and accumulator, in shard order) of the copy
        at its committed seq, which the controllers compare between candidates that tie on
        (epoch, seq) (issue 29). Positions are read and the reads queued in one loop step, so
        each digest is of exactly the committed values."""
        copies = self.copies()
        plan: list[tuple[int, int, list[Any], list[np.ndarray], list[Any]]] = []
        states_all, outs_all, accs_all = [], [], []
        for b in copies:
            states = sorted(
                (
                    st
                    for st in self.store.shards.values()
                    if self.store.layout.bucket_of[st.id] == b
                ),
                key=lambda s: s.id,
            )
            outs = [np.empty(st.shard.shape, np.float32) for st in states]
            accs = [np.empty(st.shard.shape, np.float32) if st.accum is not None else None
                    for st in states]  # fmt: skip
            plan.append((b, self.buckets[b].committed, states, outs, accs))
            states_all += states
            outs_all += outs
            accs_all += accs
        if states_all:
            await owner_future(
                lambda cb: self.store.read(states_all, outs_all, cb, accums=accs_all)
            )
        out: dict[int, list[Any]] = {}
        for b, committed, states, outs, accs in plan:
            parts: list[bytes | memoryview] = []
            for st, value, acc in zip(states, outs, accs, strict=True):
                parts += [st.id.encode(), memoryview(value).cast("B")]
                if acc is not None:
                    parts.append(memoryview(acc).cast("B"))
            out[b] = [*copies[b], committed, f"{checksum.digest(*parts):016x}"]
        return out

    # -- digests ---------------------------------------------------------------------------------------

    async def op_digest(self, msg: dict[str, Any]) -> dict[str, Any]:
        b = require(msg, "bucket", int)
        rep = self.buckets.get(b)
        states = sorted(
            (st for st in self.store.shards.values() if self.store.layout.bucket_of[st.id] == b),
            key=lambda s: s.id,
        )
        outs = [np.empty(st.shard.shape, np.float32) for st in states]
        await owner_future(lambda cb: self.store.read(states, outs, cb))
        rows = sorted(self.store.tables.in_bucket(b), key=lambda s: s.id)
        row_digests = await owner_future(
            lambda cb: self.store.call(rows, lambda st: st.value.digest(), cb)
        )
        h = hashlib.sha256()
        for st, out in zip(states, outs, strict=True):
            h.update(st.id.encode())
            h.update(out.tobytes())
        for st in rows:  # an embedding table's rows of this bucket
            h.update(st.id.encode())
            h.update(row_digests[st.id])
        return {
            "bucket": b,
            "digest": h.hexdigest(),
            "committed": rep.committed if rep else None,
            "role": self.roles.get(b),
            "epoch": rep.assignment.epoch if rep else None,
        }
