"""Issue 36, item 3: a push is validated once into the parts that are applied.

The primary validated a push into store parts (a compressed update decoded, fc vectors cut per
shard, row pushes), dropped them, encoded the compact maps, and rebuilt the parts from the maps
when the round committed. Now the parts ride with the maps (``decode.Checked``) and are
applied as they are, once; the map alone goes on the wire and to disk, and is what every later
use (a resend, a flush, a state that changed meanwhile) builds from.

Real store (owner threads) and the real commit of bucket_copy; no sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from adamps.compression import codec
from adamps.core.replication.values import Batch
from adamps.layout import TensorSpec
from adamps.server.decode import checked, compressed, store_parts
from adamps.server.replication import bucket_copy
from adamps.server.replication import check as repl_check
from adamps.server.replication.wire import batch_to_wire
from adamps.server.store.initial import normalize_init
from adamps.server.store.store import Store
from adamps.server.store.tickets import owner_future
from adamps.server.updates.optim import Optimizer, Signs
from adamps.server.writepath import _parts_by_state
from adamps.wire import protocol


@pytest.fixture
def store() -> Iterator[Store]:
    s = Store(n_buckets=1, owner_threads=2)
    try:
        for name in ("F..w", "keep"):
            s.define(
                TensorSpec(name, (6,)), Optimizer("sgd", -1.0), normalize_init(None, (6,)), None
            )
        yield s
    finally:
        s.close()


def validated(store: Store, sid: str) -> tuple[dict, list]:
    """A compressed update of shard `sid` as the primary validates it: decoded once."""
    words = codec.pack_words(np.array([0, 5]), np.array([False, True]))
    u = compressed.update(sid, 0.5, {"w": words})
    st = store.shard(sid)
    return u, [(st, Signs(words, 0.5))]


def count_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = compressed.words_of
    monkeypatch.setattr(compressed, "words_of", lambda *a: calls.append(1) or real(*a))
    return calls


def value(store: Store, sid: str) -> np.ndarray:
    out = [np.empty(6, np.float32)]
    asyncio.run(_read(store, sid, out))
    return out[0]


async def _read(store: Store, sid: str, out: list) -> None:
    await owner_future(lambda cb: store.read([store.shard(sid)], out, cb))


def test_the_primary_applies_the_parts_it_validated_and_rebuilds_nothing(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    decodes = count_decodes(monkeypatch)
    u, parts = validated(store, "keep/0")
    c = checked(u, parts)
    # the same map on the wire and on disk (the parts are no field of it)
    assert protocol.decode(protocol.encode({"u": c}))["u"].keys() == u.keys()
    before = value(store, "keep/0").copy()

    bucket_copy.apply_batches(store, [Batch(1, 1, ((c,),), (("c", 1),))])  # read after it
    assert decodes == [], "the commit decoded the update the push had decoded already"
    moved = value(store, "keep/0") - before
    assert moved[0] == pytest.approx(0.5) and moved[5] == pytest.approx(-0.5)
    # applied once: a later use of the map (a resend, a flush, a new primary) builds from it
    assert store_parts(store, [(c,)])[0][0] is store.shard("keep/0")
    assert decodes == [1]


def test_parts_of_a_state_replaced_since_are_built_again_from_the_map(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    decodes = count_decodes(monkeypatch)
    u, parts = validated(store, "F..w/0")
    c = checked(u, parts)
    old = store.shard("F..w/0")
    store.forget_tensors(["F..w"])  # a deleted run's tensor, defined again meanwhile
    store.define(TensorSpec("F..w", (6,)), Optimizer("sgd", -1.0), normalize_init(None, (6,)), None)
    (got,) = store_parts(store, [(c,)])
    assert got[0] is store.shard("F..w/0") and got[0] is not old
    assert decodes == [1]


def test_no_part_is_kept_when_a_shard_is_named_twice_or_has_none(store: Store) -> None:
    st = store.shard("keep/0")
    part = (st, "p")
    assert _parts_by_state([([st], None)], [part]) == {id(st): [part]}
    assert _parts_by_state([([st], None), ([st], None)], [part]) is None
    assert _parts_by_state([([st], None)], []) is None
    assert _parts_by_state([([st], None)], None) is None


def test_a_secondary_decodes_a_batch_once_from_its_prepare_to_its_commit(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its PREPARE's check decoded a compressed update and dropped the result; the commit
    decoded it again (issue 41, item 2). Now the PREPARE's decoding is what the commit
    applies."""
    decodes = count_decodes(monkeypatch)
    u, _parts = validated(store, "keep/0")
    prepare = {"bucket": 0, "sender": "ps0", "epoch": 1, "commit": 0,
               "entries": [batch_to_wire(Batch(1, 1, ((u,),), (None,)))]}  # fmt: skip
    msg = protocol.decode(protocol.encode(prepare))  # as a secondary receives it
    m = asyncio.run(repl_check.checked_message(store, {0}, "repl_prepare", msg))
    assert decodes == [1]
    before = value(store, "keep/0").copy()
    bucket_copy.apply_batches(store, m["entries"])
    assert decodes == [1], "the commit decoded the update the PREPARE had decoded already"
    assert (value(store, "keep/0") - before)[0] == pytest.approx(0.5)


def test_a_committed_batch_is_applied_without_a_round_trip_through_the_event_loop(
    store: Store,
) -> None:
    """Issue 36: every committed batch on every copy made a future, a cross-thread wakeup of
    the event loop and a gather, for a result no one awaited. It is queued to the owner
    threads alone now: no running loop is needed, and work queued after it sees it."""
    u, _parts = validated(store, "keep/0")
    before = value(store, "keep/0").copy()
    bucket_copy.apply_batches(store, [Batch(1, 1, ((u,),), (None,))])  # no event loop here
    assert (value(store, "keep/0") - before)[0] == pytest.approx(0.5)
