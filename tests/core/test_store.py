"""The store (owner threads, batching, reads, snapshots), initial values and LMDB persistence.

Real threads and a real LMDB environment in a temporary directory; no sockets.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from adamps.layout import TensorSpec, stable_bucket
from adamps.server.storage.flusher import Flusher
from adamps.server.storage.persist import Persister, Position, _unpack
from adamps.server.store.checksum import unseal
from adamps.server.store.initial import fans, initial_values, normalize_init
from adamps.server.store.shards import StoreError, fc_parts
from adamps.server.store.store import Store
from adamps.server.updates.optim import Dense, Optimizer


@pytest.fixture
def store() -> Iterator[Store]:
    s = Store(n_buckets=16, owner_threads=3, max_shard_elems=1000)
    try:
        yield s
    finally:
        s.close()


def wait(submit: Any, timeout: float = 10.0) -> dict[str, int]:
    fut: Future = Future()

    def done(result: Any, error: BaseException | None) -> None:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(dict(result))

    submit(done)
    return fut.result(timeout)


def define(
    store: Store,
    name: str,
    shape: tuple[int, ...],
    opt: Optimizer | None = None,
    init: dict | None = None,
):
    spec = TensorSpec(name, shape)
    return store.define(spec, opt or Optimizer("sgd", -1.0), normalize_init(init, shape), None)


def pull(store: Store, name: str) -> tuple[np.ndarray, list[int]]:
    t = store.tensors[name]
    out = np.empty(t.spec.shape, np.float32)
    flat = out.reshape(-1)
    sts = [t.shards[s.index] for s in t.layout_shards]
    versions = wait(
        lambda cb: store.read(sts, [flat[st.shard.start : st.shard.stop] for st in sts], cb)
    )
    return out, [versions[st.id] for st in sts]


def push_dense(store: Store, name: str, delta: np.ndarray) -> dict[str, int]:
    t = store.tensors[name]
    flat = delta.reshape(-1)
    parts = [(t.shards[s.index], Dense(flat[s.start : s.stop])) for s in t.layout_shards]
    return wait(lambda cb: store.push(parts, cb))


def test_exact_sum_from_concurrent_pushers(store: Store) -> None:
    """After ps-lite: N pushes of known values with lr=-1 SGD pull back exactly N times them."""
    define(store, "w", (50, 70))  # 3500 elements -> 4 shards (rows of 70, 14 rows per shard)
    assert len(store.tensors["w"].shards) == 4
    n_threads, n_pushes = 4, 50
    delta = (
        np.arange(3500, dtype=np.float32).reshape(50, 70) % 7 - 3
    )  # small ints: exact in float32

    def pusher() -> None:
        for _ in range(n_pushes):
            push_dense(store, "w", delta)

    threads = [threading.Thread(target=pusher) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    values, versions = pull(store, "w")
    assert np.array_equal(values, delta * (n_threads * n_pushes))
    assert versions == [n_threads * n_pushes] * 4
    assert store.applied["dense"] == 4 * n_threads * n_pushes


def test_each_shard_has_one_owner_by_stable_hash(store: Store) -> None:
    t = define(store, "v", (5000,))
    for st in t.shards.values():
        assert st.owner == stable_bucket(st.id, 3)


def test_fc_push_updates_row_blocks_like_numpy(store: Store) -> None:
    t = define(store, "fc", (40, 60), Optimizer("sgd", 0.5), {"kind": "uniform", "seed": 3})
    w0, _ = pull(store, "fc")
    a = np.random.default_rng(1).standard_normal((8, 60)).astype(np.float32)
    e = np.random.default_rng(2).standard_normal((8, 40)).astype(np.float32)
    sts = [t.shards[s.index] for s in t.layout_shards]
    assert len(sts) == 3  # 16 rows per shard: the PS computes row blocks
    wait(lambda cb: store.push(fc_parts(t, a, e, sts), cb))
    w1, versions = pull(store, "fc")
    np.testing.assert_allclose(w1, w0 - 0.5 * (e.T.astype(np.float64) @ a), rtol=1e-5, atol=1e-5)
    assert versions == [1, 1, 1]


def test_only_held_buckets_are_stored() -> None:
    held = {0, 1, 2, 3}
    s = Store(n_buckets=8, buckets=held, owner_threads=1, max_shard_elems=100)
    try:
        t = define(s, "big", (2000,))
        assert 0 < len(t.shards) < 20 and not t.held_all
        assert all(s.layout.bucket_of[st.id] in held for st in t.shards.values())
        with pytest.raises(StoreError) as err:
            s.shard("big/999")
        assert err.value.code == "unknown_shard"
    finally:
        s.close()


def test_read_and_snapshot_see_every_update_queued_before_them(store: Store) -> None:
    t = define(store, "x", (10,))
    st = t.shards[0]
    for _ in range(100):
        store.push([(st, Dense(np.ones(10, np.float32)))], lambda r, e: None)
    snaps = store.snapshot_dirty()
    assert [(s.shard_id, s.version) for s in snaps] == [("x/0", 100)]
    _version, value, _accum = _unpack(unseal(snaps[0].record))
    assert np.array_equal(value, np.full(10, 100, np.float32))
    assert store.snapshot_dirty() == [] and store.oldest_dirty() is None


def test_a_failing_batch_is_reported_and_the_owner_keeps_running(store: Store) -> None:
    t = define(store, "y", (6,))
    st = t.shards[0]
    bad = Dense(np.ones(5, np.float32))  # wrong length: the app never lets this through
    with pytest.raises(ValueError):
        wait(lambda cb: store.push([(st, bad)], cb))
    assert push_dense(store, "y", np.ones(6, np.float32)) == {"y/0": 1}


@pytest.mark.parametrize(
    "init,check",
    [
        ({"kind": "zeros"}, lambda v: np.all(v == 0)),
        ({"kind": "constant", "value": 1.5}, lambda v: np.all(v == 1.5)),
        (
            {"kind": "uniform", "low": -1, "high": 2, "seed": 1},
            lambda v: v.min() >= -1 and v.max() <= 2,
        ),
        ({"kind": "normal", "mean": 3, "std": 0.1, "seed": 1}, lambda v: abs(v.mean() - 3) < 0.05),
        ({"kind": "xavier", "seed": 1}, lambda v: np.abs(v).max() <= np.sqrt(6 / (30 + 20))),
    ],
)
def test_initial_values(init: dict, check: Any) -> None:
    norm = normalize_init(init, (20, 30))
    v = initial_values((20, 30), norm)
    assert v.dtype == np.float32 and v.shape == (20, 30) and check(v)
    assert np.array_equal(
        v, initial_values((20, 30), normalize_init(init, (20, 30)))
    )  # same everywhere


def test_fans_of_dense_and_conv_weights() -> None:
    assert fans((20, 30)) == (30, 20)
    assert fans((8, 3, 5, 5)) == (75, 200)
    assert fans((7,)) == (7, 7)


@pytest.mark.parametrize(
    "init,code",
    [
        ({"kind": "ones"}, "bad_request"),
        ({"kind": "uniform", "low": 1, "high": 0}, "bad_request"),
        ({"kind": "normal", "std": float("inf")}, "bad_request"),
        ({"kind": "zeros", "value": 1}, "bad_request"),
        ({"kind": "values", "values": np.zeros((2, 2), np.float64)}, "bad_dtype"),
        ({"kind": "values", "values": np.zeros((3, 2), np.float32)}, "bad_shape"),
        ({"kind": "values", "values": np.full((2, 2), np.nan, np.float32)}, "non_finite"),
    ],
)
def test_bad_init_descriptions(init: dict, code: str) -> None:
    with pytest.raises(StoreError) as err:
        normalize_init(init, (2, 2))
    assert err.value.code == code


# -- persistence ---------------------------------------------------------------------------------


def meta(store: Store, name: str, seq: int) -> dict:
    t = store.tensors[name]
    return {
        "spec": t.spec.to_dict(),
        "optimizer": t.optimizer.to_dict(),
        "init": t.init,
        "seq": seq,
    }


def test_flush_and_reload_round_trip(tmp_path: Path, store: Store) -> None:
    define(store, "a", (3000,), Optimizer("adagrad", 0.1), {"kind": "normal", "seed": 2})
    define(store, "b", (30, 40))
    p = Persister(tmp_path / "db", map_size=1 << 20)
    for i, name in enumerate(("a", "b")):
        t = store.tensors[name]
        p.write_tensor(
            meta(store, name, i),
            [(st.id, st.version, st.value, st.accum) for st in t.shards.values()],
        )
    flusher = Flusher(store, p, interval=3600)
    push_dense(store, "a", np.full(3000, 0.5, np.float32))
    push_dense(store, "b", np.ones((30, 40), np.float32))
    assert flusher.loss_window() >= 0 and store.dirty_count() == 5
    stats = flusher.flush()
    assert stats["shards"] == 5 and flusher.loss_window() == 0.0
    a_vals, a_versions = pull(store, "a")
    p.close()

    p2 = Persister(tmp_path / "db", map_size=1 << 20)
    saved = p2.load()
    assert [s.meta["spec"]["name"] for s in saved] == ["a", "b"]
    other = Store(n_buckets=16, owner_threads=2, max_shard_elems=1000)
    try:
        for s in saved:
            other.define(
                TensorSpec.from_dict(s.meta["spec"]),
                Optimizer.from_dict(s.meta["optimizer"]),
                s.meta["init"],
                None,
                s.shards,
            )
        vals, versions = pull(other, "a")
        assert np.array_equal(vals, a_vals) and versions == a_versions == [1, 1, 1]
        for sid, st in store.shards.items():
            if st.accum is not None:
                assert np.array_equal(other.shards[sid].accum, st.accum)
        assert np.array_equal(pull(other, "b")[0], np.ones((30, 40), np.float32))  # lr=-1 adds
    finally:
        other.close()
        p2.close()


def test_prepared_batches_are_written_with_the_cut_and_replaced_by_the_next(
    tmp_path: Path,
) -> None:
    """The ``prepared`` database holds exactly what the last cut held prepared, per bucket."""
    batch = {
        "seq": 8,
        "epoch": 3,
        "updates": [[{"k": "d", "s": "w/0", "d": np.arange(4, dtype=np.float32)}]],
        "clients": [["c", 1]],
    }
    p = Persister(tmp_path / "db", map_size=1 << 20)
    p.write_snapshots([], {0: Position(3, 7, [], prepared=[batch]), 1: Position(2, 5, [])})
    p.close()
    p = Persister(tmp_path / "db", map_size=1 << 20)
    got = p.load_positions()
    assert (got[0].epoch, got[0].seq, got[1].prepared) == (3, 7, [])
    [b] = got[0].prepared
    assert (b["seq"], b["epoch"], b["clients"]) == (8, 3, [["c", 1]])
    np.testing.assert_array_equal(b["updates"][0][0]["d"], np.arange(4, dtype=np.float32))
    p.write_snapshots([], {0: Position(3, 8, []), 1: Position(2, 5, [])})  # 8 applied since
    assert p.load_positions()[0].prepared == []
    p.write_snapshots([], {1: Position(2, 5, [], prepared=[{**batch, "seq": 6}])})
    got = p.load_positions()
    assert 0 not in got and [x["seq"] for x in got[1].prepared] == [6]
    p.close()


def test_map_full_grows_the_map(tmp_path: Path) -> None:
    p = Persister(tmp_path / "db", map_size=256 << 10)
    small = p.env.info()["map_size"]
    big = np.ones(200_000, np.float32)  # 800 KB: more than the whole map
    with pytest.raises(lmdb.MapFullError):  # the library really refuses at this size
        with p.env.begin(write=True) as txn:
            txn.put(b"probe", big.tobytes(), db=p._shards)
    p.write_tensor(
        {"spec": {"name": "t", "shape": [200_000], "dtype": "float32"}, "optimizer": {"kind": "sgd", "lr": 1.0},
         "init": {"kind": "zeros"}, "seq": 0},
        [("t/0", 7, big, None)],
    )  # fmt: skip
    assert p.map_grows >= 1 and p.env.info()["map_size"] > small
    saved = p.load()
    assert saved[0].shards["t/0"][0] == 7 and np.array_equal(saved[0].shards["t/0"][1], big)
    p.close()


def test_background_flusher_writes_without_being_asked(tmp_path: Path, store: Store) -> None:
    t = define(store, "c", (100,))
    p = Persister(tmp_path / "db")
    st = t.shards[0]
    p.write_tensor(meta(store, "c", 0), [(st.id, 0, st.value, None)])
    flusher = Flusher(store, p, interval=0.05)
    flusher.start()
    try:
        push_dense(store, "c", np.ones(100, np.float32))
        saved_version = 0
        for _ in range(200):  # up to 10 s on a loaded machine; typically one interval
            saved_version = p.load()[0].shards["c/0"][0]
            if saved_version == 1 and flusher.loss_window() == 0.0:
                break
            threading.Event().wait(0.05)
        assert saved_version == 1 and flusher.loss_window() == 0.0
    finally:
        flusher.stop()
        p.close()


def test_push_group_is_one_batch_per_shard_and_replicas_end_identical() -> None:
    """Replication hook: the same groups on two stores give bit-identical shards."""
    results = []
    for _ in range(2):
        s = Store(n_buckets=16, owner_threads=2, max_shard_elems=1000)
        try:
            t = define(s, "g", (40, 60), Optimizer("adagrad", 0.1), {"kind": "uniform", "seed": 4})
            sts = [t.shards[x.index] for x in t.layout_shards]
            g = np.random.default_rng(9)
            for round_ in range(3):
                parts = fc_parts(
                    t,
                    g.standard_normal((4, 60)).astype(np.float32),
                    g.standard_normal((4, 40)).astype(np.float32),
                    sts,
                )
                parts += [(sts[1], Dense(g.standard_normal((16, 60)).astype(np.float32)))]
                versions = wait(lambda cb, parts=parts, s=s: s.push_group(parts, cb))
                # shard 1 got two updates per round (fc + dense) in one batch, the others one
                assert versions[sts[1].id] == 2 * (round_ + 1)
                assert versions[sts[0].id] == round_ + 1
            results.append([(st.value.tobytes(), st.accum.tobytes(), st.version) for st in sts])
        finally:
            s.close()
    assert results[0] == results[1]


def test_read_with_accumulators_and_overwrite(store: Store) -> None:
    t = define(store, "o", (500,), Optimizer("adagrad_legacy", 0.1))
    st = t.shards[0]
    push_dense(store, "o", np.full(500, 2.0, np.float32))
    out, acc = np.empty(500, np.float32), np.empty(500, np.float32)
    versions = wait(lambda cb: store.read([st], [out], cb, accums=[acc]))
    assert versions == {"o/0": 1} and np.array_equal(acc, np.full(500, 4.0, np.float32))
    store.snapshot_dirty()
    versions = wait(
        lambda cb: store.overwrite(
            [st], [np.ones(500, np.float32)], [np.zeros(500, np.float32)], [42], cb
        )
    )
    assert versions == {"o/0": 42} and store.dirty_count() == 1
    wait(lambda cb: store.read([st], [out], cb, accums=[acc]))
    assert np.array_equal(out, np.ones(500, np.float32)) and not acc.any()
    with pytest.raises(StoreError):
        store.overwrite([st], [np.ones(3, np.float32)], [None], [1], lambda r, e: None)


def test_a_replicated_store_holds_only_its_buckets() -> None:
    """Under controllers a server materialises shards per assigned bucket, from the tensor's
    initial values (a state transfer then overwrites them), and drops them with the bucket."""
    s = Store(n_buckets=8, buckets=frozenset(), owner_threads=2, max_shard_elems=100)
    try:
        init = {"kind": "uniform", "seed": 3, "low": -1.0, "high": 1.0}
        t = define(s, "w", (40, 50), init=init)  # 20 shards over 8 buckets
        assert t.shards == {} and s.shards == {}
        buckets = sorted({s.layout.bucket_of[x.id] for x in t.layout_shards})
        b = buckets[0]
        mine = [x for x in t.layout_shards if s.layout.bucket_of[x.id] == b]
        assert s.hold_bucket(b) == len(mine) and s.hold_bucket(b) == 0
        whole = initial_values((40, 50), normalize_init(init, (40, 50))).reshape(-1)
        for x in mine:
            np.testing.assert_array_equal(s.shard(x.id).value.reshape(-1), whole[x.start : x.stop])
        # A tensor defined later gets shards in the held buckets only.
        t2 = define(s, "v", (1000,))
        assert {s.layout.bucket_of[s2.shard.id] for s2 in t2.shards.values()} <= {b}
        held = len(mine) + sum(1 for x in t2.layout_shards if s.layout.bucket_of[x.id] == b)
        assert s.release_bucket(b) == held
        assert all(s.layout.bucket_of[sid] != b for sid in s.shards)
        with pytest.raises(StoreError):
            s.shard(mine[0].id)
        assert s.release_bucket(b) == 0
    finally:
        s.close()
