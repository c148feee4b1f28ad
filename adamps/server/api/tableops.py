"""The row ops of a parameter server: ``pull_rows``, ``push_rows`` and ``put_rows`` (values, a
bulk load) (``POST /rpc``, and data-plane message frames); the definitions are adamps/server/storage/tablecatalog.py's.

Every request is checked whole before anything is queued (ids int64 and 1-D, at most
``MAX_IDS`` of them, grads float32 ``[len(ids), dim]``, finite and bounded, the table's dim,
the row limit under ``on_full = "reject"``); a bad one changes nothing. A push then takes the one
write path (``WritePath.replicate_or_apply``): its ids are split by bucket, each bucket's part
is one update of that bucket's row shard (``{"k": "r"}`` in a replication batch), so leases,
two-phase commit and exactly-once by (client, seq) apply as to any push. The primary stamps the
push with its wall-clock time, which every copy uses for expiry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from adamps.server.config import PsConfig
from adamps.server.decode import rows
from adamps.server.replication.shell import Replicator
from adamps.server.store.store import Store
from adamps.server.store.tables.rowblock import RowPush
from adamps.server.store.tables.rowtables import RowShardState, TableState
from adamps.server.store.tickets import owner_future
from adamps.server.writepath import WritePath
from adamps.tables import split_by_bucket
from adamps.wire.protocol import ProtocolError, require, require_array

#: most ids in one pull_rows or push_rows (a larger request is too_large)
MAX_IDS = 262_144
#: a row request naming this many ids or more is cut by bucket on a worker thread
OFF_LOOP_IDS = 16_384

T = TypeVar("T")


async def off_loop(n_ids: int, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), on a worker thread when the request names OFF_LOOP_IDS ids or more: cutting
    a push of MAX_IDS rows by bucket copies 16+ MiB, which held the event loop (issue 39)."""
    if n_ids < OFF_LOOP_IDS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


class TableOps:
    """Row pulls and pushes (event-loop thread)."""

    def __init__(
        self,
        cfg: PsConfig,
        store: Store,
        writes: WritePath,
        replicator: Replicator | None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.tables = store.tables
        self.writes = writes
        self.replicator = replicator

    # -- rows ------------------------------------------------------------------------------------

    async def _request(
        self, msg: dict[str, Any], op: str
    ) -> tuple[TableState, np.ndarray, dict[int, RowShardState], dict[int, np.ndarray]]:
        """The table, ids and per-bucket (row shard, positions) of a row request: checked whole,
        with the role of every bucket named, before anything is queued."""
        name = require(msg, "table", str)
        ids = require_array(msg, "ids", dtype="int64", shape=(None,))
        if len(ids) > MAX_IDS:
            raise ProtocolError(
                "too_large", f"{op} names {len(ids)} ids; the limit is {MAX_IDS}", limit=MAX_IDS
            )
        parts = await off_loop(len(ids), split_by_bucket, ids, self.cfg.n_buckets)
        # The role first, from the ids alone, as for shard ids (Addressing.check_ids): a server
        # that leads none of the buckets answers not_primary (the client retries elsewhere) even
        # when it does not know the table. A restarted server whose disk was lost knows no table
        # until a state transfer: its 404 unknown_table to a client with an old routing table
        # was a definite refusal of a push that the new primary had committed (the nemesis,
        # CI of session 9: "failed pushes applied").
        self.writes.addressing.check_buckets(parts, read=op == "pull_rows")
        t = self.tables.table(name)
        dim = t.spec.dim
        if "dim" in msg and require(msg, "dim", int) != dim:
            raise ProtocolError(
                "bad_shape", f"table {t.spec.name!r} has dim {dim}, the request says {msg['dim']}"
            )
        states: dict[int, RowShardState] = {}
        for b in parts:
            st = t.shards.get(b)
            if st is None:
                raise ProtocolError(
                    "unknown_shard", f"bucket {b} of table {t.spec.name!r} is not held here"
                )
            states[b] = st
        return t, ids, states, parts

    async def op_pull_rows(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"rows": await self.gather(*await self._request(msg, "pull_rows"))}

    async def check_pull(self, msg: dict[str, Any]) -> Any:
        """A pull's checks (role, table, held buckets), done now; `gather` it later (a
        ``round``'s fetch, checked before its writes and read after them)."""
        return await self._request(msg, "pull_rows")

    async def gather(
        self,
        t: TableState,
        ids: np.ndarray,
        states: dict[int, RowShardState],
        parts: dict[int, np.ndarray],
    ) -> np.ndarray:
        """The rows of a checked pull, read on the row shards' owner threads (after every
        update queued to them before)."""
        out = np.empty((len(ids), t.spec.dim), np.float32)

        def gather(st: RowShardState) -> int:
            pos = parts[st.bucket]
            tmp = np.empty((len(pos), t.spec.dim), np.float32)
            st.value.gather(ids[pos], tmp)
            out[pos] = tmp  # the buckets' positions are disjoint: owners write apart
            return st.version

        sts = list(states.values())
        await owner_future(lambda cb: self.store.call(sts, gather, cb))
        return out

    async def op_push_rows(self, msg: dict[str, Any]) -> dict[str, Any]:
        return await self.apply_push(await self.prepare_push(msg))

    async def prepare_push(
        self, msg: dict[str, Any], op: str = "push_rows"
    ) -> tuple[dict[str, Any], int, Any, Any]:
        """A push_rows (or put_rows) checked and cut, nothing queued yet (the data plane queues
        it with `apply_push` before it reads the connection's next frame)."""
        return (msg, *await self.decode_push(msg, op=op))

    async def apply_push(self, prepared: tuple[dict[str, Any], int, Any, Any]) -> dict[str, Any]:
        """A prepared push_rows through the one write path (queued in this call's first step)."""
        msg, n, wire, parts = prepared
        await self.writes.replicate_or_apply(msg, wire, parts)
        return {"rows": n, "versions": {}}

    async def op_put_rows(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Rows' values themselves (a bulk load, ``adamps table load``): the push path, each
        bucket's part one update applied by RowBlock.assign."""
        return await self.apply_push(await self.prepare_push(msg, "put_rows"))

    async def decode_push(
        self,
        msg: dict[str, Any],
        later: list[tuple[int, Callable[[], None]]] | None = None,
        op: str = "push_rows",
    ) -> tuple[int, Any, Any]:
        """A push_rows' (or put_rows') fields checked whole and cut by bucket: (ids, wire,
        parts), what `replicate_or_apply` takes (also one table's rows of a ``round``,
        roundop.py, which passes `later`: the grads' finite bounds are appended there as
        (bytes, check), to be run before anything is queued, as WritePath.decode_round's)."""
        t, ids, states, parts = await self._request(msg, op)
        if not len(ids):
            raise ProtocolError("bad_request", f"{op} needs at least one id")
        assign = op == "put_rows"
        field = "values" if assign else "grads"
        grads = require_array(msg, field, shape=(len(ids), t.spec.dim), finite=False)

        def check() -> None:  # what every copy checks of the replicated update (decode/rows.py)
            rows.check_values(field, ids, grads, assign)

        if later is None:  # a pass over every value (and a sort): off the loop when large
            await off_loop(len(ids), check)
        else:
            later.append((grads.nbytes, check))
        adm = t.spec.admission
        if t.limit is not None and adm.on_full == "reject" and adm.admit_after == 1:
            for b, st in states.items():
                new = st.value.missing(ids[parts[b]])
                if new and st.value.n + new > t.limit:
                    self.tables.m.rejected.labels(t.spec.name).inc()
                    raise ProtocolError(
                        "table_full",
                        f"table {t.spec.name!r}: bucket {b} holds {st.value.n} of its "
                        f"{t.limit} rows and this push would add {new}",
                        table=t.spec.name,
                        bucket=b,
                        limit=t.limit,
                    )

        def cut() -> list[tuple[RowShardState, np.ndarray, np.ndarray]]:
            return [
                (states[b], np.ascontiguousarray(ids[pos]), np.ascontiguousarray(grads[pos]))
                for b, pos in parts.items()
            ]

        pieces = await off_loop(len(ids), cut)
        now = time.time()
        wire = [
            ([st], lambda _sts, st=st, i=i, g=g: rows.update(st.id, i, g, now, assign))
            for st, i, g in pieces
        ]
        return len(ids), wire, lambda: [(st, RowPush(i, g, now, assign)) for st, i, g in pieces]
