"""Strom's compression end to end without sockets: the trainer's residual and error feedback
(Strom 2.4, 2.6), its choice of form per push, and the server's sparse apply against the dense
apply of the decoded delta (docs/protocol-ps.md, "Update semantics")."""

from __future__ import annotations

import numpy as np
import pytest

from adamps.compression import codec
from adamps.compression.codec import parse_taus
from adamps.compression.error_feedback import Compressor, Encoded, TensorCompressor
from adamps.layout import Layout, TensorSpec
from adamps.server.decode import compressed
from adamps.server.decode.compressed import words_of
from adamps.server.store.initial import normalize_init
from adamps.server.store.store import Store
from adamps.server.updates import optim
from adamps.server.updates.optim import Dense, Fc, Optimizer, Scratch, Signs

# -- server: sparse apply == dense apply of the decoded delta ----------------------------------


def sparse_update(size: int, n: int, tau: float, seed: int) -> Signs:
    rng = np.random.default_rng(seed)
    idx = np.sort(rng.choice(size, n, replace=False))
    return Signs(codec.pack_words(idx, rng.random(n) < 0.5), tau)


@pytest.mark.parametrize(
    "opt",
    [
        Optimizer("sgd", 0.1),
        Optimizer("sgd", -1.0),
        Optimizer("adagrad_legacy", 0.05, {"eps": 1e-8, "initial_accumulator": 0.1}),
    ],
)
def test_sparse_apply_equals_dense_apply_of_the_decoded_delta(opt: Optimizer) -> None:
    rng = np.random.default_rng(0)
    shape = (40, 25)
    w = rng.standard_normal(shape).astype(np.float32)
    acc = np.full(shape, 0.1, np.float32) if opt.has_accumulator else None
    w_dense, acc_dense = w.copy(), None if acc is None else acc.copy()
    scratch = Scratch(1000)
    for step, tau in enumerate([0.5, 0.25, 2.0]):
        u = sparse_update(w.size, 100, tau, seed=step)
        optim.apply_batch(opt, w, acc, [u], scratch)
        d = codec.decode_dense(u.words, u.tau, w.size).reshape(shape)
        optim.apply_batch(opt, w_dense, acc_dense, [Dense(d)], scratch)
        np.testing.assert_allclose(w, w_dense, rtol=1e-6, atol=1e-7)
        if acc is not None:
            np.testing.assert_array_equal(acc, acc_dense)
    if opt.lr == -1.0:
        np.testing.assert_array_equal(w, w_dense)  # adding +-tau is exact


def test_adagrad_on_sparse_updates_touches_only_the_sent_elements() -> None:
    opt = Optimizer("adagrad_legacy", 0.1, {"initial_accumulator": 0.1})
    w = np.ones(10, np.float32)
    acc = np.full(10, 0.1, np.float32)
    u = Signs(codec.pack_words(np.array([2, 7]), np.array([False, True])), 0.5)
    optim.apply_batch(opt, w, acc, [u], Scratch(10))
    assert acc.tolist() == pytest.approx([0.1] * 2 + [0.35] + [0.1] * 4 + [0.35] + [0.1] * 2)
    step = 0.1 * 0.5 / np.sqrt(0.35 + 1e-8)
    assert w[2] == pytest.approx(1 - step) and w[7] == pytest.approx(1 + step)
    assert (w[[0, 1, 3, 4, 5, 6, 8, 9]] == 1).all()


def test_a_batch_mixing_kinds_equals_applying_them_in_order() -> None:
    rng = np.random.default_rng(3)
    for opt in (
        Optimizer("sgd", 0.1),
        Optimizer("adagrad_legacy", 0.1, {"initial_accumulator": 0.1}),
    ):
        w = rng.standard_normal((20, 10)).astype(np.float32)
        acc = np.full_like(w, 0.1) if opt.has_accumulator else None
        a = rng.standard_normal((3, 10)).astype(np.float32)
        e = rng.standard_normal((3, 20)).astype(np.float32)
        ups = [
            Fc(a, e),
            sparse_update(200, 30, 0.5, 1),
            Dense(rng.standard_normal(200).astype(np.float32)),
            sparse_update(200, 5, 1.0, 2),
        ]
        w1, acc1 = w.copy(), None if acc is None else acc.copy()
        optim.apply_batch(opt, w1, acc1, ups, Scratch(200))
        for u in ups:
            optim.apply_batch(opt, w, acc, [u], Scratch(200))
        np.testing.assert_allclose(w1, w, rtol=1e-5, atol=1e-6)


def test_replicated_form_decodes_to_the_same_update_as_the_client_form() -> None:
    idx = np.array([0, 3, 99])
    neg = np.array([True, False, True])
    words = codec.pack_words(idx, neg)
    data, k = codec.rice_encode(idx, neg, size=100)
    rice = np.frombuffer(data, np.uint8)
    for client in ({"tau": 0.5, "words": words}, {"tau": 0.5, "n": 3, "k": k, "rice": rice}):
        got, tau = words_of(client, 100, "s")
        assert got.tolist() == words.tolist() and tau == 0.5
        form = {"w": words} if "words" in client else {"r": rice, "n": 3, "b": k}
        entry = compressed.update("x/0", tau, form)
        assert entry["k"] == "c"
        store = Store(n_buckets=1, owner_threads=1)
        try:
            opt = Optimizer("sgd", 0.1)
            store.define(TensorSpec("x", (100,)), opt, normalize_init(None, (100,)), None)
            [(_st, signs)] = compressed.replicated(store, entry)
        finally:
            store.close()
        assert signs.words.tolist() == words.tolist()


@pytest.mark.parametrize(
    "bad",
    [
        {"tau": 0.0, "words": np.array([2], np.uint32)},
        {"tau": float("nan"), "words": np.array([2], np.uint32)},
        {"tau": 1.0, "words": np.array([2, 2], np.uint32)},
        {"tau": 1.0, "words": np.array([200], np.uint32)},
        {"tau": 1.0, "words": np.array([2], np.int32)},
        {"tau": 1.0, "n": 1, "k": 0, "rice": np.array([0xFF], np.uint8)},
        {"tau": 1.0},
    ],
)
def test_malformed_compressed_updates_are_refused(bad: dict) -> None:
    from adamps.wire.protocol import ProtocolError

    with pytest.raises(ProtocolError):
        words_of(bad, 100, "s")


# -- trainer: residual and error feedback --------------------------------------------------------


def layout(shape: tuple[int, ...] = (64, 50), max_elems: int = 1000) -> Layout:
    return Layout([TensorSpec("w", shape)], n_buckets=4, max_shard_elems=max_elems)


def dyadic(rng: np.random.Generator, n: int) -> np.ndarray:
    """Gradients that are multiples of 1/64 in [-2, 2]: every sum below is exact in float32."""
    return (rng.integers(-128, 129, n) / 64).astype(np.float32)


def decoded(enc: Encoded, lay: Layout) -> np.ndarray:
    out = np.zeros(lay.tensors["w"].size, np.float32)
    for sid, d in enc.shards.items():
        s = lay.shards[sid]
        words, tau = words_of(d, s.size, sid)
        out[s.start : s.stop] += codec.decode_dense(words, tau, s.size)
    return out


@pytest.mark.parametrize("coding", ["words", "rice"])
@pytest.mark.parametrize("tau", [0.5, None])
def test_sent_plus_residual_equals_the_sum_of_gradients(coding: str, tau: float | None) -> None:
    """Strom 2.4: nothing is lost, only delayed. Exact with dyadic values and tau."""
    lay = layout()
    tc = TensorCompressor("w", lay.shards_of["w"], tau=tau, fraction=0.02, coding=coding)
    rng = np.random.default_rng(5)
    total = np.zeros(tc.size, np.float64)
    sent = np.zeros(tc.size, np.float64)
    for _ in range(30):
        g = dyadic(rng, tc.size)
        total += g
        enc = tc.offer(g)
        assert isinstance(enc, Encoded)
        sent += decoded(enc, lay)
        if tau is None:
            assert enc.sent >= 0.02 * tc.size  # ties can add a few
        np.testing.assert_array_equal(sent + tc.residual, total)
    assert len(lay.shards_of["w"]) == 4  # 3200 elements in shards of 1000 rows' worth


def test_adaptive_tau_sends_the_target_fraction_of_elements() -> None:
    lay = layout((100, 100), 10_000)
    tc = TensorCompressor("w", lay.shards_of["w"], fraction=0.01)
    g = np.random.default_rng(6).standard_normal(10_000).astype(np.float32)
    enc = tc.offer(g)
    assert isinstance(enc, Encoded) and enc.sent == 100
    assert enc.nbytes == codec.words_size(100)
    assert tc.last_tau == pytest.approx(np.sort(np.abs(g))[-100])


def test_smallest_form_is_chosen_and_the_residual_follows() -> None:
    lay = Layout(
        [TensorSpec("w", (64, 50)), TensorSpec("b", (1,))], n_buckets=4, max_shard_elems=1000
    )
    comp = Compressor(lay.shards_of, fraction=0.01, coding="words")
    rng = np.random.default_rng(7)
    a = rng.standard_normal((2, 50)).astype(np.float32)  # 2 * (64 + 50) * 4 = 912 bytes
    e = rng.standard_normal((2, 64)).astype(np.float32)
    b = np.array([0.25], np.float32)
    parts, st = comp.compress([("fc", "w", a, e), ("dense", "b", b)])
    # w: 32 elements as words (4 shards: 4 * 4 + 32 * 4 = 144 bytes) beat 912 bytes of vectors
    assert [p[0] for p in parts] == ["compressed", "dense"]
    assert st.choices == {"vectors": 0, "compressed": 1, "dense": 1}
    assert st.sent_elements == 32 + 1 and st.elements == 3200 + 1
    # b: one element as a word (8 bytes) is larger than dense (4): sent exactly, residual zero
    assert parts[1][2].tolist() == [0.25] and comp.of("b").residual.tolist() == [0.0]
    # vectors when they are smaller: a 1-row push against 10% of the elements
    comp2 = Compressor(lay.shards_of, fraction=0.1)
    r0 = comp2.of("w").residual.copy()
    parts, st = comp2.compress([("fc", "w", a[:1], e[:1])])
    assert parts[0][0] == "fc" and st.choices["vectors"] == 1
    np.testing.assert_array_equal(comp2.of("w").residual, r0)  # unchanged: vectors are exact


def test_parse_taus() -> None:
    assert parse_taus(["0.5", "fc1.w=2", "conv1.b=1e-3"]) == (
        0.5,
        {"fc1.w": 2.0, "conv1.b": 1e-3},
    )
    for bad in (["x=abc"], ["0"], ["w=-1"], ["inf"]):
        with pytest.raises(ValueError):
            parse_taus(bad)


def test_a_fetch_installs_the_unsent_residual_in_the_workers_units() -> None:
    lay = Layout([TensorSpec("w", (10,)), TensorSpec("b", (4,))], n_buckets=4)
    comp = Compressor(lay.shards_of, taus=["1.0"], coding="words")
    comp.compress([("dense", "w", np.full(10, 0.25, np.float32))])  # nothing reaches tau
    params = np.ones(14, np.float32)
    comp.add_residuals(params, {"w": slice(0, 10), "b": slice(10, 14)}, -0.5)
    np.testing.assert_array_equal(params, [0.875] * 10 + [1.0] * 4)
