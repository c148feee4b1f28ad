"""The coordinator's durable state, kept on the parameter servers: a small JSON record in a
one-shard tensor, written by the ``set`` vector op (replicated, exactly once, flushed to LMDB
like every write), so that a restarted coordinator resumes the current iteration.

Encoding: element 0 and 1 are the record's byte length (low and high 16 bits), then its bytes
in little-endian pairs, one uint16 per float32 element (every value below 2^16 is exact).
Only the elements written change: a record costs its own size, not the tensor's.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from adamps.layout import TensorSpec
from coordinator.psvectors import PsVectors

#: elements of the record tensor at most (at most one shard): 2 * (CAPACITY - 2) bytes of JSON
CAPACITY = 32_768


class RecordError(ValueError):
    pass


def encode(obj: Any, capacity: int = CAPACITY) -> np.ndarray:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    if len(data) > 2 * (capacity - 2):
        raise RecordError(f"coordinator record of {len(data)} bytes exceeds {2 * (capacity - 2)}")
    padded = data + b"\0" * (len(data) % 2)
    words = np.frombuffer(padded, dtype="<u2")
    head = np.array([len(data) & 0xFFFF, len(data) >> 16], np.uint32)
    return np.concatenate([head, words.astype(np.uint32)]).astype(np.float32)


def decode(values: np.ndarray) -> Any:
    flat = np.asarray(values, np.float32).reshape(-1)
    n = int(flat[0]) | (int(flat[1]) << 16)
    if n == 0:
        return None
    words = flat[2 : 2 + (n + 1) // 2].astype("<u2")
    return json.loads(words.tobytes()[:n])


class ServerRecord:
    """One JSON record per run, in tensor ``sandblaster.<run>.state``."""

    def __init__(self, vectors: PsVectors, run: str) -> None:
        self.vectors = vectors
        # One shard, so that a record is written whole by one operation or not at all.
        self.capacity = min(CAPACITY, vectors.client.layout.max_shard_elems)
        self.spec = TensorSpec(f"sandblaster.{run}.state", (self.capacity,))
        vectors.client.create(self.spec, init={"kind": "zeros"}, optimizer={"kind": "sgd"})
        self.shards = vectors.client.layout.shards_of[self.spec.name]

    def load(self) -> Any:
        values, _ = self.vectors.client.pull([self.spec.name])
        return decode(values[self.spec.name])

    def save(self, obj: Any) -> None:
        self.vectors.write(
            self.shards, {"kind": "set", "y": "", "values": encode(obj, self.capacity), "offset": 0}
        )
