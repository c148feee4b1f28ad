"""The replication ops a parameter server serves to its peers (POST /rpc and the data plane's
repl_multi frames): the sender's proof (peer_keys.py), the message decoded (wire.py) and
its batches re-checked (check.py), then into the core (``Replicator.step``), which takes
every decision; a state transfer's store reads are bucket_copy.py's."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from adamps.core.replication import copies as repl_copies
from adamps.server.replication import bucket_copy
from adamps.server.replication.check import checked_message
from adamps.server.replication.wire import MULTI_OPS, REPL_OPS, check_repl_fields, multi_results
from adamps.wire.protocol import require


class PeerOps:
    """The peer-facing ops of one server's replication. `repl` is its Replicator (typed loosely:
    the Replicator is the layer above, which imports this module)."""

    def __init__(self, repl: Any) -> None:
        self.repl = repl
        #: the replication ops this server serves on POST /rpc (peer traffic), by name: a
        #: primary's messages go to the core as they are (``_step``)
        self.handlers: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
            **{op: functools.partial(self._step, op) for op in MULTI_OPS},
            "repl_multi": self.op_repl_multi,
            "repl_snapshot": self.op_repl_snapshot,
            "digest": self.op_digest,
        }
        assert set(self.handlers) == set(REPL_OPS)

    async def op_from_peer(self, op: str, msg: dict[str, Any], peer: str | None) -> dict[str, Any]:
        """A replication op whose request `peer` proved it sent (None: no proof)."""
        self.repl.peer_keys.admit(op, msg, peer)
        return await self.handlers[op](msg)

    async def op_repl_frame(
        self, meta: dict[str, Any], meta_raw: bytes, payload: np.ndarray | None
    ) -> dict[str, Any]:
        """A repl_multi frame of the data plane: its MAC (the payload's last MAC_SIZE bytes)
        checked before the message is used (PeerKeys.frame)."""
        peer, msg = await self.repl.peer_keys.frame(meta, meta_raw, payload)
        return await self.op_from_peer("repl_multi", msg, peer)

    async def _step(self, op: str, msg: dict[str, Any]) -> dict[str, Any]:
        return self.repl.carrier.peer_message(await self._check(op, msg))

    async def _check(self, op: str, msg: dict[str, Any]) -> dict[str, Any]:
        # Every copy re-checks what it will apply (repl_check.checked_message), whoever sent it.
        return await checked_message(self.repl.store, self.repl.core.buckets, op, msg)

    async def op_repl_multi(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Several replication messages from one peer, in order, one result each: every one
        checked first, then all stepped into the core as one event, their Ready carried out
        once before the reply goes (Carrier.batch)."""
        carrier = self.repl.carrier
        return await multi_results(
            msg, lambda m: self._check(m["op"], m), carrier.peer_message, carrier.batch
        )

    async def op_repl_snapshot(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A consistent copy of a bucket for a joining copy: the core makes the joiner a learner
        and gives the position; the reads are queued in the same loop step, so the values match
        the position exactly (every later round waits for the joiner)."""
        check_repl_fields("repl_snapshot", msg)
        b = require(msg, "bucket", int)
        joiner = require(msg, "joiner", str)
        join = require(msg, "join", int, default=0)
        meta = self.repl.step(b, self.repl.core.snapshot_for, b, joiner, join)
        snap = await bucket_copy.read_snapshot(self.repl.store, self.repl.catalog, b, meta)
        self.repl.m.snapshots.labels("sent").inc()
        return snap

    async def op_digest(self, msg: dict[str, Any]) -> dict[str, Any]:
        check_repl_fields("digest", msg)
        b = require(msg, "bucket", int)
        digest = await bucket_copy.digest(self.repl.store, b)
        return {"bucket": b, "digest": digest, **repl_copies.position(self.repl.core, b)}
