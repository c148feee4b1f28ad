"""Which shards a request names, and whether this server serves them now: every shard held here
and, under replication, only buckets this server is the primary of with a lease it still holds.
Shared by the read path (``reads.py``) and the write path (``writepath.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from adamps.layout import Shard, stable_bucket
from adamps.server.config import PsConfig
from adamps.server.replication.shell import Replicator
from adamps.server.store.shards import ShardState
from adamps.server.store.store import Store
from adamps.wire.protocol import ProtocolError, one_form, require


class Addressing:
    """Checks of the shard and tensor names of one request (event-loop thread)."""

    def __init__(self, cfg: PsConfig, store: Store, replicator: Replicator | None) -> None:
        self.cfg = cfg
        self.store = store
        #: None on a standalone server (no lease to check)
        self.replicator = replicator

    def held(self, name: str) -> list[ShardState]:
        """Every shard of tensor `name`, which must all be held here."""
        t = self.store.tensor(name)
        if not t.held_all:
            missing = [s.id for s in t.layout_shards if s.index not in t.shards]
            raise ProtocolError(
                "unknown_shard",
                f"tensor {name!r}: {len(missing)} of its shards are not on this server; address them by shard id",
                missing=missing[:20],
            )
        return [t.shards[s.index] for s in t.layout_shards]

    def unique_names(
        self, msg: dict[str, Any], field: str, what: str, twice_ok: bool = True
    ) -> list[str]:
        """Field `field`: a list of strings, duplicates removed (issue 12: a pull naming one shard
        N times built N copies) or, unless `twice_ok`, refused; at most max_shards_per_request."""
        names = require(msg, field, list)
        if not all(isinstance(i, str) for i in names):
            raise ProtocolError("bad_request", f"field {field!r} must be a list of {what}")
        unique = list(dict.fromkeys(names))
        if not twice_ok and len(unique) != len(names):
            raise ProtocolError("bad_request", f"field {field!r} names a shard twice")
        names = unique
        if len(names) > self.cfg.max_shards_per_request:
            raise ProtocolError(
                "too_large",
                f"field {field!r} names {len(names)} {what}; the limit is "
                f"{self.cfg.max_shards_per_request}",
                limit=self.cfg.max_shards_per_request,
            )
        return names

    def shard_ids(self, msg: dict[str, Any], field: str, twice_ok: bool = True) -> list[ShardState]:
        ids = self.unique_names(msg, field, "shard ids (strings)", twice_ok)
        self.check_ids(ids)
        return [self.store.shard(i) for i in ids]

    def check_ids(self, ids: Any) -> None:
        """Under replication, a shard this server is not the primary for is not_primary (even if
        the server does not know its tensor yet): the bucket follows from the id alone."""
        if self.replicator is not None:
            self.check_buckets(
                {stable_bucket(i, self.cfg.n_buckets) for i in ids if isinstance(i, str)}
            )

    def check_buckets(self, buckets: Iterable[int], read: bool = False) -> None:
        """Under replication, this server must be the primary of every bucket, with its lease
        (a `read`: with every acknowledged push applied), else not_primary naming the first
        refused: one step of the replication core for all of them (issue 36: a push_rows
        names most buckets, and a step per bucket drained the core's Ready each time). A query:
        it brings no deadline (a heartbeat it asks for is a step of its own), so the clock does
        not walk every bucket after it (issue 36: a data-plane push's header is checked in a
        loop step of its own)."""
        r = self.replicator
        if r is not None:
            r.step(-1, r.core.check_primaries, buckets, read=read, ahead=float("inf"))

    def stream_shards(self, meta: dict[str, Any]) -> list[Shard]:
        """The shards a data-plane frame names, in payload order: every shard of `tensor` (which
        must all be held here), or the `shards` list (unique ids of defined tensors; under
        replication an id of a bucket this server does not lead is not_primary). Their sizes fix
        the payload's length, so this runs on the header, before any payload byte is buffered."""
        one_form(meta, "tensor", "shards")
        if "shards" not in meta:
            name = require(meta, "tensor", str)
            return [st.shard for st in self.held(name)]
        ids = self.unique_names(meta, "shards", "shard ids (strings)", twice_ok=False)
        if not ids:
            raise ProtocolError("bad_request", "field 'shards' must name at least one shard")
        out = []
        for sid in ids:
            s = self.store.layout.shards.get(sid)
            if s is None:
                self.check_ids([sid])  # a bucket led elsewhere: not_primary, even if unknown here
                raise ProtocolError("unknown_shard", f"no shard {sid!r} on this server")
            out.append(s)
        return out

    def check_serving(self, states: list[ShardState]) -> None:
        """Under replication, only the primary of a bucket with a live lease serves it."""
        if self.replicator is not None:
            self.check_buckets({self.store.layout.bucket_of[st.id] for st in states}, read=True)
