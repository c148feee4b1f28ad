"""The secondary side of replication: PREPARE, COMMIT and pings from a bucket's primary, the
primary's pings to its secondaries, and the watchdog that proposes a role change to the
controllers when a primary stays silent for ``failover_after``."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from adamps.client.rpc import RpcError
from adamps.core.replication import Reject
from adamps.protocol import ProtocolError, require
from adamps.server.repl_check import check_batches
from adamps.server.repl_wire import MULTI_OPS, batch_from_wire, store_parts
from adamps.server.shards import StoreError

log = logging.getLogger("adamps.server.replicate")


class Follower:
    """Replication messages as a member of a bucket, and the pings between members.

    A part of :class:`adamps.server.replicate.Replicator`, which holds the state its methods
    use (``buckets``, ``roles``, ``leases``, ``peers``, ``controller``, ``store``, ``m``)."""

    async def op_repl_prepare(self, msg: dict[str, Any]) -> dict[str, Any]:
        b = require(msg, "bucket", int)
        rep = self.known(b)
        raw = require(msg, "entries", list)
        if not all(isinstance(e, dict) for e in raw):
            raise ProtocolError("bad_request", "field 'entries' must be a list of batches")
        entries = [batch_from_wire(e) for e in raw]
        # Every copy re-checks what it will apply (shapes, finiteness, bounds), whoever sent it:
        # nothing is kept of a batch the primary itself would have refused as a push.
        check_batches(self.store, entries)
        for e in entries:
            store_parts(self.store, e.updates)
        sender, epoch = require(msg, "sender", str), require(msg, "epoch", int)
        commit = require(msg, "commit", int, default=0)
        res = rep.on_prepare(sender, epoch, entries)
        if isinstance(res, Reject):
            raise self.reject(res, b)
        self.last_heard[b] = time.monotonic()
        reply: dict[str, Any] = {"status": res[0], "seq": res[1]}
        # The primary's committed seq rides along (Raft's leaderCommit): what it says was decided
        # is applied now, as an explicit COMMIT would be, and the reply tells the primary so.
        upto = min(commit, rep.prepared_seq)
        if res[0] == "ok" and upto > rep.committed:
            done = rep.on_commit(sender, epoch, upto)
            if not isinstance(done, Reject | tuple):
                self.apply_batches(done)
                reply["committed"] = rep.committed
        return reply

    async def op_repl_commit(self, msg: dict[str, Any]) -> dict[str, Any]:
        b = require(msg, "bucket", int)
        rep = self.known(b)
        res = rep.on_commit(
            require(msg, "sender", str), require(msg, "epoch", int), require(msg, "seq", int)
        )
        if isinstance(res, Reject):
            raise self.reject(res, b)
        self.last_heard[b] = time.monotonic()
        if isinstance(res, tuple):
            return {"status": res[0], "seq": res[1]}
        # Decided and queued to the owner threads in seq order: every later read, snapshot or
        # digest on this server queues behind it, so the ack need not wait for the application.
        self.apply_batches(res)
        return {"status": "ok", "seq": rep.committed}

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
        now = time.monotonic()
        stale = []
        pinged = require(msg, "buckets", dict)
        for key, epoch in pinged.items():
            if (
                not isinstance(key, str)
                or not (key.isascii() and key.isdigit())
                or type(epoch) is not int
            ):
                raise ProtocolError("bad_request", "field 'buckets' must map bucket ids to epochs")
        for key, epoch in pinged.items():
            rep = self.buckets.get(int(key))
            if rep is None:
                continue
            if rep.assignment.epoch == epoch and rep.assignment.primary == sender:
                self.last_heard[int(key)] = now
            elif epoch < rep.assignment.epoch:
                stale.append(int(key))
            else:
                self.request_heartbeat()
        return {"stale": stale}

    async def ping_loop(self) -> None:
        """Primary -> secondaries heartbeats (one message per secondary for all its buckets)."""
        while not self.closing:
            await asyncio.sleep(self.ping_interval)
            by_member: dict[str, dict[str, int]] = {}
            for b, role in self.roles.items():
                if role != "primary":
                    continue
                rep = self.buckets[b]
                for m in rep.replicas:
                    by_member.setdefault(m, {})[str(b)] = rep.assignment.epoch
            if by_member:
                await asyncio.gather(
                    *(self._ping(m, bs) for m, bs in by_member.items()), return_exceptions=True
                )
            for b, role in list(self.roles.items()):
                if role == "primary" and self.buckets[b].lagging():
                    self.kick(b)
            self._watchdog()
            self.update_gauges()

    async def _ping(self, member: str, buckets: dict[str, int]) -> None:
        reply = await self.peers.channel(member).call(
            "repl_ping", sender=self.server_id, buckets=buckets
        )
        if reply.get("stale"):
            self.m.stale.inc(len(reply["stale"]))
            self.request_heartbeat()

    def _watchdog(self) -> None:
        """Secondary side: a primary silent for failover_after gets a role-change proposal."""
        now = time.monotonic()
        for b, role in list(self.roles.items()):
            if role != "secondary":
                continue
            heard = self.last_heard.get(b, now)
            if now - heard > self.failover_after and now >= self.role_change_after.get(b, 0):
                self.role_change_after[b] = now + self.failover_after
                asyncio.create_task(self._propose(b), name=f"role-change-{b}")

    async def _propose(self, b: int) -> None:
        rep = self.buckets.get(b)
        if rep is None:
            return
        log.warning(
            "bucket %d: primary %s silent; proposing a role change", b, rep.assignment.primary
        )
        try:
            await self.controller.role_change(
                b,
                self.server_id,
                rep.assignment.epoch,
                {self.server_id: [rep.assignment.epoch, rep.prepared_seq]},
            )
        except RpcError as exc:
            retry = exc.extra.get("retry_after")
            if retry:
                self.role_change_after[b] = time.monotonic() + float(retry)
            log.info("bucket %d: role change not accepted: %s", b, exc.message)
        except (ConnectionError, TimeoutError) as exc:
            log.info("bucket %d: role change failed: %s", b, exc)
        self.request_heartbeat()
