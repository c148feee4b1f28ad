"""The replication ops a parameter server serves to its peers (POST /rpc and the data plane's
repl_multi frames): authentication of the sender, decoding and checking of the fields, then the
message goes to the replication core (``Replicator.feed``). No decision is taken here: epochs,
roles, the commit riding on a PREPARE and the watchdog's clock are the core's
(adamps.core.repl_core); the store's reads and installs of a state transfer are
repl_transfer.py's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from adamps import peer_auth
from adamps.protocol import ProtocolError, require
from adamps.server import repl_transfer
from adamps.server.peer_keys import forbidden
from adamps.server.repl_check import check_batches
from adamps.server.repl_wire import MULTI_OPS, REPL_OPS, batch_from_wire, store_parts
from adamps.server.shards import StoreError


class PeerOps:
    """The peer-facing ops of one server's replication. `repl` is its Replicator (typed loosely:
    the Replicator is the layer above, which imports this module)."""

    def __init__(self, repl: Any) -> None:
        self.repl = repl

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]]:
        """The replication ops this server serves on POST /rpc (peer traffic), by name."""
        return {op: getattr(self, f"op_{op}") for op in REPL_OPS}

    async def op_from_peer(self, op: str, msg: dict[str, Any], peer: str | None) -> dict[str, Any]:
        """A replication op whose request `peer` proved it sent (None: no proof); with peer
        identity on, refused unless every sender the message names is that server."""
        keys = self.repl.peer_keys
        if keys.enabled:
            if peer is None:
                raise forbidden(op, "no peer credential in the request")
            keys.check_senders(op, msg, peer)
        return await getattr(self, f"op_{op}")(msg)

    async def peer_of_request(self, op: str, header: str | None, body: Any) -> str | None:
        """The server whose MAC of `body` the PEER_HEADER value `header` carries, or None when
        there is none or identity is off; ProtocolError forbidden for a wrong one."""
        if header is None or not self.repl.peer_keys.enabled:
            return None
        parsed = peer_auth.parse_header(header)
        if parsed is None:
            raise forbidden(op, f"malformed {peer_auth.PEER_HEADER} header")
        return await self.repl.peer_keys.prover(op, [body], *parsed)

    async def op_repl_frame(
        self, meta: dict[str, Any], meta_raw: bytes, payload: np.ndarray | None
    ) -> dict[str, Any]:
        """A repl_multi frame of the data plane: its MAC (the payload's last MAC_SIZE bytes)
        checked before the message is used (PeerKeys.frame)."""
        peer, msg = await self.repl.peer_keys.frame(meta, meta_raw, payload)
        return await self.op_from_peer("repl_multi", msg, peer)

    async def op_repl_prepare(self, msg: dict[str, Any]) -> dict[str, Any]:
        b = require(msg, "bucket", int)
        raw = require(msg, "entries", list)
        if not all(isinstance(e, dict) for e in raw):
            raise ProtocolError("bad_request", "field 'entries' must be a list of batches")
        entries = [batch_from_wire(e) for e in raw]
        sender, epoch = require(msg, "sender", str), require(msg, "epoch", int)
        commit = require(msg, "commit", int, default=0)
        if b in self.repl.core.buckets:
            # Every copy re-checks what it will apply (shapes, finiteness, bounds), whoever sent
            # it: nothing is kept of a batch the primary itself would have refused as a push.
            store = self.repl.store
            check_batches(store, entries)
            for e in entries:
                store_parts(store, e.updates)
        return self.repl.feed(
            b,
            {"op": "repl_prepare", "bucket": b, "sender": sender, "epoch": epoch,
             "entries": entries, "commit": commit},
        )  # fmt: skip

    async def op_repl_commit(self, msg: dict[str, Any]) -> dict[str, Any]:
        b = require(msg, "bucket", int)
        return self.repl.feed(
            b,
            {"op": "repl_commit", "bucket": b, "sender": require(msg, "sender", str),
             "epoch": require(msg, "epoch", int), "seq": require(msg, "seq", int)},
        )  # fmt: skip

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
        buckets = {int(k): e for k, e in pinged.items()}
        return self.repl.feed(-1, {"op": "repl_ping", "sender": sender, "buckets": buckets})

    async def op_repl_multi(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Several replication messages from one peer, handled in order; one result each."""
        results = []
        for item in require(msg, "items", list):
            if not isinstance(item, dict) or item.get("op") not in MULTI_OPS:
                op = item.get("op") if isinstance(item, dict) else None
                err = {"code": "unknown_op", "message": f"{op!r} not allowed in repl_multi"}
                results.append({"error": err})
                continue
            try:
                results.append({"ok": await getattr(self, f"op_{item['op']}")(item)})
            except ProtocolError as exc:
                results.append({"error": exc.to_dict()})
            except StoreError as exc:  # e.g. a tensor not defined here: this message fails only
                results.append({"error": ProtocolError(exc.code, exc.message).to_dict()})
        return {"results": results}

    async def op_repl_snapshot(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A consistent copy of a bucket for a joining copy: the core makes the joiner a learner
        and gives the position; the reads are queued in the same loop step, so the values match
        the position exactly (every later round waits for the joiner)."""
        b = require(msg, "bucket", int)
        joiner = require(msg, "joiner", str)
        join = require(msg, "join", int, default=0)
        meta = self.repl.snapshot_meta(b, joiner, join)
        snap = await repl_transfer.read_snapshot(self.repl.store, self.repl.catalog, b, meta)
        self.repl.m.snapshots.labels("sent").inc()
        return snap

    async def op_digest(self, msg: dict[str, Any]) -> dict[str, Any]:
        b = require(msg, "bucket", int)
        rep = self.repl.core.buckets.get(b)
        return {
            "bucket": b,
            "digest": await repl_transfer.digest(self.repl.store, b),
            "committed": rep.committed if rep else None,
            "role": self.repl.core.roles.get(b),
            "epoch": rep.assignment.epoch if rep else None,
        }
