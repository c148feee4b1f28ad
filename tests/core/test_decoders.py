"""Issue 41, item 2 (and issue 36, item 3): one decoder per update kind, used by the primary,
every copy and installs alike (adamps/server/decode/).

For every kind (dense delta, fc vectors, Strom's compressed update, table rows and put_rows'
values, a checkpoint's shard and row-shard install, a vector op): bad input (a wrong dtype or
shape, NaN, an index out of range, a truncated payload, a field of the wrong type) is refused
with its code by the request decoder the primary runs, and the same bad update arriving in a
PREPARE is refused by a secondary through the very intake ``ReplOps`` runs
(``repl_check.checked_message``), with the same code. Before, a copy ran checks of its own: a
checkpoint install of NaN values, a row block of NaN rows and a put_rows naming an id twice
reached every secondary, which the primary would have refused.

A real Store (owner threads) and the real wire encoding; no sockets.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adamps.compression import codec
from adamps.core.replication.values import Batch
from adamps.layout import TensorSpec
from adamps.server import decode
from adamps.server.addressing import Addressing
from adamps.server.config import PsConfig
from adamps.server.decode import compressed, dense, fc, install, rows, vector
from adamps.server.replication import bucket_copy
from adamps.server.replication import check as repl_check
from adamps.server.replication.wire import batch_to_wire, updates_digest
from adamps.server.store.initial import normalize_init
from adamps.server.store.shards import StoreError
from adamps.server.store.store import Store
from adamps.server.store.tables.rowblock import ApplyStats, RowPush
from adamps.server.store.tickets import owner_future
from adamps.server.updates.optim import Optimizer
from adamps.tables import TableSpec, row_shard_id
from adamps.wire import protocol
from adamps.wire.protocol import ProtocolError

NAN = float("nan")
ROWS = row_shard_id("t", 0)


@pytest.fixture
def store() -> Iterator[Store]:
    s = Store(n_buckets=1, owner_threads=2)
    try:
        for name, shape in (("w", (4, 3)), ("w@y", (4, 3)), ("v", (5,))):
            s.define(
                TensorSpec(name, shape), Optimizer("sgd", -1.0), normalize_init(None, shape), None
            )
        s.tables.define(TableSpec("t", 2), [0])
        yield s
    finally:
        s.close()


@pytest.fixture
def addressing(store: Store) -> Addressing:
    """The primary's addressing of a standalone server (no lease to check)."""
    return Addressing(PsConfig(n_buckets=1), store, None)


def secondary_refusal(store: Store, *updates: Any) -> ProtocolError | StoreError:
    """What a secondary answers to a PREPARE of bucket 0 holding `updates` (one push), sent
    through the real wire encoding with its valid digest: the error its intake raises."""
    pushes = [list(updates)]
    batch = {
        "seq": 1,
        "epoch": 1,
        "updates": pushes,
        "clients": [None],
        "x": updates_digest(pushes),
    }
    msg = {"bucket": 0, "sender": "ps0", "epoch": 1, "commit": 0, "entries": [batch]}
    msg = protocol.decode(protocol.encode(msg))
    with pytest.raises((ProtocolError, StoreError)) as exc:
        asyncio.run(repl_check.checked_message(store, {0}, "repl_prepare", msg))
    return exc.value


def refused(fn: Callable[..., Any], *args: Any) -> ProtocolError | StoreError:
    with pytest.raises((ProtocolError, StoreError)) as exc:
        fn(*args)
    return exc.value


def f32(*shape: int, fill: float = 1.0) -> np.ndarray:
    return np.full(shape, fill, np.float32)


def words(*idx: int) -> np.ndarray:
    return codec.pack_words(np.array(idx), np.zeros(len(idx), bool))


def row_block(store: Store, values: np.ndarray) -> bytes:
    """The bytes of a row block of table t holding rows 1.. with `values` (RowBlock.tobytes)."""
    blk = store.tables.shard(ROWS).table.new_block()
    ids = np.arange(1, len(values) + 1, dtype=np.int64)
    blk.assign(RowPush(ids, values.astype(np.float32), 0.0, True), ApplyStats())
    return blk.tobytes()


# -- every kind: the secondary refuses what the primary refuses, with the same code ----------------

#: (case, the replicated update a PREPARE carries, the code a secondary answers). The primary's
#: request decoder of the same input is checked beside it in test_the_primary_refuses_*.
REPLICATED: list[tuple[str, Callable[[Store], dict[str, Any]], str]] = [
    ("dense: wrong dtype", lambda s: dense.update("v/0", np.ones(5, np.float64)), "bad_shape"),
    ("dense: truncated", lambda s: dense.update("v/0", f32(4)), "bad_shape"),
    ("dense: NaN", lambda s: dense.update("v/0", f32(5, fill=NAN)), "non_finite"),
    ("dense: beyond the bound", lambda s: dense.update("v/0", f32(5, fill=1e13)), "bad_request"),
    ("dense: unknown shard", lambda s: dense.update("nope/0", f32(5)), "unknown_shard"),
    ("dense: id not a string", lambda s: {"k": "d", "s": 5, "d": f32(5)}, "bad_request"),
    ("fc: wrong width", lambda s: fc.update("w", ["w/0"], f32(1, 4), f32(1, 4)), "bad_shape"),
    ("fc: k = 0", lambda s: fc.update("w", ["w/0"], f32(0, 3), f32(0, 4)), "bad_shape"),
    ("fc: NaN", lambda s: fc.update("w", ["w/0"], f32(1, 3, fill=NAN), f32(1, 4)), "non_finite"),
    ("fc: int vectors", lambda s: fc.update("w", ["w/0"], np.ones((1, 3), np.int32), f32(1, 4)), "bad_shape"),
    ("fc: another tensor's shard", lambda s: fc.update("w", ["v/0"], f32(1, 3), f32(1, 4)), "bad_request"),
    ("fc: a shard twice", lambda s: fc.update("w", ["w/0", "w/0"], f32(1, 3), f32(1, 4)), "bad_request"),
    ("compressed: tau NaN", lambda s: compressed.update("v/0", NAN, {"w": words(1)}), "non_finite"),
    ("compressed: tau 1e39", lambda s: compressed.update("v/0", 1e39, {"w": words(1)}), "bad_request"),
    ("compressed: index out of range", lambda s: compressed.update("v/0", 0.5, {"w": words(9)}), "bad_request"),
    ("compressed: int32 words", lambda s: compressed.update("v/0", 0.5, {"w": words(1).astype(np.int32)}), "bad_dtype"),
    ("compressed: truncated rice", lambda s: compressed.update("v/0", 0.5, {"r": np.array([0xFF], np.uint8), "n": 3, "b": 0}), "bad_request"),
    ("rows: float ids", lambda s: rows.update(ROWS, np.ones(1), f32(1, 2), 1.0), "bad_shape"),
    ("rows: wrong dim", lambda s: rows.update(ROWS, np.array([1]), f32(1, 3), 1.0), "bad_shape"),
    ("rows: NaN", lambda s: rows.update(ROWS, np.array([1]), f32(1, 2, fill=NAN), 1.0), "non_finite"),
    ("rows: time inf", lambda s: rows.update(ROWS, np.array([1]), f32(1, 2), float("inf")), "bad_request"),
    ("put_rows: an id twice", lambda s: rows.update(ROWS, np.array([1, 1]), f32(2, 2), 1.0, True), "bad_request"),
    ("install: NaN values", lambda s: install.update("v/0", f32(5, fill=NAN), None), "non_finite"),
    ("install: beyond the bound", lambda s: install.update("v/0", f32(5, fill=1e37), None), "bad_request"),
    ("install: truncated", lambda s: install.update("v/0", f32(4), None), "bad_shape"),
    ("install: negative version", lambda s: install.update("v/0", f32(5), None, -1), "bad_request"),
    ("row install: truncated block", lambda s: install.row_update(ROWS, row_block(s, f32(2, 2))[:-3]), "bad_request"),
    ("row install: NaN rows", lambda s: install.row_update(ROWS, row_block(s, f32(2, 2, fill=NAN))), "non_finite"),
    ("row install: not bytes", lambda s: {"k": "j", "s": ROWS, "b": "text"}, "bad_request"),
    ("vector: alpha inf", lambda s: {"k": "v", "o": "axpy", "s": ["w/0"], "y": "y", "x": "", "a": float("inf")}, "bad_request"),
    ("vector: unknown op", lambda s: {"k": "v", "o": "pow", "s": ["w/0"], "y": "y", "x": "", "a": 1.0}, "bad_request"),
    ("vector: set beyond the shard", lambda s: {"k": "v", "o": "set", "s": ["w/0"], "y": "y", "x": "", "a": 0.0, "v": f32(3), "f": 11}, "bad_shape"),
    ("vector: unknown vector", lambda s: {"k": "v", "o": "scale", "s": ["w/0"], "y": "z", "x": "", "a": 2.0}, "unknown_tensor"),
    ("unknown kind", lambda s: {"k": "z", "s": "v/0"}, "bad_request"),
    ("not a map", lambda s: ["d", "v/0"], "bad_request"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "make", "code"), REPLICATED, ids=[c for c, *_ in REPLICATED])
def test_a_secondary_refuses_a_malformed_replicated_update_of_every_kind(
    store: Store, case: str, make: Callable[[Store], Any], code: str
) -> None:
    keep = dense.update("v/0", f32(5))  # a good update beside it: the batch is refused whole
    err = secondary_refusal(store, keep, make(store))
    assert err.code == code, err


def test_what_a_secondary_refuses_changes_nothing_and_a_good_batch_then_applies(
    store: Store,
) -> None:
    before = read(store, "v/0")
    secondary_refusal(
        store, dense.update("v/0", f32(5)), install.update("v/0", f32(5, fill=NAN), None)
    )
    np.testing.assert_array_equal(read(store, "v/0"), before)
    good = {"bucket": 0, "sender": "ps0", "epoch": 1, "commit": 0,
            "entries": [batch_to_wire(Batch(1, 1, ((dense.update("v/0", f32(5)),),), (None,)))]}  # fmt: skip
    m = asyncio.run(
        repl_check.checked_message(
            store, {0}, "repl_prepare", protocol.decode(protocol.encode(good))
        )
    )
    bucket_copy.apply_batches(store, m["entries"])
    np.testing.assert_array_equal(read(store, "v/0"), before + 1.0)  # sgd, lr -1


def read(store: Store, sid: str) -> np.ndarray:
    st = store.shard(sid)
    out = [np.empty(st.shard.size, np.float32)]

    async def go() -> None:
        await owner_future(lambda cb: store.read([st], out, cb))

    asyncio.run(go())
    return out[0]


# -- the primary's request decoders: the same checks, the same codes --------------------------------


def test_the_primary_refuses_bad_dense_pushes(store: Store, addressing: Addressing) -> None:
    of = dense.of_shards
    assert refused(of, store, addressing, {"v/0": np.ones(5)}, 64, True).code == "bad_dtype"
    assert refused(of, store, addressing, {"v/0": f32(4)}, 64, True).code == "bad_shape"
    nan = refused(of, store, addressing, {"v/0": f32(5, fill=NAN)}, 64, True)
    assert nan.code == "non_finite" and "'v/0'" in nan.message
    assert (
        refused(of, store, addressing, {"v/0": f32(5), "v/1": f32(5)}, 1, True).code == "too_large"
    )
    assert refused(of, store, addressing, {"nope/0": f32(5)}, 64, True).code == "unknown_shard"
    short = {"dense_shards": ["v/0", "w/0"], "dense": f32(16)}  # a truncated payload
    assert refused(dense.of_round, store, addressing, short, 64).code == "bad_shape"
    # the replicated decoder names the same problem with the same code
    assert dense.replicated(store, dense.update("v/0", f32(5)))[0][0] is store.shard("v/0")
    assert (
        refused(dense.replicated, store, dense.update("v/0", f32(5, fill=NAN))).message
        == nan.message
    )


def test_the_primary_refuses_bad_fc_vectors(store: Store, addressing: Addressing) -> None:
    def layer(**fields: Any) -> Any:
        return refused(fc.layer, store, addressing, "w", fields)

    assert layer(a=f32(1, 3, fill=NAN), e=f32(1, 4)).code == "non_finite"
    assert layer(a=f32(2, 3), e=f32(1, 4)).code == "bad_shape"
    assert layer(a=f32(1, 2), e=f32(1, 4)).code == "bad_shape"
    assert layer(a=np.ones((1, 3)), e=f32(1, 4)).code == "bad_dtype"
    assert layer(a=f32(1, 3), e=f32(1, 4), shards=["v/0"]).code == "bad_request"
    assert (
        refused(fc.layer, store, addressing, "v", {"a": f32(1, 5), "e": f32(1, 1)}).code
        == "bad_request"
    )
    big = layer(a=f32(1, 3, fill=1e7), e=f32(1, 4, fill=1e7))
    assert big.code == "bad_request"
    u = fc.update("w", ["w/0"], f32(1, 3, fill=1e7), f32(1, 4, fill=1e7))
    assert refused(fc.replicated, store, u).message == big.message


def test_the_primary_refuses_bad_compressed_updates(store: Store, addressing: Addressing) -> None:
    def decode(shards: Any) -> Any:
        run, _large = compressed.decoder(store, addressing, {"shards": shards})
        return run()

    assert refused(decode, {}).code == "bad_request"
    assert refused(decode, {"v/0": {"tau": NAN, "words": words(1)}}).code == "non_finite"
    out = refused(decode, {"v/0": {"tau": 0.5, "words": words(9)}})  # index 9 of 5 elements
    assert out.code == "bad_request"
    rep = refused(compressed.replicated, store, compressed.update("v/0", 0.5, {"w": words(9)}))
    assert rep.message == out.message
    cut = {"v/0": {"tau": 0.5, "rice": np.array([0xFF], np.uint8), "n": 3, "k": 0}}
    assert refused(decode, cut).code == "bad_request"
    assert (
        refused(decode, {"v/0": {"tau": 0.5, "words": words(1).astype(np.int64)}}).code
        == "bad_dtype"
    )
    assert refused(decode, {"v/0": [0.5]}).code == "bad_request"


def test_the_primary_refuses_bad_row_values(store: Store) -> None:
    ids = np.array([3, 1, 3], np.int64)
    nan = refused(rows.check_values, "grads", ids[:2], f32(2, 2, fill=NAN), False)
    assert nan.code == "non_finite"
    dup = refused(rows.check_values, "values", ids, f32(3, 2), True)
    assert dup.code == "bad_request" and "id 3 more than once" in dup.message
    rep = refused(rows.replicated, store, rows.update(ROWS, ids, f32(3, 2), 1.0, True))
    assert rep.message == dup.message
    rows.check_values("grads", ids, f32(3, 2), False)  # gradients may name an id twice


def test_an_install_is_checked_alike_on_the_primary_and_every_copy(store: Store) -> None:
    st = store.shard("v/0")
    nan = refused(install.shard, store, st, install.update("v/0", f32(5, fill=NAN), None))
    assert nan.code == "non_finite"
    assert (
        refused(install.replicated, store, install.update("v/0", f32(5, fill=NAN), None)).message
        == nan.message
    )
    assert (
        refused(install.shard, store, st, install.update("v/0", f32(5), f32(3))).code == "bad_shape"
    )
    rst = store.tables.shard(ROWS)
    bad = refused(install.row_shard, rst, row_block(store, f32(1, 2, fill=NAN)), None)
    assert bad.code == "non_finite"
    assert refused(install.row_shard, rst, b"\x00\x01", None).code == "bad_request"
    got = install.row_shard(rst, row_block(store, f32(2, 2)), 4)
    assert got.version == 4


def test_a_vector_op_is_checked_alike_on_the_primary_and_every_copy(store: Store) -> None:
    assert refused(vector.alpha, float("inf")).code == "bad_request"
    assert refused(vector.alpha, True).code == "bad_request"
    assert refused(vector.set_values, f32(2, fill=1e25)).code == "bad_request"
    ok = {"k": "v", "o": "axpy", "s": ["w/0"], "y": "y", "x": "", "a": 2.0}
    [(dst, op)] = vector.replicated(store, ok)
    assert dst is store.shard("w@y/0") and op.alpha == 2.0


# -- every kind takes exactly the fields its encoder writes (session 20: unknown fields refused) ---

#: (case, an update of that kind as its encoder writes it, with every optional field)
WRITTEN: list[tuple[str, Callable[[Store], dict[str, Any]]]] = [
    ("dense", lambda s: dense.update("v/0", f32(5), {"lr": 0.5})),
    ("fc", lambda s: fc.update("w", ["w/0"], f32(1, 3), f32(1, 4), {"lr": 0.5})),
    ("compressed words", lambda s: compressed.update("v/0", 0.5, {"w": words(1)}, {"lr": 0.5})),
    ("compressed rice", lambda s: compressed.update("v/0", 0.5, rice(1, 3), {"lr": 0.5})),
    ("rows", lambda s: rows.update(ROWS, np.array([1]), f32(1, 2), 1.0)),
    ("put_rows", lambda s: rows.update(ROWS, np.array([1]), f32(1, 2), 1.0, True)),
    ("install", lambda s: install.update("v/0", f32(5), None, 3)),
    ("row install", lambda s: install.row_update(ROWS, row_block(s, f32(2, 2)), 3)),
    ("vector", lambda s: {"k": "v", "o": "axpy", "s": ["w/0"], "y": "y", "x": "", "a": 2.0}),
    ("vector set", lambda s: {"k": "v", "o": "set", "s": ["w/0"], "y": "y", "x": "", "a": 0.0, "v": f32(3), "f": 1}),
]  # fmt: skip

#: per case, a field its kind does not take: a misspelling, another kind's field, or a field of
#: the kind's other form (a words update's Rice count, a set's values on an axpy)
FOREIGN = {
    "dense": "delta",
    "fc": "d",
    "compressed words": "r",
    "compressed rice": "w2",
    "rows": "o",
    "put_rows": "assign",
    "install": "b",
    "row install": "v",
    "vector": "v",
    "vector set": "offset",
}


def rice(*idx: int) -> dict[str, Any]:
    """The Rice form (``{"r", "n", "b"}``) of a compressed update of the indices `idx`."""
    data, k = codec.rice_encode(np.array(idx), np.zeros(len(idx), bool), 1)
    return {"r": np.frombuffer(data, np.uint8), "n": len(idx), "b": k}


@pytest.mark.parametrize(("case", "make"), WRITTEN, ids=[c for c, _ in WRITTEN])
def test_every_kind_refuses_a_field_it_does_not_take_and_takes_every_field_written(
    store: Store, case: str, make: Callable[[Store], dict[str, Any]]
) -> None:
    """Each kind's decoder takes every field its encoder may write (and so every record an
    earlier version wrote: no field was ever dropped from an encoder) and refuses any other,
    400 bad_request naming it: on the copy's PREPARE intake and in the decoder itself, which
    a batch read back from disk or from a state transfer goes through when it is applied."""
    u = make(store)
    assert decode.replicated(store, u)  # every field the encoder writes is taken
    field = FOREIGN[case]
    bad = {**u, field: 1}
    err = refused(decode.replicated, store, bad)
    assert err.code == "bad_request" and err.extra["unknown"] == [field], err
    assert f"a {u['k']!r} update takes no field {field!r}" in err.message, err.message
    assert set(u) <= set(err.extra["fields"]) and field not in err.extra["fields"], err.extra
    err = secondary_refusal(store, dense.update("v/0", f32(5)), bad)
    assert err.code == "bad_request" and err.extra["unknown"] == [field], err
    # the same update without it decodes on the intake and applies like any other
    good = {"bucket": 0, "sender": "ps0", "epoch": 1, "commit": 0,
            "entries": [batch_to_wire(Batch(1, 1, ((u,),), (None,)))]}  # fmt: skip
    asyncio.run(
        repl_check.checked_message(
            store, {0}, "repl_prepare", protocol.decode(protocol.encode(good))
        )
    )


def test_the_fields_each_kind_takes_are_the_documented_ones() -> None:
    """docs/protocol-ps.md lists each replicated kind's fields: the decoders' sets, in order."""
    doc = (Path(__file__).parents[2] / "docs" / "protocol-ps.md").read_text()
    sets = {
        "d": dense.FIELDS,
        "f": fc.FIELDS,
        "c": compressed.WORDS_FIELDS | compressed.RICE_FIELDS,
        "r": rows.FIELDS,
        "i": install.FIELDS,
        "j": install.ROW_FIELDS,
        "v": vector.SET_FIELDS,
    }
    for kind, takes in sets.items():
        row = next(ln for ln in doc.splitlines() if ln.startswith(f'| `"{kind}"` |'))
        named = set(re.findall(r"`(\w+)`", row.split("|")[2]))
        assert named == takes - {"k"}, (kind, named, takes)
