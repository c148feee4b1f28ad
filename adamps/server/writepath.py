"""The write path of a parameter server: the one way a push changes its shards.

validate -> durability and lease check -> replicate or apply. Every push, from ``POST /rpc`` (``adamps/server/api/app.py``) or the
binary data plane (``adamps/server/api/dataplane.py``), comes here and nowhere else:

1. validate: the role of every shard named, then every field (dtypes, shapes, finite bounds) by
   the update kind's decoder (adamps/server/decode/, the one every copy runs on the replicated
   update), before anything is queued, so a bad request changes nothing;
2. on a replicated server, ``Replicator.push`` checks that this server is the primary of every
   bucket named, with a lease it still holds (``not_primary``, ``bucket_unavailable``), recognizes
   a retried ``(client, seq)`` (exactly once), and returns once its rounds are decided;
3. on a standalone server, the update is queued to the shards' owner threads and the push returns
   when it is applied, with the shards' new versions.

The data plane's push_dense (whole tensor or named shards, raw float32) passes the same checks
as push_dense by shard on ``/rpc`` and, on a replicated server, the same lease check, two-phase
commit and deduplication: the same meaning whichever transport.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from adamps import runs
from adamps.layout import Shard
from adamps.server.addressing import Addressing
from adamps.server.config import PsConfig
from adamps.server.decode import checked, compressed, dense, fc
from adamps.server.decode.fields import Later
from adamps.server.replication.shell import Replicator
from adamps.server.store.shards import ShardState, fc_parts
from adamps.server.store.store import Store
from adamps.server.store.tables.rowtables import RowShardState
from adamps.server.store.tickets import owner_future
from adamps.server.updates.hyper import push_hyper
from adamps.server.updates.optim import Signs
from adamps.server.write_hold import WriteHold
from adamps.wire.protocol import ProtocolError, one_form, only_fields, require


class WritePath:
    """Pushes (event-loop thread)."""

    def __init__(
        self,
        cfg: PsConfig,
        store: Store,
        addressing: Addressing,
        replicator: Replicator | None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.addressing = addressing
        #: None on a standalone server: updates are applied here alone
        self.replicator = replicator
        #: client id -> last sequence number seen (recorded; exactly-once comes with replication)
        self.clients: dict[str, int] = {}
        #: why this server must not acknowledge now (flushes failing or stalled past
        #: max_unflushed), or None: the durability check of every push (set by the server)
        self.not_durable: Callable[[], str | None] = lambda: None
        #: a consistent checkpoint's hold of new writes (adamps/server/api/checkpoint_ops.py)
        self.hold = WriteHold()

    def check_durable(self) -> None:
        """After validation, before anything is queued: a server whose updates stayed
        unflushed past max_unflushed applies nothing more (issue 29), so what a crash of every
        copy can lose stays bounded."""
        reason = self.not_durable()
        if reason is not None:
            raise ProtocolError("not_durable", reason)
        self._check_hold()

    def _check_hold(self) -> None:
        held = self.hold.refusal(time.monotonic())
        if held is not None:
            raise ProtocolError("held", held, retry_after=0.05)

    # -- POST /rpc ----------------------------------------------------------------------------------

    async def op_push_dense(self, msg: dict[str, Any]) -> dict[str, Any]:
        one_form(msg, "tensor", "shards")
        if "tensor" in msg:
            parts = dense.of_tensor(self.store, self.addressing, msg)
        else:
            deltas = require(msg, "shards", dict)
            parts = dense.of_shards(self.store, self.addressing, deltas, self._limit, arrays=True)
            parts = dense.with_hyper(parts, push_hyper(msg, self.store.tensors))
        return await self._replicate_or_apply(msg, dense.wire(parts), lambda: parts)

    @property
    def _limit(self) -> int:
        """Most shards one push may name (PsConfig.max_shards_per_request)."""
        return self.cfg.max_shards_per_request

    async def op_push_fc(self, msg: dict[str, Any]) -> dict[str, Any]:
        """One layer's vectors (`tensor`, `a`, `e`, optional `shards`), or a trainer's whole
        round (`layers`: several layers' vectors, `dense`: dense deltas of other shards) in one
        request: validated whole before anything is queued, applied under one (client, seq).
        One request instead of one per layer plus a push_dense: issue 27's profile found the
        server's event loop spending more per request than the owner threads per update."""
        wire, parts = self.decode_round(msg)
        return await self._replicate_or_apply(msg, wire, parts)

    def decode_round(
        self,
        msg: dict[str, Any],
        empty_ok: bool = False,
        later: Later | None = None,
    ) -> tuple[
        list[tuple[list[ShardState], Callable[[list[ShardState]], dict[str, Any]]]],
        Callable[[], list[tuple[ShardState, Any]]],
    ]:
        """push_fc's fields checked whole: (wire, parts), what `replicate_or_apply` takes. Also
        the dense half of a ``round`` (adamps/server/api/roundop.py; `empty_ok`: a round may carry rows alone;
        `later`: the finite bounds' passes over the arrays, proportional to their bytes, are
        appended there as (bytes, check) instead of run now: the round runs them before it
        queues anything, on a worker thread when they are large), each update with the
        hyperparameters the push names for its tensor (`hyper`)."""
        layers_: list[fc.Layer] = []
        one_form(msg, "layers", "tensor")
        if "layers" in msg:
            layers = require(msg, "layers", dict)
            for name, layer in layers.items():
                if not isinstance(name, str) or not isinstance(layer, dict):
                    raise ProtocolError(
                        "bad_request", "field 'layers' must map tensor names to {a, e, shards}"
                    )
                only_fields(layer, f"layer {name!r} of 'layers'", ("a", "e", "shards"))
                layers_.append(fc.layer(self.store, self.addressing, name, layer, later))
        elif "tensor" in msg or ("dense" not in msg and not empty_ok):
            name = require(msg, "tensor", str)
            layers_.append(fc.layer(self.store, self.addressing, name, msg, later))
        deltas = (
            dense.of_round(self.store, self.addressing, msg, self._limit, later)
            if "dense" in msg
            else []
        )
        # after the role checks of the shards named (a server without its data yet knows no
        # tensor: its unknown_tensor must not refuse a push the primary may take)
        hyper = push_hyper(msg, self.store.tensors)
        deltas = dense.with_hyper(deltas, hyper)
        if not layers_ and not deltas and not empty_ok:
            raise ProtocolError("bad_request", "push_fc needs 'tensor', or 'layers' or 'dense'")
        if len(layers_) + len(deltas) > 1:
            named = [st.id for *_, sts in layers_ for st in sts] + [st.id for st, _ in deltas]
            if len(set(named)) != len(named):
                raise ProtocolError("bad_request", "push_fc names a shard twice")
        wire: list[tuple[list[ShardState], Callable[[list[ShardState]], dict[str, Any]]]] = [
            (states, lambda sts, name=name, a=a, e=e: fc.update(
                name, [st.id for st in sts], a, e, hyper.get(name, (None, None))[1]))
            for name, _t, a, e, states in layers_
        ]  # fmt: skip
        wire += dense.wire(deltas)

        def parts() -> list[tuple[ShardState, Any]]:
            out: list[tuple[ShardState, Any]] = []
            for _name, t, a, e, states in layers_:
                out += fc_parts(t, a, e, states, hyper.get(_name, (None,))[0])
            return out + deltas

        return wire, parts

    async def prepare_compressed(
        self, msg: dict[str, Any]
    ) -> tuple[dict[str, Any], list[tuple[ShardState, Signs, Any]]]:
        """A push_compressed checked and decoded (on a worker thread when large), nothing
        queued yet: the data plane queues it (`op_push_compressed` with the parts) before it
        reads the connection's next frame."""
        decode, large = compressed.decoder(self.store, self.addressing, msg)
        return msg, (await asyncio.to_thread(decode) if large else decode())

    async def apply_compressed(
        self, prepared: tuple[dict[str, Any], list[tuple[ShardState, Signs, Any]]]
    ) -> dict[str, Any]:
        return await self.op_push_compressed(*prepared)

    async def op_push_compressed(
        self,
        msg: dict[str, Any],
        parts: list[tuple[ShardState, Signs, Any]] | None = None,
    ) -> dict[str, Any]:
        """Strom's threshold-quantized update: per shard a tau and the elements moved by +-tau
        (uint32 words, or Golomb-Rice coded index gaps). Validated whole before anything is
        queued; under replication it travels in the same compressed form. A large one is
        decoded on a worker thread (issue 28: a push of many full shards took the event loop
        for a second, and /healthz with it); `parts`: already decoded (the data plane decodes
        off the loop itself, holding the connection's later frames so that they stay behind)."""
        if parts is None:
            msg, parts = await self.prepare_compressed(msg)
        parts = compressed.with_hyper(parts, msg, self.store.tensors)
        return await self._replicate_or_apply(
            msg, compressed.wire(parts), lambda: [(st, u) for st, u, _ in parts]
        )

    # -- the data plane ---------------------------------------------------------------------------

    def accept_stream_push(self, meta: dict[str, Any], payload_len: int) -> list[Shard]:
        """The checks of a data-plane push's header, before any payload byte is buffered; returns
        the shards the payload holds, in order: the whole tensor (`tensor`) or the named shards
        one after the other (`shards`), float32 (`payload_len` must be their size). The role
        checks come with the payload (start_stream_push), so that a not_primary leaves the
        connection usable."""
        shards = self.addressing.stream_shards(meta)
        want = 4 * sum(s.size for s in shards)
        if payload_len != want:
            raise ProtocolError(
                "bad_length", f"this push_dense needs a payload of {want} bytes, got {payload_len}"
            )
        return shards

    def start_stream_push(
        self,
        payload: np.ndarray,
        meta: dict[str, Any],
        shards: list[Shard] | None = None,
        checked: bool = False,
    ) -> tuple[Any, Callable[[dict[str, int]], tuple[dict[str, Any], None]]]:
        """Validates a data-plane push exactly as push_dense by shard on /rpc (role, held shards,
        finite bounds; raises before anything is queued), then queues it now: applied at once on
        a standalone server, into its buckets' replication rounds on a replicated one (lease,
        two-phase commit, exactly once by (client, seq)). Pushes of one connection are queued
        in the order sent. `shards`: what accept_stream_push returned for this meta (else found
        again); `checked`: the whole payload already passed bounds.within (the data port's
        reader thread ran it), so check_dense is not run again on its slices. Returns (future of
        the versions, reply builder)."""
        # Zero copy: the kernel wrote the payload into this buffer; the owner threads (or the
        # replication round) read these views of it.
        delta = payload.view("<f4")
        deltas: dict[str, np.ndarray] = {}
        pos = 0
        for s in shards if shards is not None else self.addressing.stream_shards(meta):
            deltas[s.id] = delta[pos : pos + s.size].reshape(s.shape)
            pos += s.size
        if pos != delta.size:
            raise ProtocolError("bad_length", "the payload does not match the shards it names")
        parts = dense.of_shards(
            self.store, self.addressing, deltas, self._limit, arrays=False, checked=checked
        )
        self.check_durable()

        def reply(versions: dict[str, int]) -> tuple[dict[str, Any], None]:
            return {"versions": versions}, None

        if self.replicator is None:
            # Queued to the owner threads before the next request of the connection is read
            # (a pull pipelined behind it sees it).
            self._record_client(meta)
            return owner_future(lambda cb: self.store.push(parts, cb)), reply
        # Replicator.push submits to every bucket before its first await, and tasks start in
        # the order created: the pushes of one connection enter their rounds in the order sent.
        task = asyncio.ensure_future(self._replicate(meta, dense.wire(parts), parts))
        return task, lambda _r: reply({})

    # -- replicate or apply -------------------------------------------------------------------------

    def _record_client(self, msg: dict[str, Any]) -> tuple[str, int] | None:
        client = msg.get("client")
        if client is None:
            if msg.get("seq") is not None:
                # A seq alone is no pair: applied, it would look exactly-once and not be.
                raise ProtocolError("bad_request", "field 'seq' needs 'client' (the pair is both)")
            return None
        client = require(msg, "client", str)
        seq = require(msg, "seq", int)
        self.clients[client] = seq
        return client, seq

    async def _replicate_or_apply(
        self,
        msg: dict[str, Any],
        wire: list[tuple[list[ShardState], Callable[[list[ShardState]], dict[str, Any]]]],
        parts: Callable[[], list[tuple[ShardState, Any]]],
    ) -> dict[str, Any]:
        """A validated push: through the replication rounds of its buckets on a replicated
        server (`wire`: shards and the builder of their compact update), else applied here
        (`parts`: the store's form). Replicated, the parts are built now and ride with the
        compact updates (decode.Checked): this server applies them when the rounds commit,
        nothing rebuilt."""
        self.check_durable()
        if self.replicator is not None:
            return await self._replicate(msg, wire, parts())
        self._record_client(msg)
        versions = await owner_future(lambda cb: self.store.push(parts(), cb))
        return {"versions": versions}

    async def replicate_or_apply(
        self,
        msg: dict[str, Any],
        wire: list[tuple[list[ShardState], Callable[[list[ShardState]], dict[str, Any]]]],
        parts: Callable[[], list[tuple[ShardState, Any]]],
        group: bool = False,
    ) -> dict[str, Any]:
        """`_replicate_or_apply` for other writers (Sandblaster's vector ops, adamps/server/api/vecops.py); with
        `group` a standalone server applies the parts as one group per shard, alone (a barrier:
        no update queued later is applied before it; replicated, every batch is applied so).
        Replicated, the parts decoded here ride with their maps to the commit, as a push's."""
        if self.replicator is not None or not group:
            return await self._replicate_or_apply(msg, wire, parts)
        self.check_durable()
        self._record_client(msg)
        versions = await owner_future(lambda cb: self.store.push_group(parts(), cb))
        return {"versions": versions}

    async def _replicate(
        self,
        msg: dict[str, Any],
        updates: list[tuple[list[ShardState], Callable[[list[ShardState]], dict[str, Any]]]],
        parts: list[tuple[ShardState, Any]] | None,
    ) -> dict[str, Any]:
        """A checked push through the replication rounds of its buckets: (shards, compact
        update) pairs, grouped by bucket, each bucket's part a single deduplicated entry;
        `parts`: the store parts it was validated into, which this server applies when the
        rounds commit (decode.Checked), or None (built from the compact form then)."""
        assert self.replicator is not None
        # Admitted here, before the first await (a data-plane push's task may start after a
        # hold began): a push is either refused by a hold or counted until it is decided.
        self._check_hold()
        self.hold.admitted()
        try:
            return await self._replicate_admitted(msg, updates, parts)
        finally:
            self.hold.decided()

    async def _replicate_admitted(
        self,
        msg: dict[str, Any],
        updates: list[tuple[list[ShardState], Callable[[list[ShardState]], dict[str, Any]]]],
        parts: list[tuple[ShardState, Any]] | None,
    ) -> dict[str, Any]:
        assert self.replicator is not None
        of_state = _parts_by_state(updates, parts)
        by_bucket: dict[int, list[Any]] = {}
        for states, make in updates:
            per_bucket: dict[int, list[ShardState]] = {}
            for st in states:
                b = (
                    st.bucket  # an embedding table's row shard: not in the layout
                    if isinstance(st, RowShardState)
                    else self.store.layout.bucket_of[st.id]
                )
                per_bucket.setdefault(b, []).append(st)
            for b, sts in per_bucket.items():
                u = make(sts)
                if of_state is not None:
                    u = checked(u, [p for st in sts for p in of_state[id(st)]])
                by_bucket.setdefault(b, []).append(u)
        await self.replicator.push(by_bucket, self._record_client(msg))
        self._refuse_deleted(st for states, _make in updates for st in states)
        return {"versions": {}}

    def _refuse_deleted(self, states: Iterable[ShardState]) -> None:
        """A push decided while its run was deleted (docs/protocol-ps.md): its updates to the
        run's tensors or tables were refused where the deletion was known (decode.store_parts)
        or dropped with them, so the client gets unknown_tensor (unknown_table), not ok."""
        for st in states:
            if isinstance(st, RowShardState):
                name, code, known = st.table.spec.name, "unknown_table", self.store.tables.tables
            else:
                name, code, known = st.shard.tensor, "unknown_tensor", self.store.tensors
            if name not in known and runs.run_of(name) in self.store.deleted_runs:
                raise ProtocolError(
                    code,
                    f"{name!r} was deleted with its run {runs.run_of(name)!r} while this push was "
                    "in flight: its updates to it are not applied (those to other names are)",
                )


def _parts_by_state(
    updates: list[tuple[list[ShardState], Any]], parts: list[tuple[ShardState, Any]] | None
) -> dict[int, list[tuple[ShardState, Any]]] | None:
    """A validated push's store parts by shard state (id), in order, for the compact updates
    that name those shards; None (built again at commit) when there are none, or when a shard
    is named by two updates or has no part (no store part is applied twice or dropped)."""
    if parts is None:
        return None
    named = [id(st) for states, _make in updates for st in states]
    out: dict[int, list[tuple[ShardState, Any]]] = {}
    for st, upd in parts:
        out.setdefault(id(st), []).append((st, upd))
    if len(set(named)) != len(named) or set(named) != set(out):
        return None
    return out
