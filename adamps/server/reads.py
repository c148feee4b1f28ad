"""The read path of a parameter server: pulls of whole tensors or of shards (``POST /rpc``),
and the data plane's pulls (a whole tensor, or shards). A read is a work item on the shards' owner threads,
so it sees every update queued before it, whole."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from adamps.server.addressing import Addressing
from adamps.server.store.shards import ShardState
from adamps.server.store.store import Store
from adamps.server.store.tickets import owner_future
from adamps.wire.protocol import ProtocolError, one_form


class Reads:
    """Pulls (event-loop thread)."""

    def __init__(self, store: Store, addressing: Addressing) -> None:
        self.store = store
        self.addressing = addressing

    async def op_pull(self, msg: dict[str, Any]) -> dict[str, Any]:
        one_form(msg, "tensors", "shards")
        if "tensors" in msg:
            names = self.addressing.unique_names(msg, "tensors", "tensor names")
            states: list[ShardState] = []
            outs: list[np.ndarray] = []
            whole: dict[str, np.ndarray] = {}
            for name in names:
                sts = self.addressing.held(name)
                arr = np.empty(self.store.tensors[name].spec.shape, dtype=np.float32)
                flat = arr.reshape(-1)
                whole[name] = arr
                states += sts
                outs += [flat[st.shard.start : st.shard.stop] for st in sts]
            self.addressing.check_serving(states)
            versions = await owner_future(lambda cb: self.store.read(states, outs, cb))
            return {
                "tensors": whole,
                "versions": {n: [versions[st.id] for st in self.addressing.held(n)] for n in names},
            }
        states = self.addressing.shard_ids(msg, "shards")
        self.addressing.check_serving(states)
        outs = [np.empty(st.shard.shape, dtype=np.float32) for st in states]
        versions = await owner_future(lambda cb: self.store.read(states, outs, cb))
        return {
            "shards": {st.id: out for st, out in zip(states, outs, strict=True)},
            "versions": {st.id: versions[st.id] for st in states},
        }

    # -- the data plane ---------------------------------------------------------------------------

    def accept_stream_pull(self, meta: dict[str, Any], payload_len: int) -> None:
        """The checks of a data-plane pull's header, before its (empty) payload."""
        self.addressing.stream_shards(meta)
        if payload_len != 0:
            raise ProtocolError(
                "bad_length", f"a pull needs a payload of 0 bytes, got {payload_len}"
            )

    def start_stream_pull(
        self, meta: dict[str, Any]
    ) -> tuple[Any, Callable[[dict[str, int]], tuple[dict[str, Any], np.ndarray]]]:
        """Queues the read of a whole tensor or of the named shards (one after the other in the
        payload) now; under replication only from a primary with a live lease, as on /rpc.
        Returns (future of the versions, reply builder)."""
        shards = self.addressing.stream_shards(meta)
        states = [self.store.shard(s.id) for s in shards]
        self.addressing.check_serving(states)
        out = np.empty(sum(s.size for s in shards), dtype=np.float32)
        outs, pos = [], 0
        for s in shards:
            outs.append(out[pos : pos + s.size])
            pos += s.size
        fut = owner_future(lambda cb: self.store.read(states, outs, cb))
        if "shards" in meta:
            ids = [s.id for s in shards]
            return fut, lambda versions: ({"versions": [versions[i] for i in ids]}, out)
        shape = list(self.store.tensors[shards[0].tensor].spec.shape)
        return fut, lambda versions: (
            {"shape": shape, "versions": [versions[s.id] for s in shards]},
            out,
        )
