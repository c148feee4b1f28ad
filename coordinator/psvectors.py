"""The coordinator's vectors on the parameter servers: :class:`coordinator.lbfgs.VectorOps`
through the ``vec`` and ``vec_dot`` ops (adamps/server/api/vecops.py, docs/protocol-ps.md).

A vector named ``v`` of the model is, for each parameter tensor ``w``, the tensor ``w@v`` beside
it; the vector ``param`` is the parameter tensors themselves. Each operation is one request per
primary server naming the base shards it holds: what crosses the network is a few bytes per
shard, never a vector. Writes carry this coordinator's (client id, seq) and are retried with the
same pair, so each is applied exactly once across failovers.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from adamps.client import PSClient
from adamps.layout import VECTOR_SEP, Shard, TensorSpec

PARAM = "param"


def vector_tensor(base: str, vector: str) -> str:
    return base if vector == PARAM else f"{base}{VECTOR_SEP}{vector}"


class PsVectors:
    """Named vectors of the model `tensors` on the servers behind `client`."""

    def __init__(self, client: PSClient, tensors: Sequence[TensorSpec], client_id: str) -> None:
        self.client = client
        self.tensors = list(tensors)
        #: the base shards, in layout order (dot products are summed in this order: the same
        #: sum in every run, whatever the servers' answer order)
        self.shards = [s for t in self.tensors for s in client.layout.shards_of[t.name]]
        self.client_id = client_id
        self._seq = itertools.count(1)
        self._created: set[str] = {PARAM}
        self.ops = 0

    def ensure(self, *vectors: str) -> None:
        """Creates the tensors of `vectors` (zeros) unless this object did already."""
        for v in vectors:
            if v in self._created:
                continue
            for t in self.tensors:
                # SGD with lr -1: a push_dense of delta adds delta (gradient accumulation).
                self.client.create(
                    TensorSpec(vector_tensor(t.name, v), t.shape),
                    init={"kind": "zeros"},
                    optimizer={"kind": "sgd", "lr": -1.0},
                )
            self._created.add(v)

    def _name(self, v: str) -> str:
        self.ensure(v)
        return "" if v == PARAM else v

    def _write(self, kind: str, y: str, x: str | None = None, alpha: float | None = None) -> None:
        fields: dict[str, Any] = {"kind": kind, "y": self._name(y)}
        if x is not None:
            fields["x"] = self._name(x)
        if alpha is not None:
            fields["alpha"] = float(alpha)
        self.write(self.shards, fields)

    def write(self, shards: Sequence[Shard], fields: dict[str, Any]) -> None:
        """One ``vec`` write on `shards`, split by primary, retried with one (client, seq)."""
        seq = next(self._seq)
        done: set[str] = set()
        self.ops += 1

        def go(routing: Any) -> None:
            todo = [s for s in shards if s.id not in done]
            for url, group in self.client._by_server(todo, routing).items():
                self.client._rpc(url).call(
                    "vec", shards=[s.id for s in group], client=self.client_id, seq=seq, **fields
                )
                done.update(s.id for s in group)

        self.client._with_retry(go)

    def dot(self, a: str, b: str) -> float:
        per: dict[str, float] = {}
        x, y = self._name(a), self._name(b)
        self.ops += 1

        def go(routing: Any) -> None:
            todo = [s for s in self.shards if s.id not in per]
            for url, group in self.client._by_server(todo, routing).items():
                reply = self.client._rpc(url).call(
                    "vec_dot", shards=[s.id for s in group], x=x, y=y
                )
                per.update({sid: float(v) for sid, v in reply["dots"].items()})

        self.client._with_retry(go)
        return float(sum(per[s.id] for s in self.shards))

    def axpy(self, y: str, alpha: float, x: str) -> None:
        self._write("axpy", y, x, alpha)

    def scale(self, y: str, alpha: float) -> None:
        self._write("scale", y, alpha=alpha)

    def copy(self, dst: str, src: str) -> None:
        self._write("copy", dst, src)

    def mul(self, y: str, x: str) -> None:
        self._write("mul", y, x)
