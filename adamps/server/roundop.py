"""The ``round`` op: everything a replica sends one server in one round, and what it fetches
next, in one request (ps-lite's ZPushPull shape; issue 36 item 2).

A round names, all optional (at least one): ``layers``, ``dense_shards`` + ``dense`` (as a
``push_fc`` round), ``compressed`` (shard -> Strom update, as ``push_compressed``'s
``shards``), ``rows`` (a list of ``{"table", "ids", "grads"}``, each as a
``push_rows``) and ``fetch_rows`` (a list of ``{"table", "ids"}``, each as a ``pull_rows``).
Nothing here decides how a write is applied: the dense half decodes into the parts push_fc
produces (``WritePath.decode_round``), each table's rows into the parts push_rows produces
(``TableOps.decode_push``), and the round's writes then take the one write path once, under
the round's (client, seq): one deduplicated entry per bucket holding its dense and row updates,
so a retried round is applied exactly once per bucket, rows included.

Every field, the fetch's included, is checked before anything is queued; a bad one changes
nothing. The fetch is read after the round's writes are applied here (on the shards' owner
threads, behind them): the rows answered include this round's own updates. A round without
writes is a read only (nothing is replicated).
"""

from __future__ import annotations

import asyncio
from typing import Any

from adamps.protocol import ProtocolError
from adamps.server.tableops import TableOps
from adamps.server.writepath import WritePath, compressed_wire, signs_with_hyper

#: most tables one round may push or fetch (each entry is checked and cut on its own)
MAX_TABLES = 64


def _entries(msg: dict[str, Any], field: str) -> list[dict[str, Any]]:
    v = msg.get(field, [])
    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise ProtocolError("bad_request", f"field {field!r} must be a list of maps")
    if len(v) > MAX_TABLES:
        raise ProtocolError(
            "too_large", f"field {field!r} has {len(v)} entries; the limit is {MAX_TABLES}"
        )
    tables = [x.get("table") for x in v]
    if len(set(map(str, tables))) != len(tables):
        raise ProtocolError("bad_request", f"field {field!r} names a table twice")
    return v


class RoundOp:
    """The ``round`` handler (event-loop thread): decoding and dispatch only."""

    def __init__(self, writes: WritePath, rows: TableOps) -> None:
        self.writes = writes
        self.rows = rows

    async def op_round(self, msg: dict[str, Any]) -> dict[str, Any]:
        row_pushes = _entries(msg, "rows")
        fetches = _entries(msg, "fetch_rows")
        wire, dense_parts = self.writes.decode_round(msg, empty_ok=True)
        signs: list[tuple[Any, Any, Any]] = []
        if "compressed" in msg:  # Strom's updates of other shards, as push_compressed's
            decode, large = self.writes.compressed_decoder({"shards": msg["compressed"]})
            signs = await asyncio.to_thread(decode) if large else decode()
            signs = signs_with_hyper(signs, msg, self.writes.store.tensors)
            named = {st.id for _wire_states, _ in wire for st in _wire_states}
            if any(st.id in named for st, _u, _d in signs):
                raise ProtocolError("bad_request", "round names a shard twice")
            wire += compressed_wire(signs)
        row_parts = []
        n_rows = 0
        for entry in row_pushes:
            n, w, parts = await self.rows.decode_push(entry)
            if not n:
                raise ProtocolError("bad_request", "a round's rows entry needs at least one id")
            n_rows += n
            wire += w
            row_parts.append(parts)
        checked = [await self.rows.check_pull(entry) for entry in fetches]
        if not wire and not checked:
            raise ProtocolError(
                "bad_request", "round needs 'layers', 'dense', 'compressed', 'rows' or 'fetch_rows'"
            )
        if wire:

            def parts() -> list[tuple[Any, Any]]:
                out = dense_parts() + [(st, u) for st, u, _d in signs]
                for p in row_parts:
                    out += p()
                return out

            await self.writes.replicate_or_apply(msg, wire, parts)
        fetched = [await self.rows.gather(*c) for c in checked]
        return {"versions": {}, "rows": n_rows, "fetched": fetched}
