"""Issue 39, finding 1: a run deleted while its pushes are in a replication round.

A batch holds the updates of several pushes of one bucket, from several tenants. When a run is
deleted, each server drops its tensors and tables as it learns of it; a batch in flight may
then name them. Such an update is refused alone (``unknown_tensor``/``unknown_table`` to its
client): the batch's other updates are checked (a secondary's PREPARE) and applied (the commit,
on the primary and on the secondaries) as before, for every update kind. Before, building the
store's parts raised StoreError inside the shell's drain, and the bucket took no push again.

Real store (owner threads), the real decoders (adamps/server/decode/) and the apply of
bucket_copy; no sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from adamps.compression import codec
from adamps.core.replication.values import Batch
from adamps.layout import TensorSpec
from adamps.server import decode
from adamps.server.decode import store_parts
from adamps.server.decode.compressed import update as sign_update
from adamps.server.decode.dense import update as dense_update
from adamps.server.decode.fc import update as fc_update
from adamps.server.decode.install import update as install_update
from adamps.server.decode.rows import update as row_update
from adamps.server.replication import bucket_copy
from adamps.server.store.initial import normalize_init
from adamps.server.store.shards import StoreError
from adamps.server.store.store import Store
from adamps.server.updates.optim import Optimizer
from adamps.tables import TableSpec, row_shard_id
from adamps.wire.protocol import ProtocolError

#: every part in bucket 0
N_BUCKETS = 1


@pytest.fixture
def store() -> Iterator[Store]:
    s = Store(n_buckets=N_BUCKETS, owner_threads=2)
    try:
        for name, shape in (("F..w", (4, 3)), ("F..w@v", (4, 3)), ("keep", (5,))):
            spec = TensorSpec(name, shape)
            s.define(spec, Optimizer("sgd", -1.0), normalize_init(None, shape), None)
        s.tables.define(TableSpec("F..t", 2), [0])
        yield s
    finally:
        s.close()


def f_updates() -> list[dict]:
    """One update of every kind, each naming run F's tensor or table."""
    words = codec.pack_words(np.array([0, 5]), np.array([False, True]))  # two signs
    return [
        dense_update("F..w/0", np.ones(12, np.float32)),
        fc_update("F..w", ["F..w/0"], np.ones((1, 3), np.float32), np.ones((1, 4), np.float32)),
        sign_update("F..w/0", 0.5, {"w": words}),
        row_update(
            row_shard_id("F..t", 0), np.array([7], np.int64), np.ones((1, 2), np.float32), 1.0
        ),
        {"k": "v", "o": "axpy", "s": ["F..w/0"], "y": "v", "x": "", "a": 2.0},
        install_update("F..w/0", np.ones(12, np.float32), None),
    ]


def batch(store: Store) -> Batch:
    """A round's batch: each F update a push of its own between two pushes of the operator's
    tensor `keep`, and one push mixing both."""
    keep = dense_update("keep/0", np.full(5, 1.0, np.float32))
    pushes = [(keep,)] + [(u,) for u in f_updates()] + [(keep,), (f_updates()[0], keep)]
    return Batch(1, 1, tuple(pushes), tuple(("c", i) for i in range(len(pushes))))


def check_batches(store: Store, batches: list[Batch]) -> None:
    """A secondary's PREPARE: every update decoded (repl_check.decoder)."""
    for b in batches:
        for push in b.updates:
            for u in push:
                decode.decoded(store, u)


def delete_run_f(store: Store) -> None:
    """What tenancy.learn does when the controllers' run table says run F was deleted."""
    store.forget_tensors([n for n in store.tensors if n.startswith("F..")])
    store.tables.forget("F..t")
    store.deleted_runs = frozenset({"F"})


def keep_value(store: Store) -> np.ndarray:
    out = [np.empty(5, np.float32)]

    async def read() -> None:
        from adamps.server.store.tickets import owner_future

        await owner_future(lambda cb: store.read([store.shard("keep/0")], out, cb))

    asyncio.run(read())
    return out[0]


def test_the_batch_applies_whole_while_the_run_lives(store: Store) -> None:
    b = batch(store)
    check_batches(store, [b])  # every kind is well formed
    assert len(store_parts(store, b.updates)) >= 9


def test_a_deleted_runs_updates_are_refused_alone_at_the_primarys_commit(store: Store) -> None:
    b = batch(store)
    delete_run_f(store)

    # the primary's (and a secondary's) apply at commit; raised StoreError("no shard
    # 'F..w/0' on this server") before
    bucket_copy.apply_batches(store, [b])
    # The operator's three pushes of the same batch applied (sgd with lr -1: +1 each).
    np.testing.assert_array_equal(keep_value(store), np.full(5, 3.0, np.float32))


def test_a_secondary_that_learned_of_the_deletion_first_accepts_the_prepare(store: Store) -> None:
    """A secondary may drop the run before its primary does: the PREPARE naming the run's
    tensors must pass its checks (a refusal is retried with the same batch forever), and its
    store parts are those of the other updates only, as the primary's will be."""
    b = batch(store)
    delete_run_f(store)
    check_batches(store, [b])  # raised StoreError unknown_shard before
    parts = store_parts(store, b.updates)
    assert [st.id for st, _ in parts] == ["keep/0"] * 3


def test_an_unknown_tensor_of_a_live_run_still_refuses_the_prepare(store: Store) -> None:
    """A tensor not created here yet (its create is on the way) is no deleted run's: the
    secondary refuses the PREPARE and the primary sends it again, as before."""
    b = Batch(1, 1, ((dense_update("G..w/0", np.ones(3, np.float32)),),), (None,))
    store.deleted_runs = frozenset({"F"})
    with pytest.raises((StoreError, ProtocolError)):
        check_batches(store, [b])
    # and a tensor of the deleted run that is still held here (created again) is applied
    b2 = Batch(1, 1, ((dense_update("F..w/0", np.ones(12, np.float32)),),), (None,))
    assert [st.id for st, _ in store_parts(store, b2.updates)] == ["F..w/0"]


def test_a_committed_update_that_cannot_be_applied_never_raises_out_of_the_drain(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever a committed batch names, apply_batches raises nothing (the shell's drain must
    answer the round's pushes and send its messages): the update is skipped and logged."""
    keep = dense_update("keep/0", np.full(5, 1.0, np.float32))
    b = Batch(1, 1, ((dense_update("nowhere/0", np.ones(3, np.float32)),), (keep,)), (None, None))

    bucket_copy.apply_batches(store, [b])
    np.testing.assert_array_equal(keep_value(store), np.full(5, 1.0, np.float32))
    assert "cannot be applied" in caplog.text
