"""The replicated batches' digest (adamps/server/replication/wire.py ``updates_digest``) hashes
the same bytes whatever its implementation: prepared batches persisted with their digest
(repl_persist) and peers of an older version must keep verifying. Its fast walk (issue 36) is
checked here against the plain definition, field by field, on every kind of value a batch or a
hostile peer's map may hold."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import xxhash

from adamps.server.decode import checked
from adamps.server.replication.wire import updates_digest


def reference(updates: Any) -> int:
    """The definition: every field in order, one piece each, hashed as one stream."""
    parts: list[bytes] = []

    def walk(x: Any) -> None:
        if isinstance(x, np.ndarray):
            parts.append(str(x.dtype).encode())
            if x.size:
                parts.append(np.ascontiguousarray(x).tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                parts.append(str(k).encode())
                walk(x[k])
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)
        elif isinstance(x, bytes | bytearray | memoryview):
            parts.append(bytes(x))
        else:
            parts.append(repr(x.item() if isinstance(x, np.generic) else x).encode())

    walk(updates)
    return xxhash.xxh3_64(b"".join(parts)).intdigest()


class Key(str):
    pass


class Map(dict):  # type: ignore[type-arg]
    pass


def test_the_digest_of_each_kind_of_field_is_the_definitions() -> None:
    cases: list[Any] = [
        [],
        [[{"k": "d", "s": "w/0", "d": np.arange(10, dtype=np.float32), "o": {"lr": 0.05}}]],
        [[{"k": "f", "a": np.zeros((0, 3), np.float32), "e": np.ones((2, 3), np.float32)}]],
        [[{1: 2, 10: "b", "x": None, "b": True, "z": b"raw", "y": bytearray(b"q")}]],
        [[{"m": memoryview(b"mm"), Key("k"): np.float32(1.5), "i": np.int64(3)}]],
        [[Map(a=1, b=[np.ones(5, np.float64)[::2], (1, 2.5, "s")])]],
        [[{"n": [[{"deep": [1, 2, {"x": np.arange(4, dtype=np.int32)}]}]]}]],
        # a primary's decoded updates (decode.Checked, walked as plain maps)
        [
            [
                checked(
                    {
                        "k": "r",
                        "s": "t/1",
                        "i": np.arange(3),
                        "g": np.ones((3, 2), np.float32),
                        "t": 1.5,
                        7: [np.float64(2)],
                        "o": {"lr": 0.1},
                    },
                    [],
                )
            ]
        ],
    ]
    for c in cases:
        assert updates_digest(c) == reference(c), c


def test_the_digest_of_random_nested_maps_is_the_definitions() -> None:
    rng = random.Random(36)
    leaves: list[Any] = [1, -7, 2.5, "s", None, True, False, b"b", np.float32(2), Key("t")]

    def value(depth: int) -> Any:
        r = rng.random()
        if depth > 3 or r < 0.35:
            if rng.random() < 0.3:
                return np.arange(rng.randrange(5), dtype=rng.choice([np.float32, np.int64]))
            return rng.choice(leaves)
        if r < 0.7:
            keys = ["a", "b", "k", 1, 2, "zz", Key("q")]
            return {rng.choice(keys): value(depth + 1) for _ in range(rng.randrange(5))}
        return [value(depth + 1) for _ in range(rng.randrange(4))]

    for _ in range(2000):
        x = [[value(0)]]
        assert updates_digest(x) == reference(x), x


def test_arrays_cut_anywhere_in_the_stream_change_the_digest() -> None:
    """The gathered pieces and the arrays' bytes are one stream: moving a byte between a key
    and the array after it changes what is hashed (the dtype name sits between them)."""
    a = [[{"ab": np.array([1.0], np.float32)}]]
    b = [[{"a": np.array([1.0], np.float32)}]]
    assert updates_digest(a) != updates_digest(b)
