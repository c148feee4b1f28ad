"""The secondary side of replication: PREPARE, COMMIT and pings from a bucket's primary, the
primary's pings to its secondaries, and the watchdog that proposes a role change to the
controllers when a primary stays silent for ``failover_after``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from adamps.core.replication import Reject
from adamps.protocol import ProtocolError, require
from adamps.server.repl_check import check_batches
from adamps.server.repl_wire import MULTI_OPS, batch_from_wire, store_parts
from adamps.server.shards import StoreError


class Follower:
    """Replication messages as a member of a bucket, and the pings between members.

    A part of :class:`adamps.server.replicate.Replicator`, which holds the state its methods
    use (``core``, ``peers``, ``store``) and carries out the core's ``Ready`` (``drain``).
    The decisions (epochs, the commit that rides on a PREPARE, the watchdog) are the core's."""

    async def op_repl_prepare(self, msg: dict[str, Any]) -> dict[str, Any]:
        b = require(msg, "bucket", int)
        raw = require(msg, "entries", list)
        if not all(isinstance(e, dict) for e in raw):
            raise ProtocolError("bad_request", "field 'entries' must be a list of batches")
        entries = [batch_from_wire(e) for e in raw]
        sender, epoch = require(msg, "sender", str), require(msg, "epoch", int)
        commit = require(msg, "commit", int, default=0)
        if b in self.buckets:
            # Every copy re-checks what it will apply (shapes, finiteness, bounds), whoever sent
            # it: nothing is kept of a batch the primary itself would have refused as a push.
            check_batches(self.store, entries)
            for e in entries:
                store_parts(self.store, e.updates)
        return self._step(
            b,
            {"op": "repl_prepare", "bucket": b, "sender": sender, "epoch": epoch,
             "entries": entries, "commit": commit},
        )  # fmt: skip

    async def op_repl_commit(self, msg: dict[str, Any]) -> dict[str, Any]:
        b = require(msg, "bucket", int)
        return self._step(
            b,
            {"op": "repl_commit", "bucket": b, "sender": require(msg, "sender", str),
             "epoch": require(msg, "epoch", int), "seq": require(msg, "seq", int)},
        )  # fmt: skip

    def _step(self, b: int, msg: dict[str, Any]) -> dict[str, Any]:
        """Feeds a primary's message to the core; the batches it decides are queued to the owner
        threads in this same loop step (drain), before the reply goes out."""
        res = self.core.step(msg["sender"], msg, time.monotonic())
        self.drain()
        if isinstance(res, Reject):
            raise self.refusal(b, res)
        return res

    async def op_repl_multi(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Several replication messages from one peer, handled in order; one result each."""
        results = []
        for item in require(msg, "items", list):
            if not isinstance(item, dict) or item.get("op") not in MULTI_OPS:
                op = item.get("op") if isinstance(item, dict) else None
                results.append(
                    {
                        "error": {
                            "code": "unknown_op",
                            "message": f"{op!r} not allowed in repl_multi",
                        }
                    }
                )
                continue
            try:
                results.append({"ok": await getattr(self, f"op_{item['op']}")(item)})
            except ProtocolError as exc:
                results.append({"error": exc.to_dict()})
            except StoreError as exc:  # e.g. a tensor not defined here: this message fails only
                results.append({"error": ProtocolError(exc.code, exc.message).to_dict()})
        return {"results": results}

    async def op_repl_ping(self, msg: dict[str, Any]) -> dict[str, Any]:
        sender = require(msg, "sender", str)
        pinged = require(msg, "buckets", dict)
        for key, epoch in pinged.items():
            if (
                not isinstance(key, str)
                or not (key.isascii() and key.isdigit())
                or type(epoch) is not int
            ):
                raise ProtocolError("bad_request", "field 'buckets' must map bucket ids to epochs")
        msg = {
            "op": "repl_ping",
            "sender": sender,
            "buckets": {int(k): e for k, e in pinged.items()},
        }
        res = self.core.step(sender, msg, time.monotonic())
        self.drain()
        assert not isinstance(res, Reject)
        return res

    async def ping_loop(self) -> None:
        """Primary -> secondaries heartbeats (one message per secondary for all its buckets),
        and the core's timers (the failover watchdog, lagging members) every ping_interval."""
        while not self.closing:
            await asyncio.sleep(self.ping_interval)
            by_member = self.core.pings()
            if by_member:
                await asyncio.gather(
                    *(self._ping(m, bs) for m, bs in by_member.items()), return_exceptions=True
                )
            self.core.tick(time.monotonic())
            self.drain()
            self.update_gauges()

    async def _ping(self, member: str, buckets: dict[str, int]) -> None:
        reply = await self.peers.channel(member).call(
            "repl_ping", sender=self.server_id, buckets=buckets
        )
        self.core.on_ping_reply(reply.get("stale") or [])
        self.drain()
