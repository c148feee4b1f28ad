"""The read path of a parameter server: pulls of whole tensors or of shards (``POST /rpc``),
and the data plane's pull of a whole tensor. A read is a work item on the shards' owner threads,
so it sees every update queued before it, whole."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from adamps.protocol import ProtocolError, require
from adamps.server.addressing import Addressing
from adamps.server.shards import ShardState
from adamps.server.store import Store
from adamps.server.tickets import owner_future


class Reads:
    """Pulls (event-loop thread)."""

    def __init__(self, store: Store, addressing: Addressing) -> None:
        self.store = store
        self.addressing = addressing

    async def op_pull(self, msg: dict[str, Any]) -> dict[str, Any]:
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
        t = self.store.tensor(require(meta, "tensor", str))
        if payload_len != 0:
            raise ProtocolError(
                "bad_length",
                f"pull of {t.spec.name!r} needs a payload of 0 bytes, got {payload_len}",
            )
        self.addressing.held(t.spec.name)  # every shard here, or unknown_shard

    def start_stream_pull(
        self, name: str
    ) -> tuple[Any, Callable[[dict[str, int]], tuple[dict[str, Any], np.ndarray]]]:
        """Queues the read of a whole tensor now; returns (future of the versions, reply builder)."""
        sts = self.addressing.held(name)
        t = self.store.tensors[name]
        out = np.empty(t.spec.size, dtype=np.float32)
        outs = [out[st.shard.start : st.shard.stop] for st in sts]
        fut = owner_future(lambda cb: self.store.read(sts, outs, cb))
        shape = list(t.spec.shape)
        return fut, lambda versions: (
            {"shape": shape, "versions": [versions[st.id] for st in sts]},
            out,
        )
