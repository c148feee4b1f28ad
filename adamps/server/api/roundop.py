"""The ``round`` op: everything a replica sends one server in one round, and what it fetches
next, in one request (ps-lite's ZPushPull shape; issue 36 item 2).

A round names, all optional (at least one): ``layers``, ``dense_shards`` + ``dense`` (as a
``push_fc`` round), ``compressed`` (shard -> Strom update, as ``push_compressed``'s
``shards``), ``rows`` (a list of ``{"table", "ids", "grads"}``, each as a
``push_rows``), ``fetch_rows`` (a list of ``{"table", "ids"}``, each as a ``pull_rows``) and
``fetch_shards`` (dense shard ids, each as a ``pull`` of shards: the answer's ``values``, in
that order, read after the round's writes; a synchronous Downpour step's push and fetch in one
request per server, not a round and a pull).
Nothing here decides how a write is applied: each part is decoded by its kind's decoder
(adamps/server/decode/): the dense half into the parts push_fc produces
(``WritePath.decode_round``), each table's rows into the parts push_rows produces
(``TableOps.decode_push``), the compressed updates into push_compressed's, and the round's writes then take the one write path once, under
the round's (client, seq): one deduplicated entry per bucket holding its dense and row updates,
so a retried round is applied exactly once per bucket, rows included.

Every field, the fetch's included, is checked before anything is queued; a bad one changes
nothing. The checks that read the server's state (ids, roles, held shards; a few per shard)
run on the event loop; the work that grows with the round's bytes (the finite bounds' passes
over dense deltas, fc vectors and row gradients, and the expansion of compressed updates) runs
on a worker thread when it is large (issue 39: a round is one request for a replica's whole
step, so its arrays are as large as the model's update). The fetch is read after the round's
writes are applied here (on the shards' owner threads, behind them): the rows answered include
this round's own updates. A round without writes is a read only (nothing is replicated).

``prepare`` and ``apply`` are the two halves: the data plane reads no later frame of a
connection between them, so a request pipelined behind a round is queued after its writes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from adamps.server.api.tableops import TableOps
from adamps.server.decode import compressed
from adamps.server.store.tickets import owner_future
from adamps.server.writepath import WritePath
from adamps.wire.protocol import ProtocolError, only_fields

#: most tables one round may push or fetch (each entry is checked and cut on its own)
MAX_TABLES = 64
#: bytes of bounds checks from which a round runs them on a worker thread: a min and a max
#: pass over 4 MiB take about 1.2 ms here, over 64 MiB 20 ms; a hop to a thread and back costs
#: tens of microseconds
CHECK_OFF_LOOP = 4 << 20


#: the fields of an entry of a round's `rows` (as push_rows') and `fetch_rows` (as pull_rows')
_ENTRY_FIELDS = {"rows": ("table", "ids", "grads", "dim"), "fetch_rows": ("table", "ids", "dim")}


def _entries(msg: dict[str, Any], field: str) -> list[dict[str, Any]]:
    v = msg.get(field, [])
    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise ProtocolError("bad_request", f"field {field!r} must be a list of maps")
    if len(v) > MAX_TABLES:
        raise ProtocolError(
            "too_large", f"field {field!r} has {len(v)} entries; the limit is {MAX_TABLES}"
        )
    for x in v:  # an entry's misspelled field is refused, as a request's (opfields.py)
        only_fields(x, f"op 'round': an entry of {field!r}", _ENTRY_FIELDS[field], op="round")
    tables = [x.get("table") for x in v]
    if len(set(map(str, tables))) != len(tables):
        raise ProtocolError("bad_request", f"field {field!r} names a table twice")
    return v


@dataclass
class Prepared:
    """A round checked whole and decoded, nothing queued yet."""

    msg: dict[str, Any]
    wire: list[Any]
    #: the store parts of the round's writes (built when they are queued)
    parts: Callable[[], list[tuple[Any, Any]]]
    n_rows: int
    #: the fetches, checked (TableOps.check_pull)
    checked: list[Any]
    #: the dense shards whose values the answer carries (``fetch_shards``), checked
    values: list[Any]


class RoundOp:
    """The ``round`` handler (event-loop thread): decoding and dispatch only."""

    def __init__(self, writes: WritePath, rows: TableOps) -> None:
        self.writes = writes
        self.rows = rows

    async def op_round(self, msg: dict[str, Any]) -> dict[str, Any]:
        return await self.apply(await self.prepare(msg))

    async def prepare(self, msg: dict[str, Any]) -> Prepared:
        """Every field checked and decoded (the large work on a worker thread); raises before
        anything is queued."""
        row_pushes = _entries(msg, "rows")
        fetches = _entries(msg, "fetch_rows")
        later: list[tuple[int, Callable[[], None]]] = []
        wire, dense_parts = self.writes.decode_round(msg, empty_ok=True, later=later)
        decode: Callable[[], list[Any]] = list
        codes = 0
        if "compressed" in msg:  # Strom's updates of other shards, as push_compressed's
            shards = {"shards": msg["compressed"]}
            decode, _large = compressed.decoder(self.writes.store, self.writes.addressing, shards)
            codes = compressed.codes(msg["compressed"])
        row_parts = []
        n_rows = 0
        for entry in row_pushes:
            n, w, parts = await self.rows.decode_push(entry, later)
            if not n:
                raise ProtocolError("bad_request", "a round's rows entry needs at least one id")
            n_rows += n
            wire += w
            row_parts.append(parts)
        checked = [await self.rows.check_pull(entry) for entry in fetches]
        values: list[Any] = []
        if "fetch_shards" in msg:  # dense values, as a pull of shards: checked now, read last
            values = self.writes.addressing.shard_ids(msg, "fetch_shards")
            self.writes.addressing.check_serving(values)

        def work() -> list[Any]:
            for _nbytes, check in later:
                check()
            return decode()

        large = codes > compressed.DECODE_OFF_LOOP or sum(n for n, _ in later) >= CHECK_OFF_LOOP
        signs = await asyncio.to_thread(work) if large else work()
        if signs:  # (the hyper itself was checked whole by decode_round: not again)
            signs = compressed.with_hyper(signs, msg, self.writes.store.tensors)
        if signs:
            named = {st.id for _wire_states, _ in wire for st in _wire_states}
            if any(st.id in named for st, _u, _d in signs):
                raise ProtocolError("bad_request", "round names a shard twice")
            wire += compressed.wire(signs)
        if not wire and not checked and not values:
            raise ProtocolError(
                "bad_request",
                "round needs 'layers', 'dense', 'compressed', 'rows', 'fetch_rows' or "
                "'fetch_shards'",
            )

        def parts() -> list[tuple[Any, Any]]:
            out = dense_parts() + [(st, u) for st, u, _d in signs]
            for p in row_parts:
                out += p()
            return out

        return Prepared(msg, wire, parts, n_rows, checked, values)

    async def apply(self, r: Prepared) -> dict[str, Any]:
        """A prepared round's writes through the one write path (queued in this call's first
        step), then its fetches, read behind them."""
        if r.wire:
            await self.writes.replicate_or_apply(r.msg, r.wire, r.parts)
        fetched = [await self.rows.gather(*c) for c in r.checked]
        out: dict[str, Any] = {"versions": {}, "rows": r.n_rows, "fetched": fetched}
        if r.values:  # read on the owner threads, behind this round's writes (as a pull)
            outs = [np.empty(st.shard.shape, np.float32) for st in r.values]
            store = self.writes.store
            vers = await owner_future(lambda cb: store.read(r.values, outs, cb))
            out["values"] = outs
            # each shard's version (the updates it has applied), as a pull answers them: a
            # staleness-aware replica measures the others' updates between its fetches
            out["value_versions"] = [int(vers[st.id]) for st in r.values]
        return out
